"""Run the trainer's fused kernels (``fleetmpi/kernels/*.cu``) on the host through their GPU
branch.

A test calls the public function of ``fleetmpi.kernels`` with the GPU path switched on (the
``gpu_path`` fixture), so the arguments the kernel receives are built by exactly the code that
launches it on a GPU; only the final ``launch`` is replaced by one that

* checks the arguments against the kernel's C signature in the ``.cu`` file (count, pointer
  dtypes, contiguity, scalar C types) and that ``n`` is the number of work items the kernel
  walks,
* runs ``<kernel>_<suffix>`` through ``cuda_host.load_on_host`` on a chosen grid x block (the
  loader's own geometry, or smaller ones so the grid-stride loop wraps),
* checks that the kernel left its ``const`` arguments as they were,

and the outputs, whose fresh buffers start out as NaN (floats) or 1 (others) so an element the
kernel skips fails the comparison, are compared with the reference.
"""
import functools
import re

import numpy as np
import pytest

from fleetmpi.core import backend
from fleetmpi import kernels
from fleetmpi.kernels import loader

from cublaslt_stand_in import install as install_cublaslt
from cuda_host import load_on_host

C_TYPES = {"float": "float32", "double": "float64", "__half": "float16", "bool": "bool",
           "long long": "int64", "int": "int32"}
# (grid, block): None is the loader's own geometry; the others have fewer threads than the
# larger cases of each test have work items (elements, or rows), so each thread walks several.
GEOMETRIES = [None, (1, 1), (3, 7), (2, 64)]
GEOMETRY_IDS = ["loader", "1x1", "3x7", "2x64"]
# Work items of kernels whose first count argument is not their number: {kernel: counts -> n}.
WORK_ITEMS = {"layer_norm_backward": lambda rows, cols: rows + cols,
              "attention_backward": lambda batch, q_len, k_len, *rest: batch * (q_len + k_len)}


def _argument_types(params, types):
    """``[(kind, dtype), ...]`` of a kernel's C parameter list; kind is ``const*``, ``*`` or
    ``scalar``, ``types`` maps the macro's type parameters to dtypes."""
    args = []
    for param in params.split(","):
        decl = " ".join(param.split()[:-1])  # drop the parameter's name
        pointer = decl.endswith("*")
        base = decl.rstrip("*").replace("const", "").strip()
        dtype = types.get(base) or C_TYPES[base]
        kind = ("const*" if "const" in decl else "*") if pointer else "scalar"
        args.append((kind, dtype))
    return args


@functools.lru_cache(maxsize=None)
def signatures(filename):
    """``{kernel_suffix: [(kind, dtype), ...]}`` of every instance the ``DEFINE_*`` macro of
    ``filename`` makes; checks that each suffix names its type parameters' dtypes, in order,
    each once (``loader.instance_suffix``)."""
    text = open(loader.source_path(filename)).read().replace("\\\n", "\n")
    (macro, params), = re.findall(r"^#define (DEFINE_\w+)\(([^)]*)\)", text, re.M)
    type_params = [p.strip() for p in params.split(",")][:-1]
    instances = re.findall(rf"^{macro}\(([^)]*)\)\s*$", text, re.M)
    assert instances, f"{filename}: no {macro} instantiations"
    kernels_found = re.findall(r'extern "C" __global__ void (\w+)_##SUFFIX\(([^)]*)\)', text)
    found = {}
    for instance in instances:
        *c_types, suffix = [a.strip() for a in instance.split(",")]
        types = {p: C_TYPES[c] for p, c in zip(type_params, c_types)}
        assert loader.instance_suffix(*types.values()) == suffix, f"{filename}: {instance}"
        for name, kernel_params in kernels_found:
            found[f"{name}_{suffix}"] = _argument_types(kernel_params, types)
    return found


class NanNumpy:
    """NumPy whose ``empty`` and ``empty_like`` fill floats with NaN and anything else with 1,
    so a kernel output the kernel leaves unwritten cannot pass for a computed one."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def _poisoned(out):
        out.fill(np.nan if out.dtype.kind == "f" else 1)
        return out

    def empty(self, *args, **kwargs):
        return self._poisoned(np.empty(*args, **kwargs))

    def empty_like(self, *args, **kwargs):
        return self._poisoned(np.empty_like(*args, **kwargs))


def _check_arguments(name, signature, args):
    assert isinstance(args, tuple) and len(args) == len(signature), name
    for index, (value, (kind, want)) in enumerate(zip(args, signature)):
        where = f"{name} argument {index}"
        if kind == "scalar":
            assert isinstance(value, np.generic), f"{where}: {type(value).__name__}"
        else:
            assert isinstance(value, np.ndarray), f"{where}: {type(value).__name__}"
            assert value.flags.c_contiguous, f"{where}: not contiguous"
        assert value.dtype == np.dtype(want), f"{where}: {value.dtype} for {want}"


def host_launch(geometry, launched):
    """A stand-in for ``fleetmpi.kernels.launch`` that runs the kernel on the host (module
    docstring), appending each kernel's name to ``launched``."""

    def launch(filename, kernel, suffix, n, args):
        name = f"{kernel}_{suffix}"
        signature = signatures(filename)[name]
        _check_arguments(name, signature, args)
        counts = [int(v) for v, (kind, dtype) in zip(args, signature)
                  if kind == "scalar" and dtype == "int64"]
        items = WORK_ITEMS.get(kernel, lambda first, *rest: first)(*counts)
        assert int(n) == items, f"{name}: launched over {n}, the kernel walks {items}"
        if geometry is None:
            block = loader.THREADS_PER_BLOCK
            grid = max(1, min(loader.MAX_BLOCKS, (int(n) + block - 1) // block))
        else:
            grid, block = geometry
        before = {i: v.copy() for i, (v, (kind, _)) in enumerate(zip(args, signature))
                  if kind == "const*"}
        load_on_host(loader.source_path(filename)).launch(name, grid, block, *args)
        for i, copy in before.items():
            np.testing.assert_array_equal(args[i], copy, err_msg=f"{name} wrote argument {i}")
        launched.append(kernel)

    return launch


@pytest.fixture
def gpu_path(monkeypatch, request):
    """Route ``fleetmpi.kernels`` through its GPU branch with kernels run on the host, on the
    (grid, block) of ``request.param``, and products through the stand-in cuBLASLt; the
    fixture's value is the list of kernels launched."""
    launched = []
    install_cublaslt(monkeypatch)
    monkeypatch.setattr(backend, "on_gpu", lambda: True)
    monkeypatch.setattr(backend, "array_module", lambda: NanNumpy())
    monkeypatch.setattr(kernels, "launch", host_launch(request.param, launched))
    return launched


def gpu_geometries(function):
    return pytest.mark.parametrize("gpu_path", GEOMETRIES, ids=GEOMETRY_IDS,
                                   indirect=True)(function)


def close(got, want, tolerance):
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape)
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)


def random(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)

"""The trainer's fused kernels (``fleetmpi/kernels/*.cu``) run on the host against their NumPy
references.

Each test calls the public function of ``fleetmpi.kernels`` with the GPU path switched on, so the
arguments the kernel receives are built by exactly the code that launches it on a GPU; only the
final ``launch`` is replaced by one that

* checks the arguments against the kernel's C signature in the ``.cu`` file (count, pointer
  dtypes, contiguity, scalar C types) and that ``n`` sizes the launch,
* runs ``<kernel>_<dtype>`` through ``cuda_host.load_on_host`` on a chosen grid x block (the
  loader's own geometry, or smaller ones so the grid-stride loop wraps),

and the outputs, whose fresh buffers start out as NaN so an element the kernel skips fails the
comparison, are compared with the reference to a tolerance that fits the dtype. The
multi-tensor optimizer kernels (``optimizer.cu``), whose arrays come as a table of addresses,
are checked the same way in ``tests/test_multi_tensor.py``.
"""
import re

import numpy as np
import pytest

import fleetmpi.nn.functional as F
from fleetmpi import Tensor, backend, kernels
from fleetmpi.kernels import loader, reference

from cuda_host import compile_for_device, load_on_host

FILES = {
    "bias_act.cu": ("bias_act_forward", "bias_act_backward"),
    "bn_act.cu": ("bn_act_forward", "bn_act_backward_mask", "bn_input_grad"),
}
DTYPES = [("float64", 1e-12), ("float32", 1e-5)]
# (grid, block): None is the loader's own geometry; the others are smaller than every tensor
# below with more than one element, so each thread walks several elements.
GEOMETRIES = [None, (1, 1), (3, 7), (2, 64)]
GEOMETRY_IDS = ["loader", "1x1", "3x7", "2x64"]
SHAPES = [(37, 13), (3, 5, 19), (5, 7, 3, 11), (1, 1)]
EMPTY = (0, 4)  # bias_act only: batch norm of no values has no statistics
C_TYPES = {"float": "float32", "double": "float64"}


def _signatures(filename):
    """``{kernel_dtype: [(kind, dtype), ...]}`` from the ``DEFINE_*`` macro of ``filename``;
    kind is ``const*``, ``*`` or ``scalar``."""
    text = open(loader.source_path(filename)).read().replace("\\\n", "\n")
    instances = re.findall(r"^DEFINE_\w+\((\w+),\s*(\w+)\)", text, re.M)
    assert instances, f"{filename}: no DEFINE_* instantiations"
    found = {}
    for name, params in re.findall(r'extern "C" __global__ void (\w+)_##SUFFIX\(([^)]*)\)', text):
        for c_type, suffix in instances:
            assert C_TYPES[c_type] == suffix, f"{filename}: {c_type} instantiated as {suffix}"
            args = []
            for param in params.split(","):
                decl = " ".join(param.split()[:-1])  # drop the parameter's name
                pointer = decl.endswith("*")
                base = decl.rstrip("*").replace("const", "").strip()
                dtype = {"T": suffix, "long long": "int64", "int": "int32"}[base]
                kind = ("const*" if "const" in decl else "*") if pointer else "scalar"
                args.append((kind, dtype))
            found[f"{name}_{suffix}"] = args
    return found


SIGNATURES = {f: _signatures(f) for f in FILES}


def test_signatures_cover_every_kernel_and_dtype():
    for filename, names in FILES.items():
        want = {f"{k}_{d}" for k in names for d in loader.KERNEL_DTYPES}
        assert set(SIGNATURES[filename]) == want


@pytest.mark.parametrize("filename", sorted(FILES))
def test_kernels_compile_for_the_device(filename):
    ptx = open(compile_for_device(loader.source_path(filename))).read()
    for name in SIGNATURES[filename]:
        assert f".entry {name}(" in ptx


class _NanNumpy:
    """NumPy whose ``empty_like`` fills with NaN, so a kernel output the kernel leaves unwritten
    cannot pass for a computed one."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def empty_like(a, *args, **kwargs):
        out = np.empty_like(a, *args, **kwargs)
        out.fill(np.nan)
        return out


@pytest.fixture
def gpu_path(monkeypatch, request):
    """Route ``fleetmpi.kernels`` through its GPU branch with kernels run on the host; the
    fixture's value is the list of kernels launched."""
    geometry = request.param
    launched = []

    def launch(filename, kernel, dtype, n, args):
        name = f"{kernel}_{dtype.name}"
        signature = SIGNATURES[filename][name]
        assert isinstance(args, tuple) and len(args) == len(signature), name
        for index, (value, (kind, want)) in enumerate(zip(args, signature)):
            where = f"{name} argument {index}"
            if kind == "scalar":
                assert isinstance(value, np.generic), f"{where}: {type(value).__name__}"
                assert value.dtype == np.dtype(want), f"{where}: {value.dtype} for {want}"
            else:
                assert isinstance(value, np.ndarray), f"{where}: {type(value).__name__}"
                assert value.dtype == np.dtype(want), f"{where}: {value.dtype} for {want}"
                assert value.flags.c_contiguous, f"{where}: not contiguous"
        counts = [int(v) for v, (kind, dt) in zip(args, signature) if dt == "int64"]
        assert int(n) == counts[0], f"{name}: launched over {n}, kernel told n={counts[0]}"
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

    monkeypatch.setattr(backend, "on_gpu", lambda: True)
    monkeypatch.setattr(backend, "array_module", lambda: _NanNumpy())
    monkeypatch.setattr(kernels, "launch", launch)
    return launched


def gpu_geometries(function):
    return pytest.mark.parametrize("gpu_path", GEOMETRIES, ids=GEOMETRY_IDS,
                                   indirect=True)(function)


def close(got, want, tolerance):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)


def random(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


@gpu_geometries
@pytest.mark.parametrize("dtype, tolerance", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + [EMPTY], ids=str)
@pytest.mark.parametrize("act", reference.ACTIVATIONS)
def test_bias_act_matches_the_reference(gpu_path, act, shape, dtype, tolerance):
    rng = np.random.default_rng([len(shape), shape[-1], len(act)])
    z = random(rng, shape, dtype, 2.0)
    bias = random(rng, shape[1], dtype)
    if z.size:
        z.flat[::5] = -bias[(np.arange(0, z.size, 5) // (z.size // shape[0] // shape[1]))
                            % shape[1]]  # pre-activation exactly 0: the ReLU boundary
    y, pre = kernels.bias_act_forward(z, bias, act)
    want_y, want_pre = reference.bias_act_forward(z, bias, act, np)
    close(y, want_y, tolerance)
    if act == "gelu":
        close(pre, want_pre, tolerance)
    else:
        assert pre is None and want_pre is None

    dy = random(rng, shape, dtype)
    dz = kernels.bias_act_backward(dy, want_y, want_pre, act)
    close(dz, reference.bias_act_backward(dy, want_y, want_pre, act, np), tolerance)
    assert gpu_path == ["bias_act_forward", "bias_act_backward"]


def _bn_inputs(rng, shape, dtype):
    channels = shape[1]
    x = random(rng, shape, dtype, 3.0) + 0.5
    mean = random(rng, channels, dtype)
    invstd = (rng.uniform(0.2, 3.0, channels)).astype(dtype)
    gamma = random(rng, channels, dtype)
    beta = random(rng, channels, dtype)
    return x, mean, invstd, gamma, beta


@gpu_geometries
@pytest.mark.parametrize("dtype, tolerance", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bn_act_matches_the_reference(gpu_path, shape, dtype, tolerance):
    rng = np.random.default_rng([len(shape), shape[-1], 7])
    x, mean, invstd, gamma, beta = _bn_inputs(rng, shape, dtype)
    y, kernel_xhat = kernels.bn_act_forward(x, mean, invstd, gamma, beta)
    want_y, want_xhat = reference.bn_act_forward(x, mean, invstd, gamma, beta, np)
    close(y, want_y, tolerance)
    assert kernel_xhat is None
    np.testing.assert_array_equal(want_xhat, reference.bn_xhat(x, mean, invstd))
    assert 0 < (want_y > 0).mean() < 1 or want_y.size <= 1

    dy = random(rng, shape, dtype)
    dz = kernels.bn_act_backward_mask(dy, want_y)
    want_dz = reference.bn_act_backward_mask(dy, want_y)
    close(dz, want_dz, tolerance)

    axes = (0,) + tuple(range(2, len(shape)))
    count = x.size // shape[1]
    xhat = reference.bn_xhat(x, mean, invstd)
    sum_dz, sum_dz_xhat = want_dz.sum(axis=axes), (want_dz * xhat).sum(axis=axes)
    dx = kernels.bn_input_grad(want_dz, xhat, invstd, gamma, sum_dz, sum_dz_xhat, count)
    want_dx = reference.bn_input_grad(want_dz, xhat, invstd, gamma, sum_dz, sum_dz_xhat, count)
    # every term is scaled by gamma * invstd / count; compare relative to that size
    scale = max(1.0, float(np.abs(want_dx).max(initial=0)))
    close(dx, want_dx, tolerance * scale)
    assert gpu_path == ["bn_act_forward", "bn_act_backward_mask", "bn_input_grad"]


def _fused_batch_norm_step(x, dy):
    """Output and gradients of a training batch norm + ReLU (``fuse_bn_act_ops``)."""
    channels = x.shape[1]
    xt = Tensor(x, stop_gradient=False)
    weight = Tensor(np.linspace(0.5, 1.5, channels).astype(x.dtype), stop_gradient=False)
    bias = Tensor(np.linspace(-0.2, 0.2, channels).astype(x.dtype), stop_gradient=False)
    y = F.batch_norm(xt, None, None, weight, bias, training=True, act="relu")
    y.backward(Tensor(dy))
    return [np.array(a) for a in (y.numpy(), xt.grad, weight.grad, bias.grad)]


@pytest.mark.parametrize("gpu_path", [None], indirect=True)
def test_fused_batch_norm_on_the_device_branch_equals_the_host(gpu_path):
    """The host keeps the normalized input from forward; the device kernel does not, and
    backward forms it again from the input: both give the same step."""
    rng = np.random.default_rng(11)
    x, dy = random(rng, (4, 3, 5, 6), "float64"), random(rng, (4, 3, 5, 6), "float64")
    on_device = _fused_batch_norm_step(x, dy)
    assert gpu_path[0] == "bn_act_forward" and "bn_input_grad" in gpu_path
    gpu_path.clear()
    with pytest.MonkeyPatch.context() as host:
        host.setattr(backend, "on_gpu", lambda: False)
        host.setattr(backend, "array_module", lambda: np)
        on_host = _fused_batch_norm_step(x, dy)
    assert gpu_path == []
    for got, want in zip(on_device, on_host):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


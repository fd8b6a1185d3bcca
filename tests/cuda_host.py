"""Check CUDA kernels without a GPU: compile them for the device, run their bodies on the host.

Contract for a kernel source (``*.cu``) that these helpers can check:

* Each kernel is ``extern "C" __global__`` (so its symbol name is its plain name, on the device
  for ``cupy.RawKernel`` and on the host for ``ctypes``), takes pointers and scalar arguments
  only, and walks its elements with a 1-D grid-stride loop
  (``for (i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x)``).
* Threads never cooperate: no ``__shared__`` memory, ``__syncthreads``, warp intrinsics or
  atomics. The host launcher runs the simulated threads one after another, so any kernel whose
  result depends on their interleaving is outside this contract.
* Helpers are ``__device__`` functions; templates are fine. ``__half`` comes from
  ``cuda_fp16.h`` (found through ``nvcc``'s include directory), with its conversion and
  arithmetic functions working on the host too. Headers included with quotes are found beside
  the file. Without ``nvcc`` a file that needs the toolkit's ``cuda_*.h`` headers is skipped.

Helpers:

``compile_for_device(cu_path)``
    ``nvcc --ptx`` the file (for ``DEVICE_ARCH``); fails the test with nvcc's message on a
    compile error; skips when ``nvcc`` is not on PATH.
``load_on_host(cu_path)``
    Compile the same file as host C++ through ``cuda_host_shim.h`` (``__global__`` and
    ``__device__`` defined away, ``gridDim``/``blockDim``/``blockIdx``/``threadIdx`` as globals)
    into a shared library; return a ``HostKernels`` whose ``launch(name, grid, block, *args)``
    runs kernel ``name`` for every simulated (block, thread), like
    ``cupy.RawKernel(...)((grid,), (block,), args)``. Arguments follow CuPy's convention:
    NumPy arrays pass their data pointer; scalars must be NumPy scalars (``np.int32(n)``,
    ``np.float32(lr)``...) so their C type is explicit; ``int`` is taken as a pointer value
    (``uint64``), the way a table of array addresses is passed.

A test then runs the kernel over NumPy buffers and compares with the NumPy reference that
defines its math. Use a grid and block whose product is smaller than the element count, so the
grid-stride loop is exercised.
"""
import atexit
import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SHIM = os.path.join(HERE, "cuda_host_shim.h")
DEVICE_ARCH = os.environ.get("FLEETMPI_TEST_CUDA_ARCH", "sm_80")
_BUILD = tempfile.mkdtemp(prefix="fleetmpi-cuda-host-")
atexit.register(shutil.rmtree, _BUILD, ignore_errors=True)

_SCALARS = {
    np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
    np.dtype(np.uint32): ctypes.c_uint32, np.dtype(np.uint64): ctypes.c_uint64,
    np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double,
}


def nvcc():
    """The path of ``nvcc``, or None."""
    return shutil.which("nvcc")


@functools.lru_cache(maxsize=None)
def cuda_include_dir():
    """CUDA's include directory (for ``cuda_fp16.h``) as ``nvcc`` itself passes it to the host
    compiler (the ``INCLUDES`` of its ``--dryrun``: ``nvcc`` may be a wrapper script away from
    the toolkit), or None."""
    path = nvcc()
    if path is None:
        return None
    done = subprocess.run([path, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                          capture_output=True, text=True)
    match = re.search(r'INCLUDES="-I([^"]+?)"', done.stdout + done.stderr)
    return match.group(1) if match and os.path.isdir(match.group(1)) else None


def _includes_toolkit_headers(cu_path, include_dirs=()):
    """Whether ``cu_path``, or a header it includes with quotes (found beside it or in
    ``include_dirs``), includes one of the toolkit's ``cuda_*.h`` headers."""
    with open(cu_path) as f:
        text = f.read()
    if re.search(r"#include\s*<cuda_\w+\.h>", text):
        return True
    for name in re.findall(r'#include\s*"([^"]+)"', text):
        found = [path for path in (os.path.join(folder, name) for folder in
                                   (os.path.dirname(cu_path), *include_dirs))
                 if os.path.isfile(path)]
        if found and _includes_toolkit_headers(found[0], include_dirs):
            return True
    return False


def _run(cmd, what):
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"{what} failed ({' '.join(cmd)}):\n{done.stdout}{done.stderr}")


def _build_path(cu_path, suffix, extra=""):
    with open(cu_path, "rb") as f:
        digest = hashlib.sha256(f.read() + (suffix + extra).encode()).hexdigest()[:16]
    return os.path.join(_BUILD, f"{os.path.basename(cu_path)}.{digest}{suffix}")


def compile_for_device(cu_path, options=("-std=c++17",)):
    """Compile ``cu_path`` to PTX with nvcc; return the PTX path."""
    if nvcc() is None:
        pytest.skip("nvcc is not on PATH")
    out = _build_path(cu_path, ".ptx")
    _run([nvcc(), "--ptx", f"-arch={DEVICE_ARCH}", *options, "-o", out, cu_path],
         f"nvcc of {os.path.basename(cu_path)}")
    return out


class HostKernels:
    """A ``.cu`` file's kernels compiled for the host; see the module docstring."""

    def __init__(self, library_path):
        self.library = ctypes.CDLL(library_path)
        self._set_thread = self.library.fleetmpi_host_set_thread
        self._set_thread.argtypes = [ctypes.c_uint] * 4

    @staticmethod
    def _argument(value):
        if isinstance(value, np.ndarray):
            return ctypes.c_void_p(value.ctypes.data)
        if isinstance(value, np.generic):
            if value.dtype not in _SCALARS:
                raise TypeError(f"no C type for a scalar of dtype {value.dtype}")
            return _SCALARS[value.dtype](value)
        if isinstance(value, int) and not isinstance(value, bool):
            return ctypes.c_uint64(value)
        raise TypeError(f"kernel arguments must be NumPy arrays or NumPy scalars, not "
                        f"{type(value).__name__}")

    def launch(self, name, grid, block, *args):
        """Run kernel ``name`` for every simulated thread of a 1-D ``grid`` x ``block`` launch."""
        kernel = getattr(self.library, name)
        kernel.restype = None
        converted = [self._argument(a) for a in args]
        for b in range(grid):
            for t in range(block):
                self._set_thread(grid, block, b, t)
                kernel(*converted)


def load_on_host(cu_path, compiler=None, include_dirs=()):
    """Compile ``cu_path``'s kernels as host code (g++ by default) and load them; headers it
    includes with quotes are found beside it, then in ``include_dirs``."""
    compiler = compiler or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no host C++ compiler on PATH")
    include = cuda_include_dir()
    if include is None and _includes_toolkit_headers(cu_path, include_dirs):
        pytest.skip(f"nvcc is not on PATH: the host build of {os.path.basename(cu_path)} takes "
                    "cuda_fp16.h from the CUDA toolkit")
    library = _build_path(cu_path, ".so", "".join(f" -I{d}" for d in include_dirs))
    if not os.path.exists(library):
        wrapper = library + ".cpp"
        with open(wrapper, "w") as f:
            f.write(f'#include "{SHIM}"\n#include "{os.path.abspath(cu_path)}"\n')
        _run([compiler, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wall",
              *(["-I", include] if include else []), *(f"-I{d}" for d in include_dirs),
              "-o", library, wrapper], f"host build of {os.path.basename(cu_path)}")
    return HostKernels(library)


def load_source_on_host(code, include_dirs=()):
    """``load_on_host`` of kernel source text (what ``cupy.RawModule(code=...)`` is given)."""
    digest = hashlib.sha256(code.encode()).hexdigest()[:16]
    path = os.path.join(_BUILD, f"source_{digest}.cu")
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write(code)
    return load_on_host(path, include_dirs=include_dirs)

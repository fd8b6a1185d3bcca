"""A stand-in for CuPy 14 over NumPy, on which the trainer takes its GPU branches on a CPU.

``install(monkeypatch)`` (the ``gpu_stand_in`` fixture of ``conftest.py``) makes a
``StandInCuPy`` the backend's array module and ``import cupy``'s module, so ``on_gpu()`` is
True; the fused kernels of ``fleetmpi/kernels/*.cu`` run compiled for the host
(``kernels.py``); cuDNN is absent (the frontend does not import), so convolution, batch norm
and attention take their paths without it; the rank generator is a device generator
(``generator.py``).

What it models (one device, one process):

* arrays in device memory, behind CuPy's interface (``arrays.py``): ``get()``, ``.data.ptr``
  (a host address, so kernels and pointer tables work), ``.device``, CuPy's refusals of NumPy
  arrays, 0-d results of reductions and element indexing;
* streams, events, graphs made by stream capture, memory pools and the process's allocator
  (``runtime.py``), with what CUDA and CuPy 14 refuse while a stream captures: a cuBLAS call
  through CuPy's wrappers (``NotImplementedError``), a copy to or from the host (CuPy's
  ``RuntimeError``), a synchronize of the stream or device (``CUDARuntimeError``
  ``cudaErrorStreamCaptureUnsupported``, which invalidates the capture), a wait on an event
  recorded outside the capture (``cudaErrorStreamCaptureIsolation``) and a wait on an event
  recorded inside it (``cudaErrorCapturedEvent``);
* a capture records each operation and a graph's launch runs them again, on what the arrays
  hold then, as a GPU replays kernels;
* counts (``Runtime.counting()``, a ``runtime.Counts``): kernel launches, library calls
  (cuBLAS through CuPy, NCCL; ``library_call`` is the hook for stand-ins of cuBLASLt and
  cuDNN), graph launches, allocations, memory taken from the device, host waits and copies
  from the host.

What it does not model: timing and concurrency (work runs in the order it is queued, at
once), more than one device or process (NCCL for one rank only, ``nccl.py``), CuPy's kernel
fusion and its own kernel counts inside one function (a NumPy function is one kernel here),
the pool's splitting of blocks and its per-stream free lists, values a GPU computes
differently (float32 sums in another order, so results match the NumPy backend to float
tolerance; transcendental functions), CuPy's random streams (``generator.py``), and which of
CuPy's operations refuse ml_dtypes' bfloat16 (the H200 run's bfloat16 amp failed with
"data type 'E' not understood"; here bfloat16 computes as NumPy's).
"""
import sys
import types

import numpy as np

from fleetmpi import kernels as fused_kernels
from fleetmpi.core import backend, cuda_source
from fleetmpi.nn.functional import cudnn

from . import arrays, functions, generator, nccl, products, runtime as cuda
from .kernels import RawKernel, RawModule

_OWN = {name: getattr(functions, name) for name in (
    "empty_like", "zeros", "zeros_like", "full", "full_like", "ones", "ones_like", "array",
    "asarray", "ascontiguousarray", "asnumpy", "copyto")}
_OWN.update({name: getattr(products, name) for name in (
    "matmul", "dot", "tensordot", "einsum")})
_OWN["empty"] = arrays.empty


class StandInCuPy:
    """The stand-in module: CuPy's names the trainer uses, NumPy's functions as device
    operations for the rest (``__getattr__``); ``runtime`` and ``counting()`` for tests."""

    __name__ = "cupy"
    __version__ = "14.2.0 (NumPy stand-in)"
    ndarray = arrays.ndarray
    RawModule, RawKernel = RawModule, RawKernel

    def __init__(self):
        self.runtime = cuda.Runtime()
        self.cuda = _cuda_namespace(self.runtime)
        self.random = types.SimpleNamespace(default_rng=generator.default_rng,
                                            Generator=generator.Generator)
        self.lib = types.SimpleNamespace(
            stride_tricks=types.SimpleNamespace(as_strided=functions.as_strided))
        self._wrapped = dict(_OWN)

    def counting(self):
        """``with cupy.counting() as counts:``, the ``runtime.Counts`` of the block."""
        return self.runtime.counting()

    def get_default_memory_pool(self):
        return self.runtime.default_pool

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in self._wrapped:
            found = getattr(np, name)
            if isinstance(found, np.ufunc):
                found = arrays.ufunc(found)
            elif callable(found) and not isinstance(found, type):
                found = _device_function(name, found)
            self._wrapped[name] = found
        return self._wrapped[name]


def _device_function(name, func):
    def device_function(*args, **kwargs):
        return arrays.call(name, func, args, kwargs)
    device_function.__name__ = name
    return device_function


def _cuda_namespace(runtime):
    """``cupy.cuda`` over ``runtime``."""
    def stream(null=False, non_blocking=False, ptds=False):
        return runtime.null if null else cuda.Stream(runtime, non_blocking=non_blocking)
    stream.null = runtime.null
    device_runtime = types.SimpleNamespace(
        is_hip=False, streamCaptureModeGlobal=0, streamCaptureModeThreadLocal=1,
        streamCaptureModeRelaxed=2, CUDARuntimeError=cuda.CUDARuntimeError,
        getDeviceCount=lambda: 1,
        memGetInfo=lambda: (cuda.DEVICE_MEMORY - runtime.default_pool.used_bytes(),
                            cuda.DEVICE_MEMORY),
        getDeviceProperties=lambda device: {"name": b"CuPy stand-in (NumPy)",
                                            "totalGlobalMem": cuda.DEVICE_MEMORY})
    return types.SimpleNamespace(
        runtime=device_runtime, driver=types.SimpleNamespace(CUDADriverError=cuda.CUDADriverError),
        Device=lambda device=None: cuda.Device(runtime, device), Stream=stream,
        Event=lambda block=False, disable_timing=False, interprocess=False: cuda.Event(runtime),
        get_current_stream=runtime.current_stream, get_elapsed_time=lambda start, end: 0.0,
        MemoryPool=lambda allocator=None: cuda.MemoryPool(runtime),
        MemoryPointer=cuda.MemoryPointer, alloc=runtime.alloc,
        get_allocator=runtime.get_allocator, set_allocator=runtime.set_allocator, nccl=nccl)


def library_call(library, name, run):
    """The hook for stand-ins of the libraries that queue their own kernels on CuPy's current
    stream (the cuBLASLt of ``tests/cublaslt_stand_in.py``, cuDNN's frontend): where this
    stand-in is installed, ``run()`` (the library's work) is queued as one call of
    ``library`` (counted in ``Counts.library_calls``, recorded by a capture, replayed by its
    graph); elsewhere it runs now."""
    runtime = arrays.current_runtime()
    if runtime is None:
        run()
    else:
        runtime.library_call(library, name, run)


def install(monkeypatch):
    """A new ``StandInCuPy`` as the backend's array module and ``sys.modules["cupy"]``, with
    cuDNN absent and the trainer's per-device caches empty, until ``monkeypatch`` undoes
    it. Returns the stand-in."""
    cupy = StandInCuPy()
    monkeypatch.setattr(arrays, "_runtime", cupy.runtime)
    monkeypatch.setattr(backend, "_xp", cupy)
    monkeypatch.setattr(backend, "_rank_rng", None)
    for name, module in (("cupy", cupy), ("cupy.cuda", cupy.cuda), ("cupy.cuda.nccl", nccl)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, "cudnn", None)  # ``import cudnn`` raises ImportError
    for name, empty in (("_frontend", None), ("_handle", None), ("_unusable", None),
                        ("_plans", {}), ("_declined_kinds", set())):
        monkeypatch.setattr(cudnn, name, empty)
    monkeypatch.setattr(fused_kernels, "_tables", {})
    monkeypatch.setattr(fused_kernels, "_no_overflow", {})
    cuda_source._module.cache_clear()
    return cupy

"""``cupy.RawModule`` and ``cupy.RawKernel`` on the host: the source is compiled as host C++
(``cuda_host.load_source_on_host``, with the ``-I`` folders of the module's options) at the
first launch, as CuPy compiles at the first call, and each launch is a kernel queued on the
current stream.

A launch runs as one host thread of a 1 x 1 launch walking every work item: the kernels of
``fleetmpi/kernels`` follow ``cuda_host``'s contract (a grid-stride loop, no cooperating
threads), under which the grid does not change the result, and simulating each of the
requested threads would take a Python call per thread. The geometries themselves are checked
by ``tests/test_kernels_host.py``.
"""
import numpy as np

from . import arrays

from cuda_host import load_source_on_host


def _argument(value):
    """A kernel argument as ``cuda_host`` takes it: CuPy passes a device array's pointer and
    NumPy or Python scalars by value, and refuses anything else (a NumPy array included)."""
    if isinstance(value, arrays.ndarray):
        return value._array
    if isinstance(value, (np.generic, int)) and not isinstance(value, (bool, np.bool_)):
        return value
    if isinstance(value, float):
        return np.float64(value)
    raise arrays.unsupported(value)


class RawModule:
    """``cupy.RawModule(code=..., options=...)``: kernels from CUDA source text."""

    def __init__(self, code=None, *, path=None, options=(), backend="nvrtc", **kwargs):
        if code is None:
            raise NotImplementedError("the CuPy stand-in compiles CUDA source (code=...) only")
        self.code = code
        self.options = tuple(options)
        self._host = None

    def get_function(self, name):
        return RawKernel(self, name)

    def host_kernels(self):
        if self._host is None:
            folders = [option[2:] for option in self.options if option.startswith("-I")]
            self._host = load_source_on_host(self.code, folders)
        return self._host


class RawKernel:
    """One kernel of a ``RawModule``: ``kernel(grid, block, args)`` queues it."""

    def __init__(self, module, name):
        self.module, self.name = module, name

    def __call__(self, grid, block, args, *, shared_mem=0):
        host_args = [_argument(value) for value in args]
        host = self.module.host_kernels()
        arrays.current_runtime().enqueue(
            self.name, lambda: host.launch(self.name, 1, 1, *host_args))

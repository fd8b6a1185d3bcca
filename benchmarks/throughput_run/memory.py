"""Peak memory of one training step, the same way for both trainers where they share a
device: a window (``with window: step()``) whose ``peak`` is the most bytes in use inside it.

* fleetmpi on a GPU: CuPy's default memory pool, in-use bytes (``used_bytes()``) read at every
  allocation from the pool by a ``cupy.cuda.MemoryHook``: the exact high-water mark, as
  ``torch.cuda.max_memory_allocated`` is PyTorch's (both count live arrays, not the blocks a
  pool keeps for reuse);
* PyTorch on a GPU: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``;
* either on the CPU: the process's peak resident memory inside the window (``VmHWM``, reset at
  its start through ``/proc/self/clear_refs``) less its resident memory before the model was
  built (``resident_bytes``).
"""
PAGE_RESET = "5"  # clear_refs: reset the peak resident set size to the current one


def _status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


def resident_bytes():
    """This process's resident memory now, or None where /proc does not say."""
    try:
        return _status_bytes("VmRSS")
    except OSError:
        return None


class ResidentPeak:
    """Peak resident memory in the window over ``baseline`` bytes; None where the peak cannot
    be reset (no ``/proc/self/clear_refs``)."""

    def __init__(self, baseline):
        self.baseline, self.peak = baseline, None
        self._reset = False

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write(PAGE_RESET)
            self._reset = self.baseline is not None
        except OSError:
            self._reset = False
        return self

    def __exit__(self, *exc):
        if self._reset:
            self.peak = _status_bytes("VmHWM") - self.baseline


def cupy_peak():
    """A window over CuPy's default memory pool (module docstring)."""
    import cupy

    pool = cupy.get_default_memory_pool()

    class PoolPeak(cupy.cuda.MemoryHook):
        name = "train_throughput_peak"

        def __init__(self):
            self.peak = None

        def __enter__(self):
            self.peak = pool.used_bytes()
            return super().__enter__()

        def malloc_postprocess(self, **kwargs):
            self.peak = max(self.peak, pool.used_bytes())

    return PoolPeak()


class TorchPeak:
    """A window over PyTorch's CUDA caching allocator (module docstring)."""

    def __init__(self):
        self.peak = None

    def __enter__(self):
        import torch

        torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc):
        import torch

        self.peak = torch.cuda.max_memory_allocated()

"""Freed host memory stays in the process for the next array (glibc's ``mallopt``).

A training step on NumPy allocates and frees the same large temporaries every step (columns,
normalized activations, gradients of a few MB each). glibc gives such blocks back to the kernel
when they are freed (``mmap`` above its threshold, heap trimming above 128 KiB of free top), so
the next step's arrays are fresh pages, and every 4 KiB page faults on first touch: measured,
a batch-norm layer of 32x16x32x32 float32 took 45 ms forward and backward with glibc's
defaults and 11 ms with the memory kept (docs/performance.md). Keeping freed blocks in the heap
(``M_MMAP_THRESHOLD`` at glibc's 32 MiB maximum, ``M_TRIM_THRESHOLD`` at 1 GiB) is what the
caching allocators of PyTorch and CuPy do for device memory; the cost is that the process keeps
its peak heap instead of returning it between steps.

``FLEETMPI_KEEP_HOST_MEMORY=0`` leaves glibc's defaults; on other C libraries nothing changes.
"""
import ctypes
import ctypes.util
import os

from .knobs import KEEP_HOST_MEMORY

# glibc's mallopt parameters (malloc.h) and the values set.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest allowed on 64-bit
TRIM_THRESHOLD_BYTES = 1 << 30

_kept = None


def wanted(environ=os.environ):
    """Whether ``FLEETMPI_KEEP_HOST_MEMORY`` asks to keep freed memory (unset: yes)."""
    return KEEP_HOST_MEMORY.value(environ)


def _glibc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version
        return libc
    except (OSError, AttributeError, TypeError):
        return None


def keep_freed_memory(libc=None, environ=os.environ):
    """Set glibc to keep freed blocks for reuse, once per process; True when it took effect."""
    global _kept
    if _kept is not None:
        return _kept
    libc = libc or _glibc()
    if not wanted(environ) or libc is None:
        _kept = False
        return _kept
    _kept = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return _kept

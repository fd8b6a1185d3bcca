"""Packing many arrays into one flat buffer and back: NumPy reference and one-launch GPU kernels.

``pack.cu`` holds the kernels; ``pack_reference`` / ``unpack_reference`` define their results.
"""
import numpy as np

from fleetmpi.core.cuda_source import raw_kernel, source_path

SOURCE = source_path(__file__, "pack.cu")
BLOCK = 256


def pack_reference(arrays, flat):
    """Copy ``arrays`` (any layout) one after another into the 1-D ``flat``."""
    offset = 0
    for a in arrays:
        flat[offset:offset + a.size] = a.reshape(-1)
        offset += a.size


def unpack_reference(flat, arrays):
    """Copy consecutive runs of the 1-D ``flat`` back into ``arrays``, in place."""
    offset = 0
    for a in arrays:
        a[...] = flat[offset:offset + a.size].reshape(a.shape)
        offset += a.size


def _launch(name, arrays, flat):
    import cupy

    ptrs = cupy.asarray(np.array([a.data.ptr for a in arrays], dtype=np.uint64))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([a.size for a in arrays], out=offsets[1:])
    total = int(offsets[-1])
    if total == 0:
        return
    grid = min((total + BLOCK - 1) // BLOCK, 4096)
    raw_kernel(SOURCE, name)((grid,), (BLOCK,),
                             (ptrs, cupy.asarray(offsets), np.int32(len(arrays)), flat,
                              np.int32(flat.itemsize)))


def pack_device(arrays, flat):
    """``pack_reference`` for C-contiguous CuPy arrays, in one kernel launch."""
    _launch("pack_arrays", arrays, flat)


def unpack_device(flat, arrays):
    """``unpack_reference`` for C-contiguous CuPy arrays, in one kernel launch."""
    _launch("unpack_arrays", arrays, flat)

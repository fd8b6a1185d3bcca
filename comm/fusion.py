"""Gradient fusion: many arrays reduced (or broadcast) as a few flat buckets.

Which arrays share a bucket is ``bucketing.plan_buckets``' plan (consecutive arrays of one
dtype up to the bucket size; an array larger than that is a bucket of its own). When a
bucket's arrays already lie back to back in one allocation (the trainer keeps parameters and
gradients as views of one flat buffer), the bucket is a view of that memory and needs no copy;
otherwise it is packed into a scratch buffer (on GPU by one batched kernel, ``pack.cu``) and
unpacked afterwards.
"""
import numpy as np

from .bucketing import plan_buckets
from .ops import array_module, is_device_array
from .pack import pack_device, pack_reference, unpack_device, unpack_reference


def _host_owner(a):
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a if a.base is None else a.base


def _address(a):
    return a.data.ptr if is_device_array(a) else a.__array_interface__["data"][0]


def flat_view(arrays):
    """A 1-D view spanning ``arrays`` if they are contiguous and adjacent in one allocation, else None.

    Empty arrays take no memory (NumPy may give them any address), so they never break adjacency.
    """
    first = arrays[0]
    if any(a.dtype != first.dtype for a in arrays):
        return None
    filled = [a for a in arrays if a.size]
    if not filled:
        return array_module(first).empty(0, first.dtype)
    start = filled[0]
    device = is_device_array(start)
    owner = (lambda a: a.data.mem) if device else _host_owner
    expected = _address(start)
    for a in filled:
        if not a.flags.c_contiguous or _address(a) != expected or owner(a) is not owner(start):
            return None
        expected += a.nbytes
    total = sum(a.size for a in filled)
    if device:
        import cupy
        return cupy.ndarray((total,), start.dtype, memptr=start.data)
    return np.lib.stride_tricks.as_strided(start.reshape(-1), shape=(total,),
                                           strides=(start.itemsize,))


class Bucket:
    """One bucket's arrays and the flat buffer the collective works on."""

    def __init__(self, arrays):
        self.arrays = arrays
        self.flat = flat_view(arrays)
        self.packed = self.flat is None

    def _kernel_path(self):
        return is_device_array(self.arrays[0]) and all(a.flags.c_contiguous for a in self.arrays)

    def load(self):
        """Fill the flat buffer from the arrays (nothing to do for a view)."""
        if not self.packed:
            return self.flat
        xp = array_module(self.arrays[0])
        self.flat = xp.empty(sum(a.size for a in self.arrays), self.arrays[0].dtype)
        if self._kernel_path():
            pack_device(self.arrays, self.flat)
        else:
            pack_reference(self.arrays, self.flat)
        return self.flat

    def store(self):
        """Write the flat buffer back into the arrays (nothing to do for a view)."""
        if not self.packed:
            return
        if self._kernel_path():
            unpack_device(self.flat, self.arrays)
        else:
            unpack_reference(self.flat, self.arrays)


def buckets_for(arrays, bucket_bytes):
    """The ``Bucket``s of ``arrays`` in buckets of at most ``bucket_bytes``."""
    return [Bucket([arrays[i] for i in idx]) for idx in plan_buckets(arrays, bucket_bytes)]

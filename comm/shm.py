"""Intra-node allreduce through an MPI-3 shared-memory window: one copy in, one reduction, one copy out.

Every rank of a node maps every other rank's slot of one ``MPI.Win.Allocate_shared`` window.
A rank copies its input into its own slot; after a barrier, rank ``j`` reduces segment ``j``
by reading that segment straight out of all slots and writes the result into its own slot;
after a second barrier every rank copies all finished segments out. No data passes through
MPI's message queues, and each byte is reduced exactly once, in a fixed rank order, so every
rank returns the same bits. The window grows on demand (a collective step: all ranks see the
same sizes, which the communicator has checked beforehand).
"""
import numpy as np
from mpi4py import MPI

from .ops import finish_mean, reduce_into
from .ring import split_offsets


class SharedMemoryAllreduce:
    """Allreduce of host arrays among the ranks of one shared-memory communicator."""

    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.win = None
        self.capacity = 0
        self.slots = []

    def _reserve(self, nbytes):
        if nbytes <= self.capacity:
            return
        self.free()
        capacity = max(nbytes, 1 << 20)
        self.win = MPI.Win.Allocate_shared(capacity, 1, comm=self.comm)
        self.slots = []
        for r in range(self.size):
            mem, _ = self.win.Shared_query(r)
            self.slots.append(np.frombuffer(mem, dtype=np.uint8, count=capacity))
        self.win.Lock_all()
        self.capacity = capacity

    def _fence(self):
        """Make every rank's slot writes visible to all ranks before anyone reads."""
        self.win.Sync()
        self.comm.Barrier()
        self.win.Sync()

    def allreduce(self, buf, op, mean_size=None):
        """Allreduce the flat contiguous host array ``buf`` in place."""
        mean_size = self.size if mean_size is None else mean_size
        if self.size == 1 or buf.size == 0:
            finish_mean(buf, op, mean_size)
            return
        self._reserve(buf.nbytes)
        views = [slot[:buf.nbytes].view(buf.dtype) for slot in self.slots]
        mine = views[self.rank]
        np.copyto(mine, buf)
        self._fence()
        offsets = split_offsets(buf.size, self.size)
        lo, hi = offsets[self.rank], offsets[self.rank + 1]
        if buf.dtype == np.float16:
            acc = views[0][lo:hi].astype(np.float32)
        else:
            acc = buf[lo:hi]
            np.copyto(acc, views[0][lo:hi])
        for r in range(1, self.size):
            reduce_into(acc, views[r][lo:hi], op)
        finish_mean(acc, op, mean_size)
        np.copyto(mine[lo:hi], acc, casting="unsafe")
        self._fence()
        for r in range(self.size):
            a, b = offsets[r], offsets[r + 1]
            np.copyto(buf[a:b], views[r][a:b])
        self.comm.Barrier()

    def free(self):
        if self.win is not None:
            self.slots = []
            self.win.Unlock_all()
            self.win.Free()
            self.win = None
            self.capacity = 0

"""Intra-node allreduce through an MPI-3 shared-memory window: one copy in, one reduction, one copy out.

Every rank of a node maps every other rank's slot of one ``MPI.Win.Allocate_shared`` window.
The buffer goes through in chunks: a rank copies a chunk of its input into its own slot; after
a barrier, rank ``j`` reduces part ``j`` of the chunk of every slot into part ``j`` of its own
slot, reading the others straight from their memory; after a second barrier every rank copies
the finished chunk out. No data passes through MPI's message queues, each element is reduced
exactly once by one rank (so every rank returns the same bits), and the slots are small enough
to stay in cache. Each slot holds two chunks used in turn, so a rank may copy in chunk ``k + 1``
while slower ranks still read chunk ``k``: the first barrier of chunk ``k + 1`` is only passed
once everyone has finished chunk ``k``, so two barriers per chunk suffice.

Registered as the allreduce ``"shm"`` (``SharedMemoryAllreduceAlgorithm``): host memory, one
node, the MPI transport.
"""
import numpy as np
from mpi4py import MPI

from .algorithm import AllreduceAlgorithm
from .ops import finish_mean, reduce_into
from .ring import split_offsets
from .topology import ONE_NODE, ONE_RANK

CHUNK_BYTES = 256 << 10


class SharedMemoryAllreduce:
    """Allreduce of host arrays among the ranks of one shared-memory communicator ``comm``,
    which becomes this object's: ``free`` releases it."""

    def __init__(self, comm, chunk_bytes=CHUNK_BYTES):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.chunk_bytes = chunk_bytes
        self.win = MPI.Win.Allocate_shared(2 * chunk_bytes, 1, comm=comm)
        self.slots = []
        for r in range(self.size):
            mem, _ = self.win.Shared_query(r)
            self.slots.append(np.frombuffer(mem, dtype=np.uint8, count=2 * chunk_bytes))
        self.win.Lock_all()

    def _fence(self):
        """Make every rank's slot writes visible to all ranks before anyone reads."""
        self.win.Sync()
        self.comm.Barrier()
        self.win.Sync()

    def allreduce(self, src, dst, op, mean_size=None):
        """Allreduce the flat contiguous host array ``src`` into ``dst`` (which may be ``src``)."""
        mean_size = self.size if mean_size is None else mean_size
        if self.size == 1 or src.size == 0:
            if dst is not src:
                np.copyto(dst, src)
            finish_mean(dst, op, mean_size)
            return
        chunk = self.chunk_bytes // src.itemsize
        for k, start in enumerate(range(0, src.size, chunk)):
            stop = min(start + chunk, src.size)
            half = (k % 2) * self.chunk_bytes
            views = [slot[half:half + (stop - start) * src.itemsize].view(src.dtype)
                     for slot in self.slots]
            self._reduce_chunk(src[start:stop], dst[start:stop], views, op, mean_size)
        self.comm.Barrier()

    def _reduce_chunk(self, src, dst, views, op, mean_size):
        mine = views[self.rank]
        np.copyto(mine, src)
        self._fence()
        offsets = split_offsets(src.size, self.size)
        lo, hi = offsets[self.rank], offsets[self.rank + 1]
        segment = mine[lo:hi]
        acc = segment.astype(np.float32) if src.dtype == np.float16 else segment
        for r in range(self.size):
            if r != self.rank:
                reduce_into(acc, views[r][lo:hi], op)
        finish_mean(acc, op, mean_size)
        if acc is not segment:
            np.copyto(segment, acc, casting="unsafe")
        self._fence()
        for r in range(self.size):
            a, b = offsets[r], offsets[r + 1]
            np.copyto(dst[a:b], views[r][a:b])

    def free(self):
        self.slots = []
        self.win.Unlock_all()
        self.win.Free()
        self.comm.Free()


class SharedMemoryAllreduceAlgorithm(AllreduceAlgorithm):
    """One copy in, one reduction, one copy out through a window every rank of the node maps
    (``SharedMemoryAllreduce``, made on the first call)."""

    name = "shm"
    transports = ("mpi",)
    topologies = (ONE_RANK, ONE_NODE)

    def run(self, ctx, buf, op, compression, index, sendbuf=None):
        shm = ctx.resource("shm", lambda: SharedMemoryAllreduce(ctx.topology.world.Dup()))

        def fn(b, s=None):
            shm.allreduce(b if s is None else s, b, op)
        if sendbuf is None:
            ctx.run_on(index, fn, buf)
        else:
            ctx.run_on(index, fn, buf, sendbuf)

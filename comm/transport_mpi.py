"""Point-to-point and native collectives over an MPI communicator, on host arrays.

Every transfer goes through mpi4py's buffer interface (the uppercase methods), so arrays move
as raw memory, never pickled. Buffers handed in must be C-contiguous NumPy arrays.
"""
import contextlib
import functools

import numpy as np
from mpi4py import MPI

_MPI_OPS = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


def mpi_op(op):
    return _MPI_OPS[op]


@functools.cache
def reduces_float16():
    """Whether this MPI reduces float16 arrays: MPICH does (``MPIX_C_FLOAT16``), Open MPI 4 has
    no such datatype and refuses the call. Asked once, of a reduction over ``COMM_SELF``."""
    try:
        MPI.COMM_SELF.Allreduce(MPI.IN_PLACE, np.ones(1, np.float16))
    except MPI.Exception:
        return False
    return True


def _float16_unreduced(*arrays):
    return (any(getattr(a, "dtype", None) == np.float16 for a in arrays)
            and not reduces_float16())


class MPITransport:
    """Moves host arrays between the ranks of one MPI communicator.

    ``comm`` is used as given (not duplicated); ``dup()`` gives a transport on a duplicate, whose
    messages can never match this one's.
    """

    name = "mpi"
    device = False

    def __init__(self, comm, stream=None):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()

    def activate(self):
        """Host transfers need no stream; kept so algorithms treat every transport alike."""
        return contextlib.nullcontext()

    def send(self, buf, dest, tag=0):
        self.comm.Send([buf, MPI.BYTE], dest=dest, tag=tag)

    def recv(self, buf, source, tag=0):
        self.comm.Recv([buf, MPI.BYTE], source=source, tag=tag)

    def sendrecv(self, sendbuf, dest, recvbuf, source, tag=0):
        """Send to ``dest`` and receive from ``source`` at once; ``None`` skips either side."""
        if sendbuf is None:
            sendbuf, dest = recvbuf[:0], MPI.PROC_NULL
        if recvbuf is None:
            recvbuf, source = sendbuf[:0], MPI.PROC_NULL
        self.comm.Sendrecv([sendbuf, MPI.BYTE], dest, tag, [recvbuf, MPI.BYTE], source, tag)

    def barrier(self):
        self.comm.Barrier()

    def synchronize(self):
        """Host transfers are complete when the call returns; nothing to wait for."""

    # Native collectives of the library underneath, kept as baselines.

    def native_allreduce(self, buf, op, sendbuf=None):
        """Reduce ``sendbuf`` (``buf`` itself when None) over the ranks into ``buf``. Where the
        MPI has no float16 datatype, float16 is reduced in float32 and rounded back once."""
        if _float16_unreduced(buf):
            wide = (buf if sendbuf is None else sendbuf).astype(np.float32)
            self.comm.Allreduce(MPI.IN_PLACE, wide, op=mpi_op(op))
            buf[...] = wide
            return
        self.comm.Allreduce(MPI.IN_PLACE if sendbuf is None else sendbuf, buf, op=mpi_op(op))

    def bound_allreduce(self, op):
        """``native_allreduce(buf, op, sendbuf)`` as ``f(sendbuf, buf)``, bound at the C level
        (MPI's own call with ``op`` filled in): what a repeated small reduction calls, so it
        pays for no Python frame of its own (nor, for a sum, MPI's default op, for a keyword
        argument). Where the MPI cannot reduce float16, a Python frame that widens it."""
        if not reduces_float16():
            return lambda sendbuf, buf: self.native_allreduce(buf, op, sendbuf)
        if mpi_op(op) is MPI.SUM:
            return self.comm.Allreduce
        return functools.partial(self.comm.Allreduce, op=mpi_op(op))

    def native_bcast(self, buf, root):
        self.comm.Bcast(buf, root=root)

    def native_allgather(self, recvbuf):
        """Allgather in place: this rank's block of ``recvbuf`` is already filled."""
        self.comm.Allgather(MPI.IN_PLACE, recvbuf)

    def native_reduce_scatter(self, sendbuf, recvbuf, counts, op):
        if _float16_unreduced(recvbuf):
            wide = np.empty(recvbuf.shape, np.float32)
            self.comm.Reduce_scatter(sendbuf.astype(np.float32), wide,
                                     recvcounts=list(counts), op=mpi_op(op))
            recvbuf[...] = wide
            return
        self.comm.Reduce_scatter(sendbuf, recvbuf, recvcounts=list(counts), op=mpi_op(op))

    def dup(self):
        return MPITransport(self.comm.Dup())

    def free(self):
        self.comm.Free()

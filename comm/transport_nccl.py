"""Point-to-point and native collectives between GPUs through NCCL (``cupy.cuda.nccl``).

The NCCL unique id is made on rank 0 and broadcast over MPI. Each transport owns one NCCL
communicator and one CUDA stream of the current device (the two levels of the hierarchical
algorithm share their parent's stream); ``activate()`` makes that stream current and orders it
after the caller's stream (and the caller's after it on exit), so the algorithms' local
arithmetic and NCCL's transfers stay in stream order while several transports
(``nccl_comm_num``) run buckets concurrently. Send and receive of one exchange are issued
inside one NCCL group so neither side waits for the other.

Starting is a collective decision. After each local step (the probe; the stream and rank 0's
unique id; NCCL's own ``ncclCommInitRank``) every rank's outcome is shared over MPI, and where
any rank failed, every rank raises ``NCCLUnavailableError`` naming each failed rank and why: so
a communicator whose ``transport="auto"`` chose NCCL falls back to MPI on every rank alike. A
rank that fails inside ``ncclCommInitRank`` while another rank's call waits for it cannot be
helped here, since that call is NCCL's own collective.
"""
import contextlib

import numpy as np

from .ops import check_dtype

UNIQUE_ID_BYTES = 128
# The last byte of the broadcast unique id: how this CuPy spells it (CuPy 14: bytes; CuPy 13:
# a tuple of 128 C chars as signed ints).
AS_BYTES, AS_CHARS = 1, 0


def unique_id_bytes(made):
    """``nccl.get_unique_id()``'s result as ``UNIQUE_ID_BYTES + 1`` bytes to broadcast: the id,
    then its spelling, so every rank hands ``NcclCommunicator`` the form its CuPy made."""
    if isinstance(made, (bytes, bytearray)):
        raw, spelling = np.frombuffer(bytes(made), dtype=np.uint8), AS_BYTES
    else:
        raw, spelling = np.array(made, dtype=np.int64).astype(np.int8).view(np.uint8), AS_CHARS
    if raw.size != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {raw.size}")
    return np.append(raw, np.uint8(spelling))


def unique_id_from_bytes(buffer):
    """The unique id ``unique_id_bytes`` packed, in the spelling it records."""
    raw = np.asarray(buffer[:UNIQUE_ID_BYTES], dtype=np.uint8)
    if buffer[UNIQUE_ID_BYTES] == AS_BYTES:
        return raw.tobytes()
    return tuple(int(v) for v in raw.view(np.int8))


class NCCLUnavailableError(RuntimeError):
    """The NCCL transport was selected where CuPy, NCCL or a CUDA device is missing, or where
    CUDA or NCCL failed while it started (on any rank)."""


def _probe():
    """None if NCCL can run here, else the reason it cannot."""
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as exc:
        return (f"CuPy with NCCL is not importable ({exc}); install cupy-cuda12x "
                f"(pip install 'fleetmpi[gpu]') or use transport='mpi'")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        return f"no usable CUDA device ({exc}); use transport='mpi'"
    if count == 0:
        return "no CUDA device is visible; use transport='mpi'"
    if not nccl.available:
        return "this CuPy build has no NCCL support; use transport='mpi'"
    return None


def _attempt(step, what):
    """``(step(), None)``, or ``(None, why)`` where ``step`` raised: a CUDA or NCCL error while
    starting, after which the job may still run over MPI."""
    try:
        return step(), None
    except Exception as exc:  # whichever error CuPy or NCCL raise, it is reported by rank
        return None, f"{what} failed ({type(exc).__name__}: {exc}); use transport='mpi'"


def _agree(comm, reason, undo=None):
    """Share this rank's outcome of a step of starting NCCL (``reason``: None where it worked)
    over the MPI communicator ``comm``. Where any rank failed, every rank raises
    ``NCCLUnavailableError`` naming each failed rank and its reason, after ``undo()`` on the
    ranks where the step worked."""
    reasons = comm.allgather(reason)
    failed = [f"rank {r}: {why}" for r, why in enumerate(reasons) if why is not None]
    if failed:
        if reason is None and undo is not None:
            undo()
        raise NCCLUnavailableError("the NCCL transport cannot start: " + "; ".join(failed))


def _nccl_dtypes(nccl):
    return {np.dtype(np.float16): nccl.NCCL_FLOAT16, np.dtype(np.float32): nccl.NCCL_FLOAT32,
            np.dtype(np.float64): nccl.NCCL_FLOAT64, np.dtype(np.int32): nccl.NCCL_INT32,
            np.dtype(np.int64): nccl.NCCL_INT64}


class NCCLTransport:
    """Moves CuPy arrays between the ranks of ``comm`` (an MPI communicator) through NCCL."""

    name = "nccl"
    device = True

    def __init__(self, comm, stream=None):
        from mpi4py import MPI

        _agree(comm, _probe())
        import cupy
        from cupy.cuda import nccl

        self._cupy = cupy
        self._nccl = nccl
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        reason = None
        if stream is None:
            stream, reason = _attempt(lambda: cupy.cuda.Stream(non_blocking=True),
                                      "creating a CUDA stream")
        uid = np.zeros(UNIQUE_ID_BYTES + 1, dtype=np.uint8)
        if self.rank == 0 and reason is None:
            made, reason = _attempt(nccl.get_unique_id, "ncclGetUniqueId")
            if reason is None:
                uid[:] = unique_id_bytes(made)
        _agree(comm, reason)
        comm.Bcast([uid, MPI.BYTE], root=0)
        self.nccl, reason = _attempt(
            lambda: nccl.NcclCommunicator(self.size, unique_id_from_bytes(uid), self.rank),
            "ncclCommInitRank")
        _agree(comm, reason, undo=lambda: self.nccl.destroy())
        self.stream = stream
        self._dtypes = _nccl_dtypes(nccl)
        self._ops = {"sum": nccl.NCCL_SUM, "mean": nccl.NCCL_SUM, "max": nccl.NCCL_MAX,
                     "min": nccl.NCCL_MIN}

    @contextlib.contextmanager
    def activate(self):
        """Run the enclosed device work on this transport's stream, in order with the caller's."""
        cupy = self._cupy
        outer = cupy.cuda.get_current_stream()
        self.stream.wait_event(outer.record())
        with self.stream:
            yield
        outer.wait_event(self.stream.record())

    def _bytes(self, buf):
        return buf.data.ptr, buf.nbytes, self._nccl.NCCL_UINT8

    def send(self, buf, dest, tag=0):
        ptr, count, dtype = self._bytes(buf)
        self.nccl.send(ptr, count, dtype, dest, self.stream.ptr)

    def recv(self, buf, source, tag=0):
        ptr, count, dtype = self._bytes(buf)
        self.nccl.recv(ptr, count, dtype, source, self.stream.ptr)

    def sendrecv(self, sendbuf, dest, recvbuf, source, tag=0):
        self._nccl.groupStart()
        if sendbuf is not None and dest is not None:
            self.send(sendbuf, dest)
        if recvbuf is not None and source is not None:
            self.recv(recvbuf, source)
        self._nccl.groupEnd()

    def barrier(self):
        token = self._cupy.zeros(1, np.float32)
        self.native_allreduce(token, "sum")
        self.synchronize()

    def synchronize(self):
        self.stream.synchronize()

    def native_allreduce(self, buf, op, sendbuf=None):
        """Reduce ``sendbuf`` (``buf`` itself when None) over the ranks into ``buf``."""
        dtype = self._dtypes[check_dtype(buf.dtype)]
        send = buf if sendbuf is None else sendbuf
        self.nccl.allReduce(send.data.ptr, buf.data.ptr, buf.size, dtype, self._ops[op],
                            self.stream.ptr)

    def native_bcast(self, buf, root):
        ptr, count, dtype = self._bytes(buf)
        self.nccl.broadcast(ptr, ptr, count, dtype, root, self.stream.ptr)

    def native_allgather(self, recvbuf):
        """Allgather in place: this rank's block of ``recvbuf`` is already filled."""
        count = recvbuf.nbytes // self.size
        self.nccl.allGather(recvbuf.data.ptr + self.rank * count, recvbuf.data.ptr, count,
                            self._nccl.NCCL_UINT8, self.stream.ptr)

    def native_reduce_scatter(self, sendbuf, recvbuf, counts, op):
        """NCCL's reduce-scatter needs equal counts; unequal ones reduce everything and slice."""
        dtype = self._dtypes[check_dtype(sendbuf.dtype)]
        if len(set(counts)) == 1:
            self.nccl.reduceScatter(sendbuf.data.ptr, recvbuf.data.ptr, counts[0], dtype,
                                    self._ops[op], self.stream.ptr)
            return
        whole = sendbuf.copy()
        self.nccl.allReduce(whole.data.ptr, whole.data.ptr, whole.size, dtype, self._ops[op],
                            self.stream.ptr)
        start = sum(counts[:self.rank])
        recvbuf[...] = whole[start:start + counts[self.rank]]

    def dup(self):
        return NCCLTransport(self.comm.Dup())

    def free(self):
        self.nccl.destroy()
        self.comm.Free()

"""``cupy.cuda.nccl`` for a world of one rank: every collective copies the send buffer into
the receive buffer (a lone rank's contribution is the result), queued on the stream it is
given as one NCCL call (``library_calls["nccl"]``), so a capture records it as CUDA records
NCCL's kernels. Ranks in other processes are not modelled: a communicator of more than one
rank, and a send or receive (to another rank), raise ``NcclError``.
"""
import ctypes

from . import arrays

available = True
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = range(5)
(NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64, NCCL_FLOAT16,
 NCCL_FLOAT32, NCCL_FLOAT64) = range(9)
_SIZES = {NCCL_INT8: 1, NCCL_UINT8: 1, NCCL_INT32: 4, NCCL_UINT32: 4, NCCL_INT64: 8,
          NCCL_UINT64: 8, NCCL_FLOAT16: 2, NCCL_FLOAT32: 4, NCCL_FLOAT64: 8}


class NcclError(RuntimeError):
    pass


def get_unique_id():
    return bytes(128)


def groupStart():
    pass


def groupEnd():
    pass


class NcclCommunicator:
    """``NcclCommunicator(ndev, commId, rank)`` of one rank."""

    def __init__(self, ndev, commId, rank):
        if ndev != 1 or rank != 0:
            raise NcclError(f"the CuPy stand-in's NCCL runs one rank, not rank {rank} of {ndev}")

    def _copy(self, name, source, target, count, datatype, stream):
        nbytes = count * _SIZES[datatype]

        def run():
            if source != target:
                ctypes.memmove(target, source, nbytes)
        runtime = arrays.current_runtime()
        runtime.enqueue(name, run, library="nccl", stream=runtime.stream_of(stream))

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        self._copy("allReduce", sendbuf, recvbuf, count, datatype, stream)

    def broadcast(self, sendbuf, recvbuf, count, datatype, root, stream):
        self._copy("broadcast", sendbuf, recvbuf, count, datatype, stream)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        self._copy("allGather", sendbuf, recvbuf, count, datatype, stream)

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        self._copy("reduceScatter", sendbuf, recvbuf, recvcount, datatype, stream)

    def send(self, sendbuf, count, datatype, peer, stream):
        raise NcclError("the CuPy stand-in's NCCL has no other rank to send to")

    recv = send

    def destroy(self):
        pass

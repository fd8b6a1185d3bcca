"""The collectives of the library under the transport (MPI's, or NCCL's over the NCCL
transport), registered as the algorithm ``"native"`` of allreduce, broadcast, allgather and
reduce_scatter: the baselines ours are measured against, and the cheapest for small messages,
where a call's fixed cost outweighs the transfer (``algorithm_choice``)."""
import numpy as np

from .algorithm import (AllgatherAlgorithm, AllreduceAlgorithm, BroadcastAlgorithm,
                        ReduceScatterAlgorithm)
from .ops import array_module, finish_mean


class NativeAllreduceAlgorithm(AllreduceAlgorithm):
    """The library's allreduce (``MPI_Allreduce``, ``ncclAllReduce``); a mean is its sum
    divided here."""

    name = "native"

    def run(self, ctx, buf, op, compression, index, sendbuf=None):
        transport = ctx.transports[index]

        def fn(b, s=None):
            transport.native_allreduce(b, op, s)
            finish_mean(b, op, ctx.size)
        if sendbuf is None:
            ctx.run_on(index, fn, buf)
        else:
            ctx.run_on(index, fn, buf, sendbuf)

    def runner(self, ctx, x, op, compression, out):
        """One form per kind of ``out``: a small call's cost is mostly Python, so each form
        does only what it needs, and a sum or extremum into a separate ``out`` is the MPI call
        itself."""
        transport, shape, dtype, size = ctx.transports[0], x.shape, x.dtype, ctx.size
        if transport.device or not x.flags.c_contiguous:
            return None
        if op != "mean" and out is not None and out is not x:
            return transport.bound_allreduce(op)
        reduce = transport.native_allreduce
        if op == "mean":
            def run(x, out):
                result = np.empty(shape, dtype) if out is None else out
                reduce(result, op, None if result is x else x)
                finish_mean(result, op, size)
                return result
        elif out is None:
            def run(x, out):
                result = np.empty(shape, dtype)
                reduce(result, op, x)
                return result
        else:
            def run(x, out):
                reduce(x, op)
        return run


class NativeBroadcastAlgorithm(BroadcastAlgorithm):
    """The library's broadcast (``MPI_Bcast``, ``ncclBroadcast``)."""

    name = "native"

    def run(self, ctx, buf, root, index):
        transport = ctx.transports[index]
        ctx.run_on(index, lambda b: transport.native_bcast(b, root), buf)


class NativeAllgatherAlgorithm(AllgatherAlgorithm):
    """The library's allgather (``MPI_Allgather``, ``ncclAllGather``): equal parts only."""

    name = "native"
    equal_parts = True

    def run(self, ctx, buf, offsets):
        ctx.run_on(0, ctx.transports[0].native_allgather, buf)


class NativeReduceScatterAlgorithm(ReduceScatterAlgorithm):
    """The library's reduce-scatter (``MPI_Reduce_scatter``, ``ncclReduceScatter``)."""

    name = "native"

    def run(self, ctx, x, op, compression, offsets, overwrite_input):
        xp = array_module(x)
        send = xp.ascontiguousarray(x).reshape(-1)
        out = xp.empty(offsets[ctx.rank + 1] - offsets[ctx.rank], x.dtype)
        counts = [offsets[r + 1] - offsets[r] for r in range(ctx.size)]
        transport = ctx.transports[0]

        def native(s, o):
            transport.native_reduce_scatter(s, o, counts, op)
            finish_mean(o, op, ctx.size)
        ctx.run_on(0, native, send, out)
        return out

"""Two-level allreduce: reduce-scatter inside each group, allreduce across groups, allgather inside.

Groups are the nodes (or runs of ``hierarchical_allreduce_inter_nranks`` consecutive ranks).
After the intra-group reduce-scatter, local rank ``j`` owns the group's sum of segment ``j``;
it allreduces that segment with the ranks of local index ``j`` in the other groups (the slow
inter-node links carry ``1 / group_size`` of the data, from every rank at once), and the
intra-group allgather spreads the result. Registered as the allreduce ``"hierarchical"``
(``HierarchicalAllreduceAlgorithm``).
"""
from .algorithm import AllreduceAlgorithm
from .compression import COMPRESSIONS, accumulate_dtypes
from .ops import array_module, finish_mean
from .ring import (DEFAULT_CHUNK_BYTES, allreduce_ring, finish_through_wire,
                   reduce_scatter_ring, split_offsets)


def allreduce_hierarchical(local, cross, buf, op, compression=None,
                           chunk_bytes=DEFAULT_CHUNK_BYTES):
    """Allreduce ``buf`` in place; ``local`` and ``cross`` are the two levels' transports."""
    world_size = local.size * cross.size
    if world_size == 1 or buf.size == 0:
        finish_mean(buf, op, world_size)
        return
    acc_dtype, wire_dtype = accumulate_dtypes(buf.dtype, compression)
    acc = buf if acc_dtype == buf.dtype else buf.astype(acc_dtype)
    offsets = split_offsets(buf.size, local.size)
    reduce_scatter_ring(local, acc, op, offsets, wire_dtype, chunk_bytes)
    segment = acc[offsets[local.rank]:offsets[local.rank + 1]]
    inner_op = "sum" if op == "mean" else op
    inner_compression = "fp16" if wire_dtype != acc_dtype else None
    allreduce_ring(cross, segment, inner_op, inner_compression, chunk_bytes)
    finish_mean(segment, op, world_size)
    finish_through_wire(local, buf, acc, offsets, wire_dtype)


class LevelTransports:
    """The two levels' transports of one transport of a communicator (``ctx``): ``local``
    over the ranks of this rank's group, ``cross`` over the ranks of its local index in every
    group, on the same stream."""

    def __init__(self, ctx, index):
        k = ctx.hierarchical_allreduce_inter_nranks
        if k is None:
            local, cross = ctx.topology.local.Dup(), ctx.topology.cross.Dup()
        else:
            world = ctx.topology.world
            local = world.Split(ctx.rank // k, ctx.rank)
            cross = world.Split(ctx.rank % k, ctx.rank)
        stream = getattr(ctx.transports[index], "stream", None)
        self.local = ctx.make_transport(local, stream)
        self.cross = ctx.make_transport(cross, stream)

    def free(self):
        self.local.free()
        self.cross.free()


class HierarchicalAllreduceAlgorithm(AllreduceAlgorithm):
    """Within each node (or group of ``hierarchical_allreduce_inter_nranks`` ranks), then
    across them; float16 on the wire with compression."""

    name = "hierarchical"
    compressions = COMPRESSIONS

    def run(self, ctx, buf, op, compression, index, sendbuf=None):
        levels = ctx.resource(("levels", index), lambda: LevelTransports(ctx, index))
        if sendbuf is not None:
            array_module(buf).copyto(buf, sendbuf)

        def fn(b):
            allreduce_hierarchical(levels.local, levels.cross, b, op, compression,
                                   ctx.chunk_bytes)
        ctx.run_on(index, fn, buf)

"""``sharding``: ZeRO-DP stage 1, the optimizer state partitioned over the ranks of a group.

The optimizer's parameter space (its flat buffers' runs back to back) is cut into as many
contiguous shards as the sharding group has ranks, the lengths differing by at most one element
(the comm layer's ``reduce_scatter`` blocks, so no padding is needed and any group size works).
Each rank's optimizer holds state (velocity, moments) for its own shard alone and updates only
that shard (``Optimizer.shard``). A step then:

1. reduce-scatters the gradients over the group (``op="mean"``, float16 on the wire with
   ``fp16_allreduce``), so each rank receives the averaged gradient of its own shard instead of
   all of it; the rest of its gradient buffer is set to zero;
2. with ``hybrid_dp``, averages that shard over the replicas: the ranks holding the same shard
   in the other groups;
3. runs the optimizer on its shard (``grad_clip`` norms are of whole tensors: partial sums of
   squares over the shards, one small allreduce over the group);
4. broadcasts each shard from its owner to the group, in messages of at most
   ``fuse_broadcast_MB``.

Group: the whole world, or with ``hybrid_dp`` runs of ``sharding_group_size`` consecutive ranks,
``world size / sharding_group_size`` of them training as data-parallel replicas. Steps that do
not update (gradient_merge between its updates, amp's overflow) communicate nothing here.

Under amp the parameters are the float32 master weights and every rank needs all of them for
its forward pass (the float16 copies are made per layer and step), so what is partitioned is the
optimizer state; the gradients of the other shards are not kept after the reduce-scatter.
Everything happens after backward: the reduce-scatter does not overlap it, unlike the bucketed
allreduce of plain data parallelism.
"""
from .. import backend, world
from ..comm.communicator import NATIVE_BELOW_BYTES
from ..comm.ring import split_offsets
from ..log import logger
from .base import Strategy

DEFAULT_GROUP_SIZE = 8


def group_size(configs, world_size):
    """The ranks per sharding group: the world, or with ``hybrid_dp`` the
    ``sharding_group_size``, which must divide the world size."""
    size = int(configs["sharding_group_size"])
    if not configs["hybrid_dp"]:
        if size not in (DEFAULT_GROUP_SIZE, world_size) and world.worker_index() == 0:
            logger.warning("sharding_configs['sharding_group_size']=%d has no effect without "
                           "hybrid_dp: the sharding group is the whole world of %d rank(s)",
                           size, world_size)
        return world_size
    if world_size % size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"sharding_configs['sharding_group_size']={size} must divide the "
                         f"world size {world_size} (hybrid_dp trains world size / "
                         f"sharding_group_size data-parallel replicas of a sharding group); "
                         f"allowed here: {', '.join(str(d) for d in divisors)}")
    return size


def _sub_communicator(communicator, color, fuse_broadcast_MB):
    """A ``Communicator`` over the ranks of ``communicator`` with the same ``color``, ordered
    by rank, with the same transport and settings."""
    from ..comm import Communicator, Topology

    sub = communicator.topology.world.Split(color, communicator.rank)
    return Communicator(Topology(sub), transport=communicator.transport_name,
                        nccl_comm_num=communicator.nccl_comm_num,
                        fuse_grad_size_in_MB=communicator.fuse_grad_size_in_MB,
                        fuse_broadcast_MB=fuse_broadcast_MB, check=communicator.check)


def sharding_communicators(communicator, size, fuse_broadcast_MB):
    """``(group, replicas)``: the communicator of this rank's sharding group (ranks
    ``[k * size, (k + 1) * size)``) and that of the ranks holding the same shard in every group;
    None where it would hold this rank alone."""
    world_size = 1 if communicator is None else communicator.size
    if world_size == 1:
        return None, None
    if size == world_size:
        return communicator, None
    if size == 1:
        return None, communicator
    rank = communicator.rank
    return (_sub_communicator(communicator, rank // size, fuse_broadcast_MB),
            _sub_communicator(communicator, rank % size, fuse_broadcast_MB))


class Sharding(Strategy):
    """``sharding``. Observable: ``group_size``, ``replicas_num`` (the data-parallel ways),
    ``offsets`` (the shard boundaries in the parameter space), ``shard`` (this rank's range),
    ``group`` and ``replicas`` (the communicators, None where alone)."""

    name = "sharding"

    def __init__(self, strategy, optimizer, communicator):
        super().__init__(strategy, optimizer, communicator)
        self.fuse_broadcast_MB = float(self.configs["fuse_broadcast_MB"])
        self.group_size = group_size(self.configs, self.world_size)
        self.replicas_num = self.world_size // self.group_size
        self.group, self.replicas = sharding_communicators(communicator, self.group_size,
                                                           self.fuse_broadcast_MB)
        self.compression = "fp16" if strategy.fp16_allreduce else None
        self.offsets = split_offsets(optimizer.space_size, self.group_size)
        group_rank = 0 if self.group is None else self.group.rank
        self.shard = (self.offsets[group_rank], self.offsets[group_rank + 1])
        optimizer.shard(*self.shard, None if self.group is None else self._sum_over_group)

    @classmethod
    def check(cls, strategy, optimizer):
        super().check(strategy, optimizer)
        dtypes = sorted({p.dtype.name for p in optimizer.parameters()})
        if len(dtypes) > 1:
            raise ValueError(f"strategy sharding cuts one parameter space of one dtype into "
                             f"shards, but the optimizer has parameters of "
                             f"{', '.join(dtypes)}; build the model in one dtype")

    def _sum_over_group(self, array):
        return self.group.allreduce(array, op="sum")

    # -- gradients --------------------------------------------------------------------------
    def reduce(self, ctx, proceed):
        if ctx.sync_gradients:
            self._reduce_scatter_gradients()
        return proceed(ctx)

    def _reduce_scatter_gradients(self):
        if self.group is None:
            # A group of one rank: its shard is the whole space, the gradients stay in place.
            if self.replicas is not None:
                for run in self.optimizer._runs:
                    self.replicas.allreduce(run.grad, op="mean", compression=self.compression,
                                            out=run.grad)
            return
        xp = backend.array_module()
        grads = [run.grad for run in self.optimizer._runs]
        flat = grads[0] if len(grads) == 1 else xp.concatenate(grads)
        start, stop = self.shard
        # As the communicator's allreduce does: the library's own below NATIVE_BELOW_BYTES.
        native = self.compression is None and flat.nbytes < NATIVE_BELOW_BYTES
        block = self.group.reduce_scatter(flat, op="mean", compression=self.compression,
                                          algorithm="native" if native else None)
        if self.replicas is not None and block.size:
            self.replicas.allreduce(block, op="mean", compression=self.compression, out=block)
        for run, (low, high) in zip(self.optimizer._runs, self.optimizer._run_spans):
            run.grad[...] = 0
            lo, hi = max(start, low), min(stop, high)
            if lo < hi:
                run.grad[lo - low:hi - low] = block[lo - start:hi - start]

    # -- parameters -------------------------------------------------------------------------
    def update(self, ctx, proceed):
        result = proceed(ctx)
        if ctx.apply_update and self.group is not None:
            self._broadcast_parameters()
        return result

    def _messages(self, start, stop):
        """Views of the parameters in ``[start, stop)`` of the space, each at most
        ``fuse_broadcast_MB``; ``broadcast_many`` joins adjacent ones up to that size."""
        limit = int(self.fuse_broadcast_MB * 2 ** 20)
        views = []
        for run, (low, high) in zip(self.optimizer._runs, self.optimizer._run_spans):
            lo, hi = max(start, low), min(stop, high)
            step = max(1, limit // run.buffer.dtype.itemsize)
            views += [run.data[i - low:min(i + step, hi) - low] for i in range(lo, hi, step)]
        return views

    def _broadcast_parameters(self):
        for owner in range(self.group_size):
            views = self._messages(self.offsets[owner], self.offsets[owner + 1])
            if views:
                self.group.broadcast_many(views, root=owner,
                                          fuse_broadcast_MB=self.fuse_broadcast_MB)

"""``sharding``: ZeRO-DP, the optimizer state (stage 1), the gradients too (stage 2) and the
parameters too (stage 3) partitioned over the ranks of a group (``sharding_configs["stage"]``).

The optimizer's parameter space (its flat buffers' runs back to back) is cut into as many
contiguous shards as the sharding group has ranks, the lengths differing by at most one element
(the comm layer's collectives take per-rank counts, so no padding is needed and any group size
works). Each rank's optimizer holds state (velocity, moments) for its own shard alone and
updates only that shard (``Optimizer.shard``).

Stage 1, a step:

1. reduce-scatters the gradients over the group (``op="mean"``, float16 on the wire with
   ``fp16_allreduce``), so each rank receives the averaged gradient of its own shard instead of
   all of it; the rest of its gradient buffer is set to zero;
2. with ``hybrid_dp``, averages that shard over the replicas: the ranks holding the same shard
   in the other groups;
3. runs the optimizer on its shard (``grad_clip`` norms are of whole tensors: partial sums of
   squares over the shards, one small allreduce over the group);
4. broadcasts each shard from its owner to the group, in messages of at most
   ``fuse_broadcast_MB``.

Stage 2 keeps no full-size gradient: the flat gradient buffer is freed, a gradient bucket
(``fuse_grad_size_in_MB``, as data parallelism's) gets storage when backward first writes into
it, and as soon as backward has finished the bucket it is reduce-scattered to the owners of the
shards it overlaps (``BucketSchedule``'s order, as the data-parallel allreduce) and freed. The
owner adds its part into the optimizer's ``shard_gradient``, where gradient_merge accumulates
its window too. Steps 2-4 follow as in stage 1.

Stage 3 keeps no full-size parameters either: the optimizer updates ``shard_parameters`` and
the flat values are freed; ``sharding_parameters.ParameterGatherer`` all-gathers a layer's
parameters when an operation uses them and frees them when another layer's are needed, and
again in backward for the operations that saved them, gathering up to
``sharding_configs["prefetch_depth"]`` units ahead of use. Nothing is broadcast after the
update.

Group: the whole world, or with ``hybrid_dp`` runs of ``sharding_group_size`` (Paddle's later
name: ``sharding_degree``) consecutive ranks, ``world size / group size`` of them training as
data-parallel replicas. Steps that do not update (gradient_merge between its updates, amp's
overflow) broadcast nothing.
"""
from fleetmpi.core import backend, timeline
from fleetmpi.comm import overlap_counts
from .base import Strategy
from .configs import ShardingConfig
from .gradient_allreduce import BucketSchedule, fusion_limits, plan_gradient_buckets

WITH_PIPELINE = ("stages 1 and 2 only, which partition each pipeline stage's optimizer state "
                 "(and gradients) over that stage's replicas; stage 3 frees the model's flat "
                 "values whole, while a pipeline stage's optimizer holds only its own part")


def group_size(config, world_size):
    """The ranks per sharding group: the world, or with ``hybrid_dp`` the
    ``sharding_group_size`` (or ``sharding_degree``), which must divide the world size."""
    size = config.group_size
    if not config.hybrid_dp:
        return world_size
    if world_size % size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"sharding_configs['sharding_group_size']={size} must divide the "
                         f"world size {world_size} (hybrid_dp trains world size / "
                         f"sharding_group_size data-parallel replicas of a sharding group); "
                         f"allowed here: {', '.join(str(d) for d in divisors)}")
    return size


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
    return (communicator.split(rank // size, fuse_broadcast_MB=fuse_broadcast_MB),
            communicator.split(rank % size, fuse_broadcast_MB=fuse_broadcast_MB))


class Sharding(Strategy):
    """``sharding``. Observable: ``stage``, ``group_size``, ``replicas_num`` (the
    data-parallel ways), ``offsets`` (the shard boundaries in the parameter space), ``shard``
    (this rank's range), ``group`` and ``replicas`` (the communicators, None where alone),
    from stage 2 ``buckets`` and from stage 3 ``gatherer``."""

    name = "sharding"
    config_class = ShardingConfig
    communicator_scope = "replicas"
    reduces_gradients = True

    def __init__(self, strategy, optimizer, communicator):
        super().__init__(strategy, optimizer, communicator)
        self.stage = self.config.stage
        self.fuse_broadcast_MB = self.config.fuse_broadcast_MB
        self.group_size = group_size(self.config, self.world_size)
        self.replicas_num = self.world_size // self.group_size
        self.group, self.replicas = sharding_communicators(communicator, self.group_size,
                                                           self.fuse_broadcast_MB)
        self.compression = "fp16" if strategy.fp16_allreduce else None
        self.offsets = ((0, optimizer.space_size) if self.group is None
                        else self.group.reduce_scatter_offsets(optimizer.space_size))
        group_rank = 0 if self.group is None else self.group.rank
        self.shard = (self.offsets[group_rank], self.offsets[group_rank + 1])
        self.buckets = self.schedule = self.gatherer = None
        if self.stage >= 2:
            # The flat gradient goes before the shard's gradient and state come.
            self._partition_gradients(strategy)
        optimizer.shard(*self.shard, None if self.group is None else self._sum_over_group,
                        own_gradient=self.stage >= 2, own_parameters=self.stage == 3)
        if self.stage == 3:
            from .sharding_parameters import ParameterGatherer

            self.gatherer = ParameterGatherer(
                optimizer, self.group, self.offsets, self.config.prefetch_depth,
                int(self.config.unit_size_MB * 2 ** 20))

    @classmethod
    def check(cls, strategy, optimizer):
        super().check(strategy, optimizer)
        dtypes = sorted({p.dtype.name for p in optimizer.parameters()})
        if len(dtypes) > 1:
            raise ValueError(f"strategy sharding cuts one parameter space of one dtype into "
                             f"shards, but the optimizer has parameters of "
                             f"{', '.join(dtypes)}; build the model in one dtype")
        stage = ShardingConfig.of(strategy).stage
        if strategy.pipeline and stage == 3:
            raise ValueError(f"sharding stage {stage} cannot be combined with pipeline: "
                             f"{WITH_PIPELINE}")
        if stage == 3:
            for run in optimizer.runs:
                if run.stop - run.start != run.buffer.size:
                    raise ValueError("sharding stage 3 frees the model's flat values, but the "
                                     "optimizer updates only part of them; give the optimizer "
                                     "all of model.parameters() (freeze a parameter with "
                                     "trainable=False instead), or use stage 1 or 2")

    def _sum_over_group(self, array):
        return self.group.allreduce(array, op="sum")

    # -- gradients --------------------------------------------------------------------------
    def _partition_gradients(self, strategy):
        """Stage 2 and 3: free the flat gradient buffers; gradients live in buckets from the
        first write of backward until the bucket is reduce-scattered. A parameter of the
        buffers that the optimizer does not update (another pipeline stage's, or one left
        out of the optimizer) gets gradient storage of its own if backward reaches it."""
        runs = self.optimizer.runs
        bucket_bytes, max_layers, _ = fusion_limits(strategy)
        self.buckets = plan_gradient_buckets(runs, bucket_bytes, max_layers,
                                             shard_bytes=self._shard_bytes())
        self.schedule = BucketSchedule(self.buckets, self._reduce_scatter_bucket)
        # Each bucket's place in the parameter space, and its elements in each rank's shard.
        self._placement = {}
        for run, (low, _) in zip(runs, self.optimizer.run_spans):
            for bucket in self.buckets:
                if bucket.buffer is run.buffer and run.start <= bucket.start < run.stop:
                    first = low + bucket.start - run.start
                    last = first + bucket.stop - bucket.start
                    self._placement[bucket.index] = (first, last, overlap_counts(
                        first, last, self.offsets))
        self._storage = {}
        for buffer in {id(run.buffer): run.buffer for run in runs}.values():
            buffer.release_gradient(self._bind_bucket)

    def _shard_bytes(self):
        """The bytes of the largest shard: from stage 2 on a gradient bucket holds at most a
        fraction of it (the comm layer's ``plan_buckets``, ``shard_bytes``), so that the
        buckets holding storage at once (the one backward fills, and one per weight used
        early and late in the step, such as a tied embedding) stay small beside the shard
        (docs/sharding.md, "Gradient buckets"). ``last_comm_group_size_MB`` does not apply:
        each bucket is reduce-scattered before backward goes on, so no bucket's reduction
        overlaps backward and the last one's size shortens nothing."""
        return -(-self.optimizer.space_size // self.group_size) * \
            self.optimizer.runs[0].buffer.dtype.itemsize

    def _bind_bucket(self, parameter):
        """Gradient storage for ``parameter``'s bucket, every parameter of it bound to its
        part, holding zero."""
        xp = backend.array_module()
        bucket = self.schedule.bucket_of(parameter)
        if bucket is None:
            parameter.bind_gradient(xp.zeros(parameter.shape, parameter.dtype))
            return
        storage = xp.empty(bucket.stop - bucket.start, dtype=bucket.buffer.dtype)
        self._storage[bucket.index] = storage
        for p in bucket.parameters:
            begin = p.offset - bucket.start
            p.bind_gradient(storage[begin:begin + p.size].reshape(p.shape))

    def _reduce_scatter_bucket(self, bucket):
        """Reduce ``bucket``'s gradients to the owners of the shards it overlaps, add this
        rank's part to the shard's gradient and free the bucket."""
        storage = self._storage.pop(bucket.index, None)
        if storage is None:
            self._bind_bucket(bucket.parameters[0])
            storage = self._storage.pop(bucket.index)
        for p in bucket.parameters:
            p.settle_gradient()
        first, last, counts = self._placement[bucket.index]
        with timeline.span(f"bucket {bucket.index}", "comm") as event:
            if event:
                event.args.update(bucket=bucket.index, bytes=int(storage.nbytes),
                                  parameters=bucket.size)
            block = self._reduce_over_group(storage, counts)
            if self.replicas is not None and block.size:
                self.replicas.allreduce(block, op="mean", compression=self.compression,
                                        out=block)
        start, stop = self.shard
        lo, hi = max(first, start), min(last, stop)
        if lo < hi:
            self.optimizer.shard_gradient[lo - start:hi - start] += block
        for p in bucket.parameters:
            p.unbind_gradient(self._bind_bucket)

    def _reduce_over_group(self, flat, counts):
        """This rank's block of ``flat`` averaged over the group; ``flat`` is not used after
        (it may hold partial sums)."""
        if self.group is None:
            return flat
        # As the communicator's allreduce does: the library's own for small messages.
        native = self.group.prefers_native(flat.nbytes, self.compression)
        return self.group.reduce_scatter(flat, op="mean", compression=self.compression,
                                         algorithm="native" if native else None,
                                         counts=counts, overwrite_input=True)

    def on_gradient(self, ctx, parameters):
        if self.schedule is not None:
            self.schedule.ready(parameters)

    def reduce(self, ctx, proceed):
        if self.schedule is not None:
            self.schedule.finish()
        elif ctx.sync_gradients:
            self._reduce_scatter_gradients()
        return proceed(ctx)

    def _reduce_scatter_gradients(self):
        """Stage 1: the whole gradient space at once, after backward."""
        if self.group is None:
            # A group of one rank: its shard is the whole space, the gradients stay in place.
            if self.replicas is not None:
                for run in self.optimizer.runs:
                    self.replicas.allreduce(run.grad, op="mean", compression=self.compression,
                                            out=run.grad)
            return
        xp = backend.array_module()
        grads = [run.grad for run in self.optimizer.runs]
        flat = grads[0] if len(grads) == 1 else xp.concatenate(grads)
        start, stop = self.shard
        block = self._reduce_over_group(flat, None)
        if self.replicas is not None and block.size:
            self.replicas.allreduce(block, op="mean", compression=self.compression, out=block)
        for run, (low, high) in zip(self.optimizer.runs, self.optimizer.run_spans):
            lo, hi = max(start, low), min(stop, high)
            if lo >= hi:
                run.grad[...] = 0
                continue
            # block may be the run's own gradient there (reduced in place): copy, then zero
            # only the rest.
            run.grad[lo - low:hi - low] = block[lo - start:hi - start]
            run.grad[:lo - low] = 0
            run.grad[hi - low:] = 0

    # -- parameters -------------------------------------------------------------------------
    def update(self, ctx, proceed):
        if self.gatherer is not None:
            self.gatherer.settle()  # a gather in flight reads the shard the update writes
        result = proceed(ctx)
        if self.gatherer is not None:
            self.gatherer.end_step()
        elif ctx.apply_update and self.group is not None:
            self._broadcast_parameters()
        return result

    def after_step(self, ctx, proceed):
        """From stage 2 the shard's gradient is the step's (or gradient_merge's window's):
        zeroed once it has been used."""
        if self.optimizer.shard_gradient is not None and not ctx.keep_gradients:
            self.optimizer.shard_gradient[...] = 0
        return proceed(ctx)

    def _messages(self, start, stop):
        """Views of the parameters in ``[start, stop)`` of the space, each at most
        ``fuse_broadcast_MB``; ``broadcast_many`` joins adjacent ones up to that size."""
        limit = int(self.fuse_broadcast_MB * 2 ** 20)
        views = []
        for run, (low, high) in zip(self.optimizer.runs, self.optimizer.run_spans):
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

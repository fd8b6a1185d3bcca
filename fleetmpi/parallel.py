"""Data-parallel training: ``distributed_model`` and ``distributed_optimizer``.

Every rank holds the whole model and trains on its own shard of each global batch. Parameters
start identical (one fused broadcast of the flat buffers from rank 0), and after backward the
gradients are averaged over the ranks, bucket by bucket as backward completes them, so with equal
per-rank batches every rank applies the gradient of the mean loss over the global batch.
"""
from . import world
from .distributed_strategy import DistributedStrategy
from .optimizer import Optimizer, StepContext, StepHook, run_step

# Strategies whose hooks are not part of this trainer yet; enabling one must not be ignored.
UNSUPPORTED_STRATEGIES = ("amp", "recompute", "pipeline", "gradient_merge", "lars", "lamb",
                          "localsgd", "adaptive_localsgd", "dgc", "fp16_allreduce", "sharding",
                          "sync_batch_norm", "auto")


def _world_communicator(communicator):
    if communicator is not None:
        return communicator
    world.topology()
    from .comm import get_communicator

    return get_communicator()


def strategy_communicator(strategy):
    """A ``Communicator`` configured by the strategy's allreduce fields (``nccl_comm_num``,
    ``fuse_grad_size_in_MB``, ``use_hierarchical_allreduce``,
    ``hierarchical_allreduce_inter_nranks``; 1, the default, means ranks per node)."""
    from .comm import Communicator

    inter = strategy.hierarchical_allreduce_inter_nranks
    return Communicator(world.topology(), nccl_comm_num=strategy.nccl_comm_num,
                        fuse_grad_size_in_MB=strategy.fuse_grad_size_in_MB,
                        use_hierarchical_allreduce=strategy.use_hierarchical_allreduce,
                        hierarchical_allreduce_inter_nranks=inter if inter > 1 else None)


def distributed_model(model, communicator=None):
    """Make ``model``'s parameters and buffers identical on every rank (rank 0's values, one
    broadcast per flat buffer and one for the buffers) and return it."""
    comm = _world_communicator(communicator)
    flats = [buffer.data for buffer in model.flat_buffers()]
    if flats:
        comm.broadcast_many(flats, root=0)
    states = [b for _, b in model.named_buffers()]
    if states:
        comm.broadcast_many(states, root=0)
    return model


class _Bucket:
    """A contiguous slice ``[start, stop)`` of one gradient buffer and how many of its
    parameters have not reported their gradient yet this step."""

    def __init__(self, buffer, parameters):
        self.buffer = buffer
        self.start = parameters[0].offset
        self.stop = parameters[-1].offset + parameters[-1].size
        self.size = len(parameters)
        self.pending = self.size


def plan_gradient_buckets(runs, bucket_bytes):
    """Buckets of at most ``bucket_bytes`` (a parameter bigger than that alone) over the
    contiguous runs of the optimizer's parameters; ``bucket_bytes=None`` gives one bucket per
    parameter (no fusion)."""
    buckets = []
    for run in runs:
        current, current_bytes = [], 0
        for p in run.parameters:
            nbytes = p.size * p.dtype.itemsize
            if current and (bucket_bytes is None or current_bytes + nbytes > bucket_bytes):
                buckets.append(_Bucket(run.buffer, current))
                current, current_bytes = [], 0
            current.append(p)
            current_bytes += nbytes
        if current:
            buckets.append(_Bucket(run.buffer, current))
    return buckets


class GradientAllreduce(StepHook):
    """Averages gradients over the ranks: each bucket, a slice of a flat gradient buffer, is
    allreduced in place (``op="mean"``; the communicator picks the algorithm, hierarchical when
    the strategy asks for it) as soon as backward has reported all its parameters. Buckets
    never reported (parameters that got no gradient this step) are reduced in the reduce
    stage, in buffer order."""

    def __init__(self, communicator, optimizer, strategy):
        self.communicator = communicator
        bucket_bytes = (int(strategy.fuse_grad_size_in_MB * 2 ** 20)
                        if strategy.fuse_all_reduce_ops else None)
        self.buckets = plan_gradient_buckets(optimizer._runs, bucket_bytes)
        self._bucket_of = {id(p): bucket for bucket in self.buckets
                           for p in bucket.buffer.parameters
                           if bucket.start <= p.offset < bucket.stop}

    def _reduce(self, bucket):
        self.communicator.allreduce_many([bucket.buffer.grad[bucket.start:bucket.stop]],
                                         op="mean")
        bucket.pending = -1

    def on_gradient(self, ctx, parameters):
        for p in parameters:
            bucket = self._bucket_of.get(id(p))
            if bucket is None:
                continue
            bucket.pending -= 1
            if bucket.pending == 0:
                self._reduce(bucket)

    def reduce(self, ctx, proceed):
        for bucket in self.buckets:
            if bucket.pending >= 0:
                self._reduce(bucket)
            bucket.pending = bucket.size
        return proceed(ctx)


class DistributedOptimizer:
    """An optimizer whose ``minimize`` runs one data-parallel step through a chain of step
    hooks (gradient averaging first); everything else is the wrapped optimizer's."""

    def __init__(self, optimizer, strategy=None, communicator=None):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"distributed_optimizer wraps a fleetmpi.optimizer optimizer, "
                            f"not {type(optimizer).__name__}")
        strategy = DistributedStrategy() if strategy is None else strategy
        if not isinstance(strategy, DistributedStrategy):
            raise TypeError(f"strategy must be a fleetmpi.DistributedStrategy, not "
                            f"{type(strategy).__name__}")
        enabled = [name for name in UNSUPPORTED_STRATEGIES if getattr(strategy, name)]
        if enabled:
            raise NotImplementedError(
                f"strategy {', '.join(enabled)} is enabled but this version of the trainer "
                "runs plain data parallel only; set it to False")
        self.inner = optimizer
        self.strategy = strategy
        if world.worker_num() > 1 or communicator is not None:
            self.communicator = communicator or strategy_communicator(strategy)
        else:
            self.communicator = None
        build = strategy.build_strategy
        optimizer.fuse_all_optimizer_ops = bool(build.fuse_all_optimizer_ops)
        self._fusion = (bool(build.fuse_elewise_add_act_ops), bool(build.fuse_bn_act_ops))
        self._configured = set()
        self.hooks = []
        if self.communicator is not None:
            self.hooks.append(GradientAllreduce(self.communicator, optimizer, strategy))

    def add_hook(self, hook, first=False):
        """Put ``hook`` into the step chain (outermost when ``first``)."""
        if first:
            self.hooks.insert(0, hook)
        else:
            self.hooks.append(hook)

    def minimize(self, model, loss_fn, x, y):
        """One data-parallel training step; returns this rank's mean loss as a 0-d array."""
        if id(model) not in self._configured:
            model.configure_fusion(*self._fusion)
            self._configured.add(id(model))
        return run_step(self.hooks, StepContext(model, loss_fn, x, y, self.inner))

    def __getattr__(self, name):
        return getattr(self.inner, name)


def distributed_optimizer(optimizer, strategy=None, communicator=None):
    """Wrap ``optimizer`` for data-parallel training under ``strategy`` (the default
    ``DistributedStrategy`` when None)."""
    return DistributedOptimizer(optimizer, strategy, communicator)

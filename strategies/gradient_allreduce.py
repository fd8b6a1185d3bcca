"""The gradient reduction every data-parallel step ends its backward with, and fp16_allreduce.

Gradients are averaged over the ranks bucket by bucket: a bucket is a slice of a flat gradient
buffer, whose reduction in place (``op="mean"``) starts on the communicator's thread as soon as
backward has reported all its parameters, so communication overlaps the rest of backward; the
update waits for every bucket (``FLEETMPI_OVERLAP_ALLREDUCE=0``: each bucket is reduced before
backward goes on). Buckets follow the collective guide's fusion
fields: ``fuse_all_reduce_ops`` (off: one bucket per parameter), ``fuse_grad_size_in_MB`` (the
most bytes in a bucket) and ``fuse_grad_size_in_TFLOPS`` (despite its name, the guide defines it
as the most layers whose gradients one fused allreduce carries), and Paddle's
``last_comm_group_size_MB`` (the most bytes of the last bucket, whose reduction nothing
overlaps), planned by the comm layer's ``plan_buckets``.

The allreduce algorithm of each bucket is chosen once per bucket plan, at its first reduction
(``Communicator.allreduce_algorithm``), and passed to every reduction of the bucket. Each
bucket's reduction is an event of the timeline (``fleetmpi.core.timeline``, lane ``comm``, named
``bucket <index>``) with its index, that algorithm, bytes and number of parameters.

``check_bucket``, when set (``fleetmpi.strategies.nonfinite``), is called with each bucket
just before it is reduced: the rank's own gradient, read where it is still hot.
Where some ranks have joined (``fleetmpi.Join``) a step's average counts only the ranks that
contributed a batch (``StepContext.contributors``).
"""
import os

from fleetmpi.core import backend, timeline
from fleetmpi.comm import Extent, megabytes, plan_buckets
from fleetmpi.core.knobs import OVERLAP_ALLREDUCE
from fleetmpi.core.log import logger
from .base import Strategy


def overlap_allreduce(environ=os.environ):
    """Whether buckets are reduced asynchronously, on the communicator's thread while backward
    goes on (``FLEETMPI_OVERLAP_ALLREDUCE``: ``1``, the default, or ``0``). On by default on
    CPU too: at 2 ranks on a 2-core machine it was not slower than reducing each bucket before
    backward goes on (ResNet-20 1.25-2.8x faster, the MLP 0.7-1.3x, medians 1.7x and 1.1x;
    docs/performance.md, "Overlapped gradient reduction")."""
    return OVERLAP_ALLREDUCE.value(environ)


class GradientBucket:
    """A contiguous slice ``[start, stop)`` of one gradient buffer, its position ``index`` in
    the plan, and how many of its parameters have not reported their gradient yet this step
    (-1: already reduced)."""

    def __init__(self, buffer, parameters, index=0):
        self.buffer = buffer
        self.index = index
        self.parameters = list(parameters)
        self.start = parameters[0].offset
        self.stop = parameters[-1].offset + parameters[-1].size
        self.size = len(parameters)
        self.pending = self.size

    @property
    def grad(self):
        return self.buffer.grad[self.start:self.stop]


def layer_of(parameter):
    """The dotted name of the layer that owns ``parameter`` (``"fc1"`` for ``"fc1.weight"``)."""
    name = parameter.name or ""
    return name.rsplit(".", 1)[0] if "." in name else name


def fusion_limits(strategy):
    """``(bucket_bytes, max_layers, last_bucket_bytes)`` of the fusion fields
    (``fuse_grad_size_in_MB``, ``fuse_grad_size_in_TFLOPS``, ``last_comm_group_size_MB``);
    ``fuse_all_reduce_ops`` off means no fusion (a bucket per parameter)."""
    if not strategy.fuse_all_reduce_ops:
        return None, None, None
    return (megabytes(strategy.fuse_grad_size_in_MB), strategy.fuse_grad_size_in_TFLOPS,
            megabytes(strategy.last_comm_group_size_MB))


def plan_gradient_buckets(runs, bucket_bytes, max_layers=None, last_bucket_bytes=None,
                          shard_bytes=None):
    """The ``GradientBucket``s of the optimizer's contiguous runs of parameters, in the order
    backward completes them: the comm layer's ``plan_buckets`` over each run, by the
    parameters' bytes and layers (``layer_of``), the bound on the last bucket applied to the
    last run's (the one reduced last)."""
    buckets = []
    for number, run in enumerate(runs):
        parameters = run.parameters
        extents = [Extent(p.size * p.dtype.itemsize, p.dtype) for p in parameters]
        last = last_bucket_bytes if number == len(runs) - 1 else None
        for indices in plan_buckets(extents, bucket_bytes, [layer_of(p) for p in parameters],
                                    max_layers, shard_bytes, last):
            buckets.append(GradientBucket(run.buffer, [parameters[i] for i in indices],
                                          len(buckets)))
    return buckets


class BucketSchedule:
    """Reduces buckets in their index order only (as PyTorch DDP launches its buckets): a
    bucket whose parameters are all final waits until every bucket before it has been
    reduced. A bucket never completed during backward (a parameter that got no gradient this
    step, a branch not taken on this rank) is reduced by ``finish`` with every bucket after
    it, still in index order, so every rank issues the same collectives in the same order even
    when ranks take different branches. ``reduce(bucket)`` does the reduction,
    or starts it and returns its ``Handle``: ``finish`` waits for those before the update (as
    Horovod and DDP do), so the reduction of one bucket overlaps the backward still to come.
    ``on_unused``, when set, is called by ``finish`` with the parameters that reported no
    gradient in a step whose buckets it reduces."""

    def __init__(self, buckets, reduce, on_unused=None):
        self.buckets = buckets
        self._reduce = reduce
        self._bucket_of = {id(p): bucket for bucket in buckets for p in bucket.parameters}
        self._next = 0
        self._handles = []
        self.on_unused = on_unused
        self._reported = set()

    def bucket_of(self, parameter):
        return self._bucket_of.get(id(parameter))

    def ready(self, parameters):
        """``parameters``' gradients are final: reduce every bucket that can go now."""
        for p in parameters:
            bucket = self._bucket_of.get(id(p))
            if bucket is not None:
                bucket.pending -= 1
                if self.on_unused is not None:
                    self._reported.add(id(p))
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._run(self.buckets[self._next])
            self._next += 1

    def _run(self, bucket):
        handle = self._reduce(bucket)
        if handle is not None:
            self._handles.append(handle)
        bucket.pending = -1

    def finish(self, reduce_rest=True):
        """The end of the step's backward: reduce the buckets not reduced yet (unless
        ``reduce_rest`` is off), wait for the reductions started asynchronously, and start the
        next step afresh."""
        if reduce_rest and self.on_unused is not None:
            unused = [p for bucket in self.buckets if bucket.pending > 0
                      for p in bucket.parameters if id(p) not in self._reported]
            if unused:
                self.on_unused(unused)
        self._reported.clear()
        for bucket in self.buckets:
            if reduce_rest and bucket.pending >= 0:
                self._run(bucket)
            bucket.pending = bucket.size
        self._next = 0
        self.wait()

    def wait(self):
        """Wait for every asynchronous reduction started; raise the first one's error, after
        all have finished."""
        handles, self._handles = self._handles, []
        errors = []
        for handle in handles:
            try:
                handle.wait()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


class GradientAllreduce(Strategy):
    """Averages the gradients over the ranks, bucket by bucket (``BucketSchedule``'s order),
    on every step whose ``ctx.sync_gradients`` is on; a parameter unused on some ranks gets
    the average of the gradients (zero where unused) over all ranks.

    ``find_unused_parameters``: Paddle's DataParallel raises when a parameter gets no gradient
    unless it is on. Here such a parameter is always reduced as zeros (ranks may take different
    branches, and every rank still issues the same collectives); with the field off, Paddle's
    default, the first step that has one logs a warning on that rank naming them, so a
    parameter left out of the graph by mistake is not silent."""

    name = "gradient_allreduce"
    compression = None
    communicator_scope = "replicas"
    is_gradient_reduction = True

    def __init__(self, strategy, optimizer, communicator):
        super().__init__(strategy, optimizer, communicator)
        self.buckets = plan_gradient_buckets(optimizer.runs, *fusion_limits(strategy))
        self.bucket_algorithms = None  # by bucket index, once chosen (see _algorithm)
        self.overlap = overlap_allreduce()
        self.schedule = BucketSchedule(
            self.buckets, self._start if self.overlap else self._reduce,
            None if strategy.find_unused_parameters else self._warn_unused)
        self.check_bucket = None
        self.contributors = None

    def _warn_unused(self, parameters):
        """Warn once that ``parameters`` got no gradient this step (see the class docstring)."""
        self.schedule.on_unused = None
        names = ", ".join(p.name or f"<unnamed {list(p.shape)}>" for p in parameters)
        logger.warning("%d parameter(s) got no gradient in this step and are reduced as zeros: "
                       "%s. Paddle's DataParallel raises here unless find_unused_parameters "
                       "is on; set strategy.find_unused_parameters = True if they are left "
                       "out on purpose (this warning is given once)", len(parameters), names)

    def _algorithm(self, bucket):
        """The allreduce algorithm of ``bucket``, chosen for every bucket of the plan at the
        first reduction: every rank reduces the buckets in one order, and choosing may be
        collective (``Communicator.allreduce_algorithm`` times ring against shm once)."""
        if self.bucket_algorithms is None:
            choose = self.communicator.allreduce_algorithm
            self.bucket_algorithms = [choose(b.grad.nbytes, self.compression)
                                      for b in self.buckets]
        return self.bucket_algorithms[bucket.index]

    def _reduce(self, bucket):
        grad = bucket.grad
        if self.check_bucket is not None:
            self.check_bucket(bucket)
        algorithm = self._algorithm(bucket)
        with timeline.span(f"bucket {bucket.index}", "comm") as event:
            if event:
                event.args.update(bucket=bucket.index, bytes=int(grad.nbytes),
                                  parameters=bucket.size, algorithm=algorithm)
            self._average(grad, algorithm)

    def _average(self, grad, algorithm):
        """``grad`` averaged in place over the ranks that contributed this step: every rank's
        mean, or, where some have joined (``contributors``), the sum divided by their count."""
        contributors = self.contributors
        if contributors is None or contributors == self.world_size:
            self.communicator.allreduce_many([grad], op="mean", algorithm=algorithm,
                                             compression=self.compression)
            return
        self.communicator.allreduce_many([grad], op="sum", algorithm=algorithm,
                                         compression=self.compression)
        backend.array_module().divide(grad, contributors, out=grad, casting="unsafe")

    def _start(self, bucket):
        return self.communicator.submit(f"bucket {bucket.index}",
                                        lambda: self._reduce(bucket), bucket.grad)

    def on_gradient(self, ctx, parameters):
        if ctx.sync_gradients:
            self.contributors = ctx.contributors
            self.schedule.ready(parameters)

    def reduce(self, ctx, proceed):
        self.contributors = ctx.contributors
        self.schedule.finish(ctx.sync_gradients)
        return proceed(ctx)


class FP16AllReduce(GradientAllreduce):
    """``fp16_allreduce``: the same bucketed reduction with float16 on the wire (the comm
    layer's ``compression="fp16"``: float32 partial sums, error bound in
    ``fleetmpi.comm.compression``); the gradients stay float32 in the flat buffer."""

    name = "fp16_allreduce"
    compression = "fp16"

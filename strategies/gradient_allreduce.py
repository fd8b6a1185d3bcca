"""The gradient reduction every data-parallel step ends its backward with, and fp16_allreduce.

Gradients are averaged over the ranks bucket by bucket: a bucket is a slice of a flat gradient
buffer, reduced in place (``op="mean"``) as soon as backward has reported all its parameters,
so communication overlaps the rest of backward. Buckets follow the collective guide's fusion
fields: ``fuse_all_reduce_ops`` (off: one bucket per parameter), ``fuse_grad_size_in_MB`` (the
most bytes in a bucket) and ``fuse_grad_size_in_TFLOPS`` (despite its name, the guide defines it
as the most layers whose gradients one fused allreduce carries).

Each bucket's reduction is an event of the timeline (``fleetmpi.timeline``, lane ``comm``,
named ``bucket <index>``) with its index, algorithm, bytes and number of parameters.
"""
from .. import timeline
from .base import Strategy


class Bucket:
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


def plan_gradient_buckets(runs, bucket_bytes, max_layers=None):
    """Buckets over the contiguous runs of the optimizer's parameters, each holding at most
    ``bucket_bytes`` (a parameter bigger than that alone) and the parameters of at most
    ``max_layers`` layers; ``bucket_bytes=None`` gives one bucket per parameter (no fusion)."""
    buckets = []
    for run in runs:
        current, current_bytes, layers = [], 0, set()
        for p in run.parameters:
            nbytes = p.size * p.dtype.itemsize
            layer = layer_of(p)
            full = (bucket_bytes is None or current_bytes + nbytes > bucket_bytes
                    or (max_layers is not None and layer not in layers
                        and len(layers) >= max_layers))
            if current and full:
                buckets.append(Bucket(run.buffer, current, len(buckets)))
                current, current_bytes, layers = [], 0, set()
            current.append(p)
            current_bytes += nbytes
            layers.add(layer)
        if current:
            buckets.append(Bucket(run.buffer, current, len(buckets)))
    return buckets


class GradientAllreduce(Strategy):
    """Averages the gradients over the ranks, bucket by bucket, on every step whose
    ``ctx.sync_gradients`` is on.

    Buckets are reduced in their index order only (as PyTorch DDP launches its buckets): a
    bucket whose parameters are all final waits until every bucket before it has been
    reduced. A bucket never completed during backward (a parameter that got no gradient this
    step, a branch not taken on this rank) is reduced in the reduce stage with every bucket
    after it, still in index order, so every rank issues the same collectives in the same
    order even when ranks take different branches, and a parameter unused on some ranks gets
    the average of the gradients (zero where unused) over all ranks."""

    name = "gradient_allreduce"
    compression = None

    def __init__(self, strategy, optimizer, communicator):
        super().__init__(strategy, optimizer, communicator)
        bucket_bytes = (int(strategy.fuse_grad_size_in_MB * 2 ** 20)
                        if strategy.fuse_all_reduce_ops else None)
        max_layers = strategy.fuse_grad_size_in_TFLOPS if strategy.fuse_all_reduce_ops else None
        self.buckets = plan_gradient_buckets(optimizer._runs, bucket_bytes, max_layers)
        self._bucket_of = {id(p): bucket for bucket in self.buckets for p in bucket.parameters}
        self._next = 0

    def _reduce(self, bucket):
        grad = bucket.grad
        with timeline.span(f"bucket {bucket.index}", "comm") as event:
            if event:
                event.args.update(
                    bucket=bucket.index, bytes=int(grad.nbytes), parameters=bucket.size,
                    algorithm=self.communicator.allreduce_algorithm(grad.nbytes,
                                                                    self.compression))
            self.communicator.allreduce_many([grad], op="mean", compression=self.compression)
        bucket.pending = -1

    def on_gradient(self, ctx, parameters):
        if not ctx.sync_gradients:
            return
        for p in parameters:
            bucket = self._bucket_of.get(id(p))
            if bucket is None:
                continue
            bucket.pending -= 1
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._reduce(self.buckets[self._next])
            self._next += 1

    def reduce(self, ctx, proceed):
        for bucket in self.buckets:
            if ctx.sync_gradients and bucket.pending >= 0:
                self._reduce(bucket)
            bucket.pending = bucket.size
        self._next = 0
        return proceed(ctx)


class FP16AllReduce(GradientAllreduce):
    """``fp16_allreduce``: the same bucketed reduction with float16 on the wire (the comm
    layer's ``compression="fp16"``: float32 partial sums, error bound in
    ``fleetmpi.comm.compression``); the gradients stay float32 in the flat buffer."""

    name = "fp16_allreduce"
    compression = "fp16"

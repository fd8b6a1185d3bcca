"""A model's gradient buckets as the data-parallel step forms them, and published models.

``gradient_buckets`` builds the same ``plan_gradient_buckets`` the ``gradient_allreduce``
strategy builds from a ``DistributedStrategy``'s fusion fields (``fuse_all_reduce_ops``,
``fuse_grad_size_in_MB``, ``fuse_grad_size_in_TFLOPS`` as a layer count; ``fusion_limits``
reads them for both), over the optimizer's runs of the model's flat parameter buffers, and
returns each bucket's bytes in buffer order, which is the order backward completes them
(``nn.flat`` lays parameters out last layer first).
"""
import dataclasses

from .. import nn
from ..config.distributed_strategy import DistributedStrategy
from ..optimizer import SGD
from fleetmpi.strategies.gradient_allreduce import fusion_limits, plan_gradient_buckets


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Bytes of each gradient bucket in buffer order, and each parameter tensor's element
    count (dgc selects per tensor)."""

    nbytes: tuple
    tensor_sizes: tuple

    @property
    def total_bytes(self):
        return sum(self.nbytes)


def gradient_buckets(model, strategy=None):
    """The ``Buckets`` of ``model`` under ``strategy``'s fusion fields (Paddle's defaults when
    None)."""
    strategy = DistributedStrategy() if strategy is None else strategy
    opt = SGD(learning_rate=0.0, parameters=model.parameters())
    planned = plan_gradient_buckets(opt.runs, *fusion_limits(strategy))
    return Buckets(tuple(int(b.grad.nbytes) for b in planned),
                   tuple(int(p.size) for run in opt.runs for p in run.parameters))


MODELS = {
    "resnet50": nn.resnet50,
    "resnet101": nn.resnet101,
    "resnet20": nn.resnet20,
}


def model_from_spec(spec):
    """A model from a short spec: ``resnet50``, ``resnet101``, ``resnet20`` or
    ``mlp:784,1024,10`` (the ``nn.MLP`` sizes)."""
    if spec in MODELS:
        return MODELS[spec]()
    if spec.startswith("mlp:"):
        try:
            sizes = [int(s) for s in spec[4:].split(",")]
        except ValueError:
            sizes = None
        if sizes and len(sizes) >= 2 and all(s > 0 for s in sizes):
            return nn.MLP(sizes)
    raise ValueError(f"model {spec!r} is not known; allowed: {', '.join(sorted(MODELS))}, or "
                     f"mlp:SIZES with at least two positive sizes (mlp:784,1024,10)")

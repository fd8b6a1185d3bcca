"""``tensor_parallel``: Megatron-LM's tensor (model) parallelism, the layers of
``fleetmpi.nn.tensor_parallel`` splitting their weights over the model-parallel group of the
hybrid layout (``fleetmpi.hybrid``).

The layers communicate inside the model's forward and backward themselves, so this strategy
has no step hooks of its own: the parameters a rank holds are its part, their gradients are
complete once backward has run, and the data-parallel averaging runs over the ranks of the same
model-parallel coordinate. What it does is refuse what needs a whole tensor or every
parameter's gradient on one rank.
"""
from fleetmpi.optimizer.clip import ClipGradByGlobalNorm
from .base import Strategy


class TensorParallel(Strategy):
    """``tensor_parallel`` (module docstring)."""

    name = "tensor_parallel"

    @classmethod
    def check(cls, strategy, optimizer):
        super().check(strategy, optimizer)
        if isinstance(optimizer.grad_clip, ClipGradByGlobalNorm):
            raise ValueError("tensor_parallel: ClipGradByGlobalNorm needs the norm over every "
                             "gradient, but each rank of a model-parallel group holds its own "
                             "part of the split weights; use ClipGradByNorm (per tensor "
                             "part) or no clipping")

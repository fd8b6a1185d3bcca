"""``fleet.utils`` as Paddle offers it: ``recompute(layer_or_function, *args, **kwargs)``
runs a block without keeping its activations and computes it again in backward
(``fleetmpi.autograd.recompute``)."""
from .autograd.recompute import recompute

__all__ = ["recompute"]

"""Paddle's ``paddle.device`` names that fleetmpi has: ``set_device``, ``get_device`` and
``cuda.graphs`` (CUDA graphs)."""
from . import cuda
from .placement import get_device, set_device

__all__ = ["cuda", "get_device", "set_device"]

"""Paddle's ``paddle.device`` names that fleetmpi has: ``cuda.graphs`` (CUDA graphs)."""
from . import cuda

__all__ = ["cuda"]

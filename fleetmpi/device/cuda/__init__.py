"""Paddle's ``paddle.device.cuda`` names that fleetmpi has: ``graphs`` (``CUDAGraph``)."""
from . import graphs

__all__ = ["graphs"]

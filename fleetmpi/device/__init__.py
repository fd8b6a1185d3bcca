"""Paddle's ``paddle.device`` names that fleetmpi has: ``set_device``, ``get_device`` and
``cuda.graphs`` (CUDA graphs)."""
from ..core.paddle_names import module_getattr as _module_getattr
from . import cuda
from .placement import get_device, set_device

__all__ = ["cuda", "get_device", "set_device"]


# A name Paddle has and fleetmpi lacks raises an error that says so (core.paddle_names).
__getattr__ = _module_getattr(__name__, "paddle.device", globals())

"""``fleetmpi.hapi``: Paddle's high-level API, ``Model`` with its callbacks and ``summary``."""
from . import callbacks
from .model import Model
from ..nn.summary import summary

__all__ = ["Model", "callbacks", "summary"]

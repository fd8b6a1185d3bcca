"""``fleetmpi.framework``: the names of Paddle's ``paddle.framework`` that fleetmpi has."""
from .nn.param_attr import ParamAttr

__all__ = ["ParamAttr"]

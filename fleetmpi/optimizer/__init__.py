"""``fleetmpi.optimizer``: SGD, Momentum, Adam, AdamW, RMSProp, Adagrad and Adamax over flat
parameter buffers, learning-rate schedules in ``fleetmpi.optimizer.lr``, gradient clipping, and
the hookable training step."""
from ..core.paddle_names import module_getattr as _module_getattr
from . import lr
from .adaptive import Adagrad, Adamax, RMSProp
from .clip import ClipGradByGlobalNorm, ClipGradByNorm
from .optimizer import SGD, Adam, AdamW, Momentum, Optimizer
from .step import StepContext, StepHook, run_step

__all__ = ["SGD", "Adagrad", "Adam", "Adamax", "AdamW", "ClipGradByGlobalNorm", "ClipGradByNorm",
           "Momentum", "Optimizer", "RMSProp", "StepContext", "StepHook", "lr", "run_step"]


# A name Paddle has and fleetmpi lacks raises an error that says so (core.paddle_names).
__getattr__ = _module_getattr(__name__, "paddle.optimizer", globals())

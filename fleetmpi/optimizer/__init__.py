"""``fleetmpi.optimizer``: SGD, Momentum, Adam, AdamW, RMSProp, Adagrad and Adamax over flat
parameter buffers, learning-rate schedules in ``fleetmpi.optimizer.lr``, gradient clipping, and
the hookable training step."""
from . import lr
from .adaptive import Adagrad, Adamax, RMSProp
from .clip import ClipGradByGlobalNorm, ClipGradByNorm
from .optimizer import SGD, Adam, AdamW, Momentum, Optimizer
from .step import StepContext, StepHook, run_step

__all__ = ["SGD", "Adagrad", "Adam", "Adamax", "AdamW", "ClipGradByGlobalNorm", "ClipGradByNorm",
           "Momentum", "Optimizer", "RMSProp", "StepContext", "StepHook", "lr", "run_step"]

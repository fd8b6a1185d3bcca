"""``fleetmpi.optimizer``: SGD, Momentum, Adam, AdamW over flat parameter buffers, learning-rate
schedules in ``fleetmpi.optimizer.lr``, and the hookable training step."""
from . import lr
from .optimizer import SGD, Adam, AdamW, Momentum, Optimizer
from .step import StepContext, StepHook, run_step

__all__ = ["SGD", "Adam", "AdamW", "Momentum", "Optimizer", "StepContext", "StepHook", "lr",
           "run_step"]

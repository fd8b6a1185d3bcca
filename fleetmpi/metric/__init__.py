"""Paddle's metrics (``paddle.metric``), with a distributed ``accumulate``."""
from ..core.paddle_names import module_getattr as _module_getattr
from .metrics import Accuracy, Auc, Metric, Precision, Recall, accuracy

__all__ = ["Accuracy", "Auc", "Metric", "Precision", "Recall", "accuracy"]


# A name Paddle has and fleetmpi lacks raises an error that says so (core.paddle_names).
__getattr__ = _module_getattr(__name__, "paddle.metric", globals())

"""Paddle's metrics (``paddle.metric``), with a distributed ``accumulate``."""
from .metrics import Accuracy, Auc, Metric, Precision, Recall, accuracy

__all__ = ["Accuracy", "Auc", "Metric", "Precision", "Recall", "accuracy"]

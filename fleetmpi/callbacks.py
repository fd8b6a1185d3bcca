"""``fleetmpi.callbacks``: Paddle's ``paddle.callbacks``, the callbacks ``Model.fit``,
``evaluate`` and ``predict`` take (``fleetmpi.hapi.callbacks``)."""
from .hapi.callbacks import (Callback, EarlyStopping, LRScheduler, ModelCheckpoint,
                             ProgBarLogger, ReduceLROnPlateau, VisualDL)

__all__ = ["Callback", "EarlyStopping", "LRScheduler", "ModelCheckpoint", "ProgBarLogger",
           "ReduceLROnPlateau", "VisualDL"]

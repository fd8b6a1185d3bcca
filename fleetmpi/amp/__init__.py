"""``fleetmpi.amp``, Paddle's ``paddle.amp``: ``auto_cast``, ``GradScaler`` and ``decorate``
for dygraph mixed precision, a thin surface over the ``amp`` strategy's operator lists and
loss scaling (``fleetmpi.strategies.amp``, ``fleetmpi.strategies.loss_scaling``).

    with fleetmpi.amp.auto_cast(level="O1", dtype="float16"):
        loss = loss_fn(model(x), y)
    scaled = scaler.scale(loss)
    scaled.backward()
    scaler.minimize(opt, scaled)      # or scaler.step(opt); scaler.update()
    opt.clear_grad()
"""
from ..core.paddle_names import module_getattr as _module_getattr
from .auto_cast import auto_cast, decorate
from .grad_scaler import GradScaler, distributed_scaler

__all__ = ["GradScaler", "auto_cast", "decorate", "distributed_scaler"]


# A name Paddle has and fleetmpi lacks raises an error that says so (core.paddle_names).
__getattr__ = _module_getattr(__name__, "paddle.amp", globals())

"""``paddle.callbacks`` (``paddle.hapi.callbacks``): the callbacks, and the ones ``Model``
adds to those a script passes (``config_callbacks``), as Paddle adds them: a
``ProgBarLogger`` unless one is given or ``verbose=0``, a ``ModelCheckpoint`` saving to
``save_dir`` unless one is given, and an ``LRScheduler`` stepping the learning rate schedule
after every step unless one is given; an ``EarlyStopping`` saves its best model under fit's
``save_dir``.
"""
from .callback import Callback, CallbackList
from .logging_callbacks import ProgBarLogger, VisualDL
from .training_callbacks import EarlyStopping, LRScheduler, ModelCheckpoint, ReduceLROnPlateau

__all__ = ["Callback", "EarlyStopping", "LRScheduler", "ModelCheckpoint", "ProgBarLogger",
           "ReduceLROnPlateau", "VisualDL"]


def config_callbacks(callbacks=None, model=None, batch_size=None, epochs=None, steps=None,
                     log_freq=2, verbose=2, save_freq=1, save_dir=None, metrics=None,
                     mode="train"):
    """The ``CallbackList`` of a run: ``callbacks`` (one or a list) with the defaults above,
    bound to ``model`` and given the run's parameters."""
    given = list(callbacks) if isinstance(callbacks, (list, tuple)) else (
        [] if callbacks is None else [callbacks])
    for callback in given:
        if not isinstance(callback, Callback):
            raise TypeError(f"callbacks take fleetmpi.callbacks.Callback objects, not "
                            f"{type(callback).__name__}")
    chosen = list(given)
    if verbose and not any(isinstance(c, ProgBarLogger) for c in chosen):
        chosen.insert(0, ProgBarLogger(log_freq, verbose=verbose))
    if not any(isinstance(c, ModelCheckpoint) for c in chosen):
        chosen.append(ModelCheckpoint(save_freq, save_dir))
    for callback in chosen:
        if isinstance(callback, EarlyStopping):
            callback.save_dir = save_dir
    if not any(isinstance(c, LRScheduler) for c in chosen):
        chosen.append(LRScheduler())
    listed = CallbackList(chosen)
    listed.set_model(model)
    listed.set_params({"batch_size": batch_size, "epochs": epochs, "steps": steps,
                       "verbose": verbose,
                       "metrics": (metrics or []) if mode != "test" else []})
    return listed

"""Paddle's callbacks that act on the training: ``ModelCheckpoint``, ``LRScheduler``,
``EarlyStopping`` and ``ReduceLROnPlateau``, with Paddle 2.5's arguments and rules.

The values they watch are the evaluation's logs, which are the same on every rank (the
metrics see every rank's samples, ``ranks.py``), so every rank stops, or lowers its learning
rate, at the same epoch. Files are written and messages printed by rank 0.
"""
import numbers
import os
import warnings

import numpy as np

from ..optimizer.lr import LRScheduler as _Schedule
from .callback import Callback, is_first_rank


def _optimizer(model):
    """The model's optimizer, the one inside a ``fleet.distributed_optimizer`` (None before
    ``prepare``)."""
    optimizer = getattr(model, "_optimizer", None)
    return getattr(optimizer, "inner", optimizer)


def _schedule(model):
    """The ``optimizer.lr.LRScheduler`` of the model's optimizer, or None."""
    rate = getattr(_optimizer(model), "_learning_rate", None)
    return rate if isinstance(rate, _Schedule) else None


def _monitored(logs, monitor, who):
    """The number ``logs[monitor]`` (the first of a list), or None with a warning where the
    logs lack it."""
    if logs is None or monitor not in logs:
        warnings.warn(f"{who} monitors {monitor!r}, which the evaluation does not log; it "
                      f"logs {sorted(logs or {})} (the loss and each metric's name)")
        return None
    value = logs[monitor]
    value = value[0] if isinstance(value, (list, tuple)) else value
    return value if isinstance(value, numbers.Number) else None


def _greater_is_better(mode, monitor, who):
    if mode not in ("auto", "min", "max"):
        warnings.warn(f"{who} mode {mode!r} is unknown; allowed: 'auto', 'min', 'max'. "
                      "'auto' is used")
        mode = "auto"
    return mode == "max" or (mode == "auto" and "acc" in monitor)


class ModelCheckpoint(Callback):
    """Save the model (``Model.save``) to ``save_dir/<epoch>`` after every ``save_freq``-th
    epoch and to ``save_dir/final`` at the end of training; nothing without ``save_dir``."""

    def __init__(self, save_freq=1, save_dir=None):
        super().__init__()
        self.save_freq = save_freq
        self.save_dir = save_dir

    def _save(self, name):
        path = os.path.join(self.save_dir, str(name))
        if is_first_rank():
            print(f"save checkpoint at {os.path.abspath(path)}")
        self.model.save(path)

    def on_epoch_end(self, epoch, logs=None):
        if self.model is not None and self.save_dir and epoch % self.save_freq == 0:
            self._save(epoch)

    def on_train_end(self, logs=None):
        if self.model is not None and self.save_dir:
            self._save("final")


class LRScheduler(Callback):
    """Step the optimizer's ``LRScheduler`` after every training step (``by_step``, the
    default ``Model.fit`` adds) or after every epoch (``by_epoch``)."""

    def __init__(self, by_step=True, by_epoch=False):
        super().__init__()
        if by_step and by_epoch:
            raise ValueError("LRScheduler by_step and by_epoch: choose one of them")
        self.by_step = by_step
        self.by_epoch = by_epoch

    def on_epoch_end(self, epoch, logs=None):
        if self.by_epoch and _schedule(self.model) is not None:
            _schedule(self.model).step()

    def on_train_batch_end(self, step, logs=None):
        if self.by_step and _schedule(self.model) is not None:
            _schedule(self.model).step()


class EarlyStopping(Callback):
    """Stop training when the evaluation's ``monitor`` (``"loss"`` or a metric's name) has
    not improved by more than ``min_delta`` for ``patience`` evaluations (Paddle's count: with
    ``patience=0`` the first evaluation stops it). ``mode``: ``"min"``, ``"max"``, or
    ``"auto"`` (``"max"`` for a name holding ``"acc"``). ``baseline``: the value to improve on.
    ``save_best_model``: save the best model to ``<fit's save_dir>/best_model``."""

    def __init__(self, monitor="loss", mode="auto", patience=0, verbose=1, min_delta=0,
                 baseline=None, save_best_model=True):
        super().__init__()
        self.monitor = monitor
        self.patience = patience
        self.verbose = verbose
        self.baseline = baseline
        self.greater = _greater_is_better(mode, monitor, "EarlyStopping")
        self.min_delta = abs(min_delta) if self.greater else -abs(min_delta)
        self.save_best_model = save_best_model
        self.save_dir = None  # fit's save_dir, given by config_callbacks
        self.wait_epoch = 0
        self.stopped_epoch = 0
        self.best_value = None

    def on_train_begin(self, logs=None):
        self.wait_epoch = 0
        if self.baseline is not None:
            self.best_value = self.baseline
        else:
            self.best_value = -np.inf if self.greater else np.inf

    def _improved(self, current):
        shifted = current - self.min_delta
        return shifted > self.best_value if self.greater else shifted < self.best_value

    def on_eval_end(self, logs=None):
        current = _monitored(logs, self.monitor, "EarlyStopping")
        if current is None:
            return
        best_path = None if self.save_dir is None else os.path.join(self.save_dir, "best_model")
        if self._improved(current):
            self.best_value = current
            self.wait_epoch = 0
            if self.save_best_model and best_path is not None:
                self.model.save(best_path)
        else:
            self.wait_epoch += 1
        if self.wait_epoch >= self.patience:
            self.model.stop_training = True
            if self.verbose > 0 and is_first_rank():
                print(f"Epoch {self.stopped_epoch + 1}: Early stopping.")
                if self.save_best_model and best_path is not None:
                    print(f"Best checkpoint has been saved at {os.path.abspath(best_path)}")
        self.stopped_epoch += 1


class ReduceLROnPlateau(Callback):
    """Multiply the learning rate by ``factor`` (down to ``min_lr``) when the evaluation's
    ``monitor`` has not improved by more than ``min_delta`` for ``patience`` evaluations,
    then wait ``cooldown`` evaluations before counting again. The optimizer's learning rate
    must be a number (an ``LRScheduler`` sets its own: a warning, and nothing changes)."""

    def __init__(self, monitor="loss", factor=0.1, patience=10, verbose=1, mode="auto",
                 min_delta=1e-4, cooldown=0, min_lr=0):
        super().__init__()
        if factor >= 1.0:
            raise ValueError(f"ReduceLROnPlateau factor={factor}: it must be below 1.0")
        self.monitor = monitor
        self.factor = factor
        self.min_lr = min_lr
        self.min_delta = min_delta
        self.patience = patience
        self.verbose = verbose
        self.cooldown = cooldown
        self.greater = _greater_is_better(mode, monitor, "ReduceLROnPlateau")
        self.epoch = 0
        self._reset()

    def _reset(self):
        self.best = -np.inf if self.greater else np.inf
        self.cooldown_counter = 0
        self.wait = 0

    def on_train_begin(self, logs=None):
        self._reset()

    def _improved(self, current):
        if self.greater:
            return current > self.best + self.min_delta
        return current < self.best - self.min_delta

    def on_eval_end(self, logs=None):
        current = _monitored(logs, self.monitor, "ReduceLROnPlateau")
        if current is None:
            return
        optimizer = _optimizer(self.model)
        if optimizer is None or _schedule(self.model) is not None:
            warnings.warn("ReduceLROnPlateau changes a learning rate that is a number; this "
                          "optimizer's is an LRScheduler (or there is no optimizer)")
            return
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.wait = 0
        if self._improved(current):
            self.best = current
            self.wait = 0
        elif self.cooldown_counter <= 0:
            self.wait += 1
            if self.wait >= self.patience:
                self._reduce(optimizer)
        self.epoch += 1

    def _reduce(self, optimizer):
        old = optimizer.get_lr()
        if old > np.float32(self.min_lr):
            new = max(old * self.factor, self.min_lr)
            optimizer.set_lr(new)
            if self.verbose > 0 and is_first_rank():
                print(f"\nEpoch {self.epoch + 1}: ReduceLROnPlateau reducing learning rate "
                      f"to {new}.")
            self.cooldown_counter = self.cooldown
            self.wait = 0

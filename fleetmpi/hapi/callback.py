"""Paddle's ``paddle.callbacks.Callback`` and the list ``Model`` calls them through.

``Model.fit``, ``evaluate`` and ``predict`` call each callback's hooks in Paddle's order:
``on_train_begin``, then per epoch ``on_epoch_begin``, ``on_train_batch_begin`` /
``on_train_batch_end`` per step, ``on_epoch_end`` and (every ``eval_freq`` epochs) the
evaluation's ``on_eval_begin``, ``on_eval_batch_*``, ``on_eval_end``; last
``on_train_end``. ``logs`` hold ``"loss"`` (a list, one value per loss), each metric's value
under its name, ``"step"`` and ``"batch_size"`` (the samples of the step over every rank);
``on_eval_begin``'s hold ``"steps"`` and ``"metrics"`` (the names logged).
"""
MODES = ("train", "eval", "predict")


class Callback:
    """The base of the callbacks: every hook does nothing. ``model`` is the ``Model`` and
    ``params`` the run's ``batch_size``, ``epochs``, ``steps`` (per epoch, None when the data
    has no length), ``verbose`` and ``metrics`` (the names logged: ``"loss"`` and each
    metric's)."""

    def __init__(self):
        self.model = None
        self.params = {}

    def set_params(self, params):
        self.params = params

    def set_model(self, model):
        self.model = model

    def on_train_begin(self, logs=None):
        """Training starts."""

    def on_train_end(self, logs=None):
        """Training ends; ``logs``: the last step's."""

    def on_eval_begin(self, logs=None):
        """An evaluation starts; ``logs``: ``steps`` and ``metrics``."""

    def on_eval_end(self, logs=None):
        """An evaluation ends; ``logs``: its loss (of the last batch) and metrics (over all
        of it)."""

    def on_predict_begin(self, logs=None):
        """A prediction starts."""

    def on_predict_end(self, logs=None):
        """A prediction ends."""

    def on_epoch_begin(self, epoch, logs=None):
        """Epoch ``epoch`` (from 0) starts."""

    def on_epoch_end(self, epoch, logs=None):
        """Epoch ``epoch`` ends; ``logs``: its last step's."""

    def on_train_batch_begin(self, step, logs=None):
        """Training step ``step`` of the epoch starts."""

    def on_train_batch_end(self, step, logs=None):
        """Training step ``step`` ends; ``logs``: its loss, and the metrics so far."""

    def on_eval_batch_begin(self, step, logs=None):
        """Evaluation step ``step`` starts."""

    def on_eval_batch_end(self, step, logs=None):
        """Evaluation step ``step`` ends."""

    def on_predict_batch_begin(self, step, logs=None):
        """Prediction step ``step`` starts."""

    def on_predict_batch_end(self, step, logs=None):
        """Prediction step ``step`` ends."""


def _check_mode(mode):
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}; allowed: {', '.join(MODES)}")
    return mode


class CallbackList:
    """``callbacks`` called in order, by mode (``on_begin("eval", logs)`` calls each one's
    ``on_eval_begin``)."""

    def __init__(self, callbacks):
        self.callbacks = list(callbacks)

    def __iter__(self):
        return iter(self.callbacks)

    def set_params(self, params):
        for callback in self.callbacks:
            callback.set_params(params)

    def set_model(self, model):
        for callback in self.callbacks:
            callback.set_model(model)

    def _call(self, name, *args):
        for callback in self.callbacks:
            getattr(callback, name)(*args)

    def on_begin(self, mode, logs=None):
        self._call(f"on_{_check_mode(mode)}_begin", logs)

    def on_end(self, mode, logs=None):
        self._call(f"on_{_check_mode(mode)}_end", logs)

    def on_epoch_begin(self, epoch, logs=None):
        self._call("on_epoch_begin", epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self._call("on_epoch_end", epoch, logs)

    def on_batch_begin(self, mode, step, logs=None):
        self._call(f"on_{_check_mode(mode)}_batch_begin", step, logs)

    def on_batch_end(self, mode, step, logs=None):
        self._call(f"on_{_check_mode(mode)}_batch_end", step, logs)


def is_first_rank():
    """Whether this process is rank 0 (or alone), the one that prints and writes."""
    from ..core import job

    return not job.joined() or job.worker_index() == 0

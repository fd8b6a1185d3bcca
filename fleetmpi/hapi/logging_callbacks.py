"""Paddle's callbacks that report: ``ProgBarLogger`` (added by ``Model.fit``, ``evaluate``
and ``predict`` unless ``verbose=0``) and ``VisualDL`` (scalars through ``fleetmpi.LogWriter``).

``ProgBarLogger`` reports on rank 0 only, through ``fleetmpi.training.progress.ProgressBar``:
where the output reaches a terminal (``mpiexec`` and ``fleetmpirun`` in one too) a bar,
drawn by tqdm where it is installed, with the latest loss and the metrics so far; elsewhere
(a log file, CI) Paddle's plain lines on standard output, ``Epoch 1/5`` and ``step 10/50 -
loss: 0.6931 - acc: 0.5000 - 2ms/step`` every ``log_freq`` steps and at the end of each
epoch, evaluation and prediction. ``FLEETMPI_PROGRESS`` (``bar``, ``lines``, ``off``) overrides
the choice either way. Every rank logs the same numbers (``ranks.py``), so rank 0's are the
job's.
"""
import numbers
import sys
import time

from ..core.knobs import PROGRESS
from ..training.log_writer import LogWriter
from ..training.progress import ProgressBar
from .callback import Callback, is_first_rank


def _numbers(value):
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _shown(logs, names):
    """``{name: number}`` of ``names`` in ``logs`` (a list's items as ``name_0``, ...)."""
    shown = {}
    for name in names:
        values = _numbers(logs.get(name, []))
        for index, value in enumerate(values):
            if isinstance(value, numbers.Number) or hasattr(value, "__float__"):
                shown[name if len(values) == 1 else f"{name}_{index}"] = float(value)
    return shown


def _line(head, logs, names, seconds_per_step=None):
    parts = [head] + [f"{name}: {value:.4f}" for name, value in _shown(logs, names).items()]
    if seconds_per_step is not None:
        parts.append(f"{seconds_per_step * 1000:.0f}ms/step")
    return " - ".join(parts)


def _bar(total, epochs=None):
    """A ProgressBar over ``total`` steps; lines only where the steps are unknown."""
    if total:
        return ProgressBar(total, epochs=epochs)
    return ProgressBar(1, mode="off" if PROGRESS.value() == "off" else "lines")


class _Pass:
    """The steps of one run (training epoch, evaluation, prediction): count, samples, time."""

    def __init__(self, steps, names):
        self.steps, self.names = steps, names
        self.step = self.samples = 0
        self.start = time.perf_counter()

    def done(self, logs):
        self.step += 1
        self.samples += logs.get("batch_size", 1)

    def seconds_per_step(self):
        return (time.perf_counter() - self.start) / max(self.step, 1)


class ProgBarLogger(Callback):
    """Progress and results of training, evaluation and prediction (module docstring).
    ``log_freq``: the steps between two lines; ``verbose``: 0 silent, otherwise the bar or
    the lines as the output calls for (from 2 on, the lines show the time per step)."""

    def __init__(self, log_freq=1, verbose=2):
        super().__init__()
        self.log_freq = log_freq
        self.verbose = verbose
        self.bar = self.alone = self.run = None
        self.epochs = None

    def _write(self, line):
        bar = self.alone or self.bar
        if bar is not None:
            bar.write(line, file=sys.stdout)

    def _lines(self, bar):
        return bar is not None and bar.enabled and not bar.terminal

    def _step_line(self, logs):
        run = self.run
        if run.step % self.log_freq == 0 and (run.steps is None or run.step < run.steps):
            head = f"step {run.step}/{run.steps or '?'}"
            self._write(_line(head, logs, run.names,
                              run.seconds_per_step() if self.verbose >= 2 else None))

    # -- training ---------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        if not self.verbose:
            return
        self.epochs, steps = self.params.get("epochs"), self.params.get("steps")
        self.bar = _bar(self.epochs * steps if steps else None, self.epochs)
        if self._lines(self.bar):
            self._write("The loss value printed in the log is the current batch, and the "
                        "metric is the average value of previous step.")

    def on_epoch_begin(self, epoch, logs=None):
        if self.bar is None:
            return
        self.run = _Pass(self.params.get("steps"), self.params.get("metrics", []))
        if self._lines(self.bar):
            self._write(f"Epoch {epoch + 1}/{self.epochs}")

    def on_train_batch_end(self, step, logs=None):
        if self.bar is None:
            return
        logs = logs or {}
        self.run.done(logs)
        shown = _shown(logs, self.run.names)
        loss = shown.pop("loss", None)
        self.bar.step(samples=logs.get("batch_size", 1), loss=loss, metrics=shown)
        if self._lines(self.bar):
            self._step_line(logs)

    def on_epoch_end(self, epoch, logs=None):
        if self.bar is None:
            return
        summary = None
        if self._lines(self.bar):
            summary = _line(f"step {self.run.step}/{self.run.steps or self.run.step}",
                            logs or {}, self.run.names,
                            self.run.seconds_per_step() if self.verbose >= 2 else None)
        self.bar.end_epoch(summary=summary, file=sys.stdout)

    def on_train_end(self, logs=None):
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    # -- evaluation and prediction ----------------------------------------------------------
    def _begin(self, logs, names, title):
        if not self.verbose:
            return
        steps = (logs or {}).get("steps")
        self.run = _Pass(steps, names)
        if self.bar is None:
            self.alone = _bar(steps)
        if self._lines(self.alone or self.bar):
            self._write(title)

    def _batch_end(self, logs):
        if self.run is None or not self.verbose:
            return
        logs = logs or {}
        self.run.done(logs)
        if self.alone is not None:
            shown = _shown(logs, self.run.names)
            self.alone.step(samples=logs.get("batch_size", 1), loss=shown.pop("loss", None),
                            metrics=shown)
        if self._lines(self.alone or self.bar):
            self._step_line(logs)

    def _end(self, logs, title):
        if self.run is None or not self.verbose:
            return
        self._write(_line(f"{title} step {self.run.step}/{self.run.steps or self.run.step}",
                          logs or {}, self.run.names))
        self._write(f"{title} samples: {self.run.samples}")
        if self.alone is not None:
            self.alone.close()
            self.alone = None
        self.run = None

    def on_eval_begin(self, logs=None):
        self._begin(logs, (logs or {}).get("metrics", []), "Eval begin...")

    def on_eval_batch_end(self, step, logs=None):
        self._batch_end(logs)

    def on_eval_end(self, logs=None):
        self._end(logs, "Eval")

    def on_predict_begin(self, logs=None):
        self._begin(logs, [], "Predict begin...")

    def on_predict_batch_end(self, step, logs=None):
        self._batch_end(logs)

    def on_predict_end(self, logs=None):
        self._end(logs, "Predict")


class VisualDL(Callback):
    """Paddle's ``VisualDL(log_dir)``: the training logs of every step as ``train/<name>``
    at the step's count, and each evaluation's as ``eval/<name>`` at its epoch, written to
    ``log_dir`` by ``fleetmpi.LogWriter`` on rank 0 (a CSV, and TensorBoard's event file
    where tensorboardX is installed)."""

    def __init__(self, log_dir):
        super().__init__()
        self.log_dir = log_dir
        self.writer = None
        self.epoch = self.train_step = 0
        self.eval_names = []
        self.fitting = False

    def _add(self, logs, mode, step):
        if not is_first_rank():
            return
        if self.writer is None:
            self.writer = LogWriter(self.log_dir)
        names = self.params.get("metrics", []) if mode == "train" else self.eval_names
        for name, value in _shown(logs or {}, names).items():
            self.writer.add_scalar(f"{mode}/{name}", value, step)

    def _close(self):
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def on_train_begin(self, logs=None):
        self.fitting = True
        self.train_step = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, step, logs=None):
        self.train_step += 1
        self._add(logs, "train", self.train_step)

    def on_eval_begin(self, logs=None):
        self.eval_names = (logs or {}).get("metrics", [])

    def on_eval_end(self, logs=None):
        self._add(logs, "eval", self.epoch)
        if not self.fitting:
            self._close()

    def on_train_end(self, logs=None):
        self.fitting = False
        self._close()

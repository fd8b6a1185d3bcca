"""``fleetmpi.LogWriter``: scalars to plot (VisualDL's ``LogWriter`` names), written by rank 0:

    writer = fleet.LogWriter("runs/mlp")
    writer.add_scalar("train/loss", loss, step)     # a number, or a one-element Tensor
    writer.close()

Two files: ``scalars.csv`` (``tag,step,value,wall_time``, always) and a TensorBoard event
file, which TensorBoard reads (``tensorboard --logdir runs``), written through tensorboardX
when it is installed (the ``logging`` extra; without it the first LogWriter says once where
the CSV goes and why there is no event file). Other ranks write nothing, and their calls read
no value (no device synchronisation). The CSV is created without following a symbolic link
planted at its name.
"""
import csv
import os
import time

from ..core import files
from ..core.extras import MissingExtra
from ..autograd.tensor import Tensor

CSV_NAME = "scalars.csv"


def _first_rank():
    from ..core import job

    return not job.joined() or job.topology().rank == 0


def _number(value, tag):
    if isinstance(value, Tensor):
        value = value.item()
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"add_scalar({tag!r}) takes a number or a one-element tensor, not "
                        f"{type(value).__name__}") from None


class LogWriter:
    """Scalars of a run under ``logdir`` (created when missing), on rank 0 (module
    docstring). ``tensorboard``: write the event file too (None: where tensorboardX is
    installed; True: it must be)."""

    def __init__(self, logdir, tensorboard=None):
        self.logdir = os.fspath(logdir)
        self.active = _first_rank()
        self._csv_file = self._csv = self._events = None
        if not self.active:
            return
        os.makedirs(self.logdir, exist_ok=True)
        self._events = _event_writer(self.logdir, tensorboard)
        self._csv_file = files.open_for_writing(os.path.join(self.logdir, CSV_NAME))
        self._csv = csv.writer(self._csv_file)
        self._csv.writerow(["tag", "step", "value", "wall_time"])

    def add_scalar(self, tag, value, step, walltime=None):
        """Record ``value`` of ``tag`` at ``step`` (an integer)."""
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"tag must be a non-empty string, not {tag!r}")
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"step must be an integer, not {step!r}")
        if not self.active:
            return
        if self._csv is None:
            raise ValueError(f"this LogWriter of {self.logdir} is closed")
        value = _number(value, tag)
        walltime = time.time() if walltime is None else float(walltime)
        self._csv.writerow([tag, step, repr(value), f"{walltime:.6f}"])
        if self._events is not None:
            self._events.add_scalar(tag, value, step, walltime=walltime)

    def flush(self):
        if self._csv_file is not None:
            self._csv_file.flush()
        if self._events is not None:
            self._events.flush()

    def close(self):
        if self._csv_file is not None:
            self._csv_file.close()
        if self._events is not None:
            self._events.close()
        self._csv_file = self._csv = self._events = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _event_writer(logdir, tensorboard):
    if tensorboard is False:
        return None
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        if tensorboard:
            raise MissingExtra("LogWriter(tensorboard=True)", "tensorboardX",
                               "logging") from None
        _say_csv_only(logdir)
        return None
    return SummaryWriter(logdir=logdir)


_said_csv_only = False


def _say_csv_only(logdir):
    """Once per process: where the scalars go, and why there is no TensorBoard file."""
    global _said_csv_only
    if _said_csv_only:
        return
    _said_csv_only = True
    from ..core.log import logger

    logger.warning("LogWriter writes %s only: TensorBoard's event file needs tensorboardX, "
                   "pip install 'fleetmpi[logging]' (LogWriter(..., tensorboard=False) says "
                   "nothing)", os.path.join(logdir, CSV_NAME))

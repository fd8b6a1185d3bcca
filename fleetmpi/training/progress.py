"""Rank 0's training progress: a bar on a terminal, one plain line per epoch elsewhere.

    bar = ProgressBar(total_steps=epochs * len(sampler), epochs=epochs)
    for epoch in range(epochs):
        for x, y in train.batches(sampler):
            loss = opt.minimize(model, loss_fn, x, y)
            bar.step(samples=len(x) * fleet.worker_num(), loss=loss)
        bar.end_epoch(loss=mean_loss)
    bar.close()

It writes to standard error, as tqdm does (to standard output where both reach a terminal: an
MPI launcher forwards the two through separate pipes, and a bar on standard error could then
land after the results printed below it). When it reaches a terminal (the stream is one, or
``mpiexec`` or ``fleetmpirun`` running in one forwards it there: ``fleetmpi.core.terminal``)
the bar is redrawn in place, at most every ``min_interval`` seconds, showing the loss of the
latest step, the samples per second since the start and the estimated time left. tqdm draws it
when it is installed (``pip install 'fleetmpi[progress]'``, which the examples' extra includes:
the bar users know, fitted to the terminal's width); otherwise a plain bar of ``#`` written
with ``\\r``. Either way the figures and the redraw rate are this class's, so the loss is read
only when a redraw shows it. When the output goes to a file or another program (a log of
``fleetmpirun --log_dir``, a Slurm output file, CI) carriage returns would pile up into one
huge line, so the bar stays off and ``end_epoch`` writes one line per epoch instead. Ranks
other than 0 write nothing. The loss is read (``float``, a device synchronisation on a GPU)
only when it is shown.

``mode`` / ``FLEETMPI_PROGRESS``: ``auto`` (the default: the bar where the output reaches a
terminal, lines elsewhere), ``bar``, ``lines`` or ``off``, which override it either way.
"""
import importlib.util
import math
import shutil
import sys
import time

from ..core.knobs import PROGRESS
from ..core.terminal import stream_reaches_terminal


def format_duration(seconds):
    """``h:mm:ss`` (``m:ss`` under an hour) of a non-negative number of seconds, rounded up
    (time left shows 0:00 only when none is)."""
    seconds = math.ceil(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _default_stream(enabled):
    """Standard error, or standard output where both reach a terminal (module docstring)."""
    if enabled and stream_reaches_terminal(sys.stdout) and stream_reaches_terminal(sys.stderr):
        return sys.stdout
    return sys.stderr


def _this_rank():
    from ..core import job

    return job.topology().rank if job.joined() else 0


class ProgressBar:
    """Progress of ``total_steps`` training steps (``epochs`` of them when the run has epochs).

    ``stream``: where to write (default ``sys.stderr``, or ``sys.stdout`` where both reach a
    terminal); ``rank``: this process's rank (default the fleet world's, 0 before
    ``fleet.init``); ``mode``: see the module docstring (default
    ``FLEETMPI_PROGRESS``, else ``auto``); ``clock``: a seconds counter (tests pass a fake one);
    ``use_tqdm``: draw the terminal bar with tqdm (default: when it is installed; ``True``
    without it raises ImportError naming the extra).
    """

    def __init__(self, total_steps, epochs=None, stream=None, rank=None, mode=None, width=30,
                 min_interval=0.1, clock=time.perf_counter, use_tqdm=None):
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"total_steps={total_steps!r} must be a positive integer")
        if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int)
                                   or epochs < 1):
            raise ValueError(f"epochs={epochs!r} must be a positive integer or None")
        self.total_steps = total_steps
        self.epochs = epochs
        mode = PROGRESS.value() if mode is None else PROGRESS.parse("mode", mode)
        self.enabled = mode != "off" and (_this_rank() if rank is None else rank) == 0
        self.stream = stream if stream is not None else _default_stream(self.enabled)
        if mode == "auto" and self.enabled:
            mode = "bar" if stream_reaches_terminal(self.stream) else "lines"
        self.terminal = self.enabled and mode == "bar"
        self.width = width
        self.min_interval = min_interval
        self.clock = clock
        self.start = clock()
        self.steps = 0
        self.samples = 0
        self.epoch = 0
        self.loss = None
        self.metrics = {}
        self.last_draw = None
        self.drawn_width = 0
        if use_tqdm is None:
            use_tqdm = importlib.util.find_spec("tqdm") is not None
        elif use_tqdm and importlib.util.find_spec("tqdm") is None:
            raise ImportError("ProgressBar(use_tqdm=True) needs tqdm: "
                              "pip install 'fleetmpi[progress]' (or tqdm)")
        self.use_tqdm = use_tqdm
        self.tqdm = None

    def rate(self):
        """Samples per second since the start (0 before any time has passed)."""
        elapsed = self.clock() - self.start
        return self.samples / elapsed if elapsed > 0 else 0.0

    def eta(self):
        """Seconds left at the average step time so far (None before the first step)."""
        if self.steps == 0:
            return None
        per_step = (self.clock() - self.start) / self.steps
        return per_step * max(self.total_steps - self.steps, 0)

    def _figures(self, loss):
        parts = []
        if loss is not None:
            parts.append(f"loss {float(loss):.4f}")
        parts.extend(f"{name} {float(value):.4f}" for name, value in self.metrics.items())
        parts.append(f"{self.rate():,.0f} samples/s")
        eta = self.eta()
        parts.append("ETA " + ("?" if eta is None else format_duration(eta)))
        return " ".join(parts)

    def step(self, samples, loss=None, steps=1, metrics=None):
        """``steps`` more steps done over ``samples`` samples (all ranks together); ``loss``
        is the latest step's (anything ``float`` accepts); ``metrics``, ``{name: number}``,
        are shown after it."""
        if not self.enabled:
            return
        self.steps += steps
        self.samples += samples
        if loss is not None:
            self.loss = loss
        if metrics is not None:
            self.metrics = dict(metrics)
        if self.terminal:
            now = self.clock()
            if (self.last_draw is None or now - self.last_draw >= self.min_interval
                    or self.steps >= self.total_steps):
                self._draw()
                self.last_draw = now

    def _head(self):
        return "" if self.epochs is None else f"epoch {min(self.epoch + 1, self.epochs)}/" \
                                              f"{self.epochs} "

    def _draw(self):
        if self.use_tqdm:
            self._draw_tqdm()
            return
        filled = min(self.width, self.width * self.steps // self.total_steps)
        bar = "#" * filled + "-" * (self.width - filled)
        text = (f"{self._head()}[{bar}] {self.steps}/{self.total_steps} "
                f"{self._figures(self.loss)}")
        padding = " " * max(self.drawn_width - len(text), 0)
        self.stream.write("\r" + text + padding)
        self.stream.flush()
        self.drawn_width = len(text)

    def _draw_tqdm(self):
        """One frame through tqdm: its bar, this class's counts and figures. The tqdm object is
        made at the first frame, with that frame's figures (made earlier it would draw an empty
        bar at once)."""
        if self.tqdm is None:
            from tqdm import tqdm

            # Through a launcher's pipe tqdm cannot ask the terminal its width, and the bar
            # keeps to ASCII: mpiexec.gforker (fleetmpirun's single-host launcher) stops
            # forwarding a rank's output at its first non-ASCII byte.
            tty = getattr(self.stream, "isatty", lambda: False)()
            self.tqdm = tqdm(total=self.total_steps, initial=self.steps, desc=self._head(),
                             postfix=self._figures(self.loss), file=self.stream, mininterval=0,
                             dynamic_ncols=tty, disable=False, leave=True,
                             ascii=None if tty else True,
                             ncols=None if tty else shutil.get_terminal_size().columns,
                             bar_format="{desc}{percentage:3.0f}%|{bar}| "
                                        "{n_fmt}/{total_fmt}{postfix}")
            return
        self.tqdm.n = self.steps
        self.tqdm.set_description_str(self._head(), refresh=False)
        self.tqdm.set_postfix_str(self._figures(self.loss), refresh=False)
        self.tqdm.refresh()

    def end_epoch(self, loss=None, summary=None, file=None):
        """An epoch is over; off a terminal, write its line (``loss``: the epoch's, else the
        latest step's). ``summary``: the caller's own line for the epoch instead, written in
        either mode (below the bar on a terminal), to ``file`` (default: the bar's stream)."""
        if not self.enabled:
            return
        self.epoch += 1
        if summary is not None:
            self.write(summary, file)
            return
        if self.terminal:
            return
        shown = self.loss if loss is None else loss
        of = "" if self.epochs is None else f"/{self.epochs}"
        self.stream.write(f"epoch {self.epoch}{of} {self._figures(shown)}\n")
        self.stream.flush()

    def write(self, line, file=None):
        """Write ``line`` below the bar, to ``file`` (default: the bar's stream; the results of
        a run, to standard output, say) (the bar is redrawn by the next step)."""
        if not self.enabled:
            return
        file = self.stream if file is None else file
        if self.tqdm is not None:
            self.tqdm.write(line, file=file)
            return
        if self.terminal and self.drawn_width:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn_width = 0
        file.write(line + "\n")
        file.flush()

    def close(self):
        """End the bar's line on a terminal."""
        if self.tqdm is not None:
            self.tqdm.close()
            self.tqdm = None
            self.drawn_width = 0
            return
        if self.enabled and self.terminal and self.drawn_width:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn_width = 0

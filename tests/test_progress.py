"""Rank 0's progress bar on a terminal, plain lines elsewhere, nothing on other ranks; log
lines that name their rank and node."""
import io
import logging
import os
import select
import subprocess
import sys

import pytest

import fleetmpi as fleet
from fleetmpi.core import knobs, log
from fleetmpi.training.progress import ProgressBar, format_duration

from comm_support import ok
from job_limits import HANG_SECONDS


class Terminal(io.StringIO):
    def isatty(self):
        return True


class Clock:
    """A clock that moves only when told to."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class Loss:
    """A loss that counts how often it is read."""

    def __init__(self, value):
        self.value = value
        self.reads = 0

    def __float__(self):
        self.reads += 1
        return self.value


@pytest.fixture(autouse=True)
def no_mode_from_environment(monkeypatch):
    monkeypatch.delenv(knobs.PROGRESS.name, raising=False)


def run_epochs(stream, rank=0, mode=None, epochs=2, steps_per_epoch=5, min_interval=0.0):
    """Two epochs of 5 steps of 32 samples, 0.5 s each, on ``rank`` (None: the world's);
    returns the bar."""
    clock = Clock()
    bar = ProgressBar(epochs * steps_per_epoch, epochs=epochs, stream=stream, rank=rank,
                      mode=mode, min_interval=min_interval, clock=clock)
    for epoch in range(epochs):
        for step in range(steps_per_epoch):
            clock.now += 0.5
            bar.step(32, loss=1.0 / (1 + epoch * steps_per_epoch + step))
        bar.end_epoch(loss=0.25 * (epoch + 1))
    bar.close()
    return bar


def test_bar_on_a_terminal_shows_loss_rate_and_eta():
    stream = Terminal()
    clock = Clock()
    bar = ProgressBar(10, epochs=2, stream=stream, rank=0, min_interval=0.0, clock=clock,
                      use_tqdm=False)
    for _ in range(4):
        clock.now += 0.5
        bar.step(32, loss=0.5)
    text = stream.getvalue()
    assert text.count("\r") == 4 and "\n" not in text
    # 4 of 10 steps: 12 of 30 marks; 128 samples in 2 s; 6 steps left at 0.5 s each
    assert text.rsplit("\r", 1)[1] == \
        "epoch 1/2 [############------------------] 4/10 loss 0.5000 64 samples/s ETA 0:03"
    bar.end_epoch(loss=9.0)
    assert stream.getvalue() == text, "a terminal gets no epoch line"
    bar.close()
    assert stream.getvalue() == text + "\n"


@pytest.mark.parametrize("use_tqdm", [False, True], ids=["plain", "tqdm"])
def test_bar_redraws_at_most_every_min_interval_and_reads_the_loss_only_then(use_tqdm):
    stream = Terminal()
    clock = Clock()
    bar = ProgressBar(100, stream=stream, rank=0, min_interval=1.0, clock=clock,
                      use_tqdm=use_tqdm)
    losses = [Loss(float(i)) for i in range(100)]
    for loss in losses:
        clock.now += 0.25
        bar.step(8, loss=loss)
    draws = stream.getvalue().count("\r")
    # the first step, then every fourth (1 s apart), and the last one
    assert draws == 1 + 24 + 1
    assert sum(loss.reads for loss in losses) == draws
    assert stream.getvalue().endswith("100/100" + ("," if use_tqdm else "")
                                      + " loss 99.0000 32 samples/s ETA 0:00")


def test_shorter_redraw_clears_the_rest_of_the_line():
    stream = Terminal()
    clock = Clock()
    bar = ProgressBar(2, stream=stream, rank=0, min_interval=0.0, clock=clock, use_tqdm=False)
    clock.now += 0.001
    bar.step(10_000_000, loss=123456.0)
    first = stream.getvalue()[1:]
    clock.now += 10.0
    bar.step(1, loss=1.0)
    second = stream.getvalue()[1 + len(first) + 1:]
    assert len(second) == len(first) and second.endswith(" ")


def test_tqdm_draws_the_bar_with_the_same_figures():
    stream = Terminal()
    clock = Clock()
    bar = ProgressBar(10, epochs=2, stream=stream, rank=0, min_interval=0.0, clock=clock,
                      use_tqdm=True)
    for _ in range(4):
        clock.now += 0.5
        bar.step(32, loss=0.5)
    frames = stream.getvalue().split("\r")[1:]
    assert len(frames) == 4 and "\n" not in stream.getvalue()
    assert frames[-1] == "epoch 1/2  40%|####      | 4/10, loss 0.5000 64 samples/s ETA 0:03"
    bar.write("evaluated: accuracy 0.97")
    clock.now += 0.5
    bar.step(32, loss=0.25)
    text = stream.getvalue()
    assert "\revaluated: accuracy 0.97\n" in text, text
    assert text.endswith("5/10, loss 0.2500 64 samples/s ETA 0:03")
    bar.close()
    assert stream.getvalue().endswith("\n")


def test_tqdm_asked_for_but_missing(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tqdm" else find_spec(name, *a))
    with pytest.raises(ImportError, match=r"fleetmpi\[progress\]"):
        ProgressBar(1, use_tqdm=True)
    assert ProgressBar(1).use_tqdm is False


def test_plain_lines_when_not_a_terminal():
    stream = io.StringIO()
    run_epochs(stream)
    assert stream.getvalue() == ("epoch 1/2 loss 0.2500 64 samples/s ETA 0:03\n"
                                 "epoch 2/2 loss 0.5000 64 samples/s ETA 0:00\n")


@pytest.mark.parametrize("stream", [io.StringIO(), Terminal()], ids=["file", "terminal"])
def test_nothing_on_other_ranks(stream):
    run_epochs(stream, rank=1)
    assert stream.getvalue() == ""


def test_modes(monkeypatch):
    off = Terminal()
    run_epochs(off, mode="off")
    assert off.getvalue() == ""
    lines = Terminal()
    run_epochs(lines, mode="lines")
    assert "\r" not in lines.getvalue() and lines.getvalue().count("\n") == 2
    monkeypatch.setenv(knobs.PROGRESS.name, "bar")
    piped = io.StringIO()
    bar = run_epochs(piped)
    # a frame per step; tqdm draws the last frame again as it closes
    assert piped.getvalue().count("\r") == 10 + bar.use_tqdm
    assert piped.getvalue().endswith("\n")
    monkeypatch.setenv(knobs.PROGRESS.name, "fancy")
    with pytest.raises(ValueError,
                       match="FLEETMPI_PROGRESS='fancy' must be auto, bar, lines or off"):
        ProgressBar(1)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, None])
def test_total_steps_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="total_steps"):
        ProgressBar(bad)


def test_format_duration():
    assert [format_duration(s) for s in (0, 0.01, 59.4, 61, 3599, 3600, 86399)] == \
        ["0:00", "0:01", "1:00", "1:01", "59:59", "1:00:00", "23:59:59"]


@pytest.mark.mpi(min_size=2)
def test_only_rank_0_writes_in_a_job():
    fleet.init()
    stream = Terminal()
    run_epochs(stream, rank=None)
    wrote = bool(stream.getvalue())
    ok(wrote == (fleet.worker_index() == 0),
       f"rank {fleet.worker_index()} wrote {stream.getvalue()!r}")


@pytest.fixture
def restored_logger():
    handlers, level = list(log.logger.handlers), log.logger.level
    yield
    log.logger.handlers[:] = handlers
    log.logger.setLevel(level)


def test_log_lines_carry_rank_and_node(capsys, restored_logger, monkeypatch):
    monkeypatch.setenv(knobs.LOG_LEVEL.name, "INFO")
    log.configure(rank=3, size=8, node=1)
    log.logger.info("step %d done", 7)
    assert capsys.readouterr().err == "[fleetmpi rank 3/8 node 1] INFO step 7 done\n"
    assert log.logger.level == logging.INFO


def test_an_epochs_own_summary_replaces_its_line_in_either_mode():
    for stream in (Terminal(), io.StringIO()):
        results = io.StringIO()
        bar = ProgressBar(2, epochs=1, stream=stream, rank=0, use_tqdm=False)
        bar.step(8, loss=0.5)
        bar.step(8, loss=0.5)
        bar.end_epoch(summary="epoch 1/1: validation loss 0.4", file=results)
        bar.close()
        assert results.getvalue() == "epoch 1/1: validation loss 0.4\n"
        assert "samples/s" not in stream.getvalue().split("\n")[-1]


def test_the_bar_goes_to_standard_error_by_default():
    # under pytest neither standard stream reaches a terminal
    assert ProgressBar(3, rank=0).stream is sys.stderr
    assert ProgressBar(3, rank=0).terminal is False


def run_in_terminal(command, env):
    """``(exit status, what the terminal showed)`` of ``command`` run with a pseudo-terminal
    as its standard streams, as in a user's shell."""
    leader, follower = os.openpty()
    process = subprocess.Popen(command, stdin=follower, stdout=follower, stderr=follower,
                               env=env, start_new_session=True)
    os.close(follower)
    shown = b""
    while True:
        ready, _, _ = select.select([leader], [], [], HANG_SECONDS)
        if not ready:  # a hang: end it and fail on what was shown
            process.kill()
            break
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: every writer has gone
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    return process.wait(timeout=60), shown.decode(errors="replace")


def launched(launcher, program):
    """``program`` on 2 ranks, started by ``mpiexec`` or by ``fleetmpirun``."""
    from fleetmpi.launch.mpi_command import local_command

    if launcher == "mpiexec":
        return local_command(2, [sys.executable, *program])
    script = os.path.join(os.path.dirname(sys.executable), "fleetmpirun")
    start = [script] if os.path.exists(script) else [sys.executable, "-m", "fleetmpi.launch"]
    return start + ["--np", "2", *program]


@pytest.mark.parametrize("launcher, progress, in_terminal, bar", [
    ("mpiexec", None, True, True), ("mpiexec", None, False, False),
    ("mpiexec", "lines", True, False), ("mpiexec", "bar", False, True),
    ("fleetmpirun", None, True, True), ("fleetmpirun", None, False, False)])
def test_the_main_job_shows_a_bar_in_a_terminal_and_lines_elsewhere(launcher, progress,
                                                                     in_terminal, bar):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    command = launched(launcher, [os.path.join(root, "examples", "train_digits.py"),
                                  "--epochs", "2"])
    env = {k: v for k, v in os.environ.items() if k != knobs.PROGRESS.name}
    env.update({knobs.PROGRESS.name: progress} if progress else {})
    if in_terminal:
        code, shown = run_in_terminal(command, env)
    else:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=HANG_SECONDS,
                              stdin=subprocess.DEVNULL)
        code, shown = done.returncode, done.stdout + done.stderr
    assert code == 0, shown
    assert ("%|" in shown) == bar, shown  # tqdm's bar
    assert ("epoch 1/2 loss" in shown) != bar, shown  # the plain line of an epoch
    if in_terminal:  # one stream, in the order shown: the result below the bar
        assert "test accuracy" in shown.split("%|")[-1]

"""benchmarks/host_cost.py run for a couple of steps, in a fresh process each (it sets its
thread count and initialises fleet): the table of rounds (wall-clock and CPU time), the
median row and the breakdown of each trainer's step, with PyTorch and without it. Nothing
about the timings is asserted."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "host_cost.py")
SMALL = ["--layers", "2", "--width", "8", "--heads", "2", "--rounds", "2", "--steps", "2",
         "--warmup", "1"]
NUMBER = r"\d+\.\d\d"


def run(prelude=""):
    """The script's output lines, run with ``SMALL`` after ``prelude`` (Python code)."""
    code = (f"import runpy, sys\n{prelude}\nsys.argv = [{SCRIPT!r}] + {SMALL!r}\n"
            f"runpy.run_path({SCRIPT!r}, run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, FLEETMPI_DEVICE="cpu"), timeout=240)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def check_table(lines, trainers):
    """The header, a row per round and the median row, ``trainers`` figures each in
    wall-clock and CPU time (and their ratios for two), then a breakdown line per trainer."""
    assert lines[0].startswith("host cost of a training step: GPT of 2 layers, 8 wide")
    columns = []
    for clock in ("", "CPU "):
        columns += [f"{name} {clock}ms" for name in trainers]
        columns += [f"{clock}ratio"] if len(trainers) == 2 else []
    assert re.fullmatch(r"\s*round\s+" + r"\s+".join(map(re.escape, columns)), lines[1])
    cells = len(columns)
    for line, label in zip(lines[2:5], ("1", "2", "median")):
        assert re.fullmatch(rf"\s*{label}" + rf"\s+{NUMBER}" * cells, line), line
    for line, name in zip(lines[5:], trainers):
        parts = ", ".join(f"{part} {NUMBER}" for part in ("forward", "backward", "step",
                                                           "clear_grad"))
        assert re.fullmatch(rf"{name} step, median CPU ms: {parts}", line), line
    assert len(lines) == 5 + len(trainers)


def test_both_trainers_rounds_median_and_breakdown():
    pytest.importorskip("torch")
    check_table(run(), ["fleetmpi", "PyTorch"])


def test_without_pytorch_says_so_and_prints_ours_alone():
    lines = run("sys.modules['torch'] = None  # import torch fails, as where it is absent")
    assert lines.pop(1) == "PyTorch is not installed: fleetmpi's figures alone"
    check_table(lines, ["fleetmpi"])

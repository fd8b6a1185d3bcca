"""An unhandled exception on one rank ends the whole job, whichever launcher started it."""
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from fleetmpi.core import failure, knobs
from fleetmpi.launch.mpi_command import local_command

from job_limits import HANG_SECONDS

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "failure_jobs.py")
FAILURE_TEXT = "RuntimeError: rank 1 fails on purpose"
# The bound: the job must be over within 30 s of starting.


def run_job(cmd, env_extra=None, **kwargs):
    """Run a job that must end by itself; TimeoutExpired (a hang) fails the test."""
    env = dict(os.environ, FLEETMPI_DEVICE="cpu", **(env_extra or {}))
    env.pop(knobs.ABORT_ON_ERROR.name, None)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_SECONDS,
                          **kwargs)


def fleetmpirun():
    script = os.path.join(os.path.dirname(sys.executable), "fleetmpirun")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "fleetmpi.launch"]


def assert_rank_one_reported(result, text):
    assert result.returncode != 0, text
    assert "[fleetmpi] rank 1/2 on node 0 failed" in text, text
    assert FAILURE_TEXT in text, text
    assert "rank 0 left the allreduce" not in text, text


@pytest.mark.parametrize("mode", ["raise", "raise-thread"])
def test_mpiexec_job_ends_when_rank_1_raises(mode):
    result = run_job(local_command(2, [sys.executable, JOB, mode]))
    text = result.stdout + result.stderr
    assert_rank_one_reported(result, text)
    if mode == "raise-thread":
        assert "failed (in thread loader)" in text, text


def test_fleetmpirun_job_ends_when_rank_1_raises():
    result = run_job(fleetmpirun() + ["--np", "2", JOB, "raise"])
    assert_rank_one_reported(result, result.stdout + result.stderr)


@pytest.mark.parametrize("launcher", ["mpiexec", "fleetmpirun"])
@pytest.mark.parametrize("mode, said", [
    ("nan", "NonFiniteError: non-finite values at step 3: rank 1 (loss and local gradient)"),
    ("damaged-checkpoint", "was loaded on none of the 2 ranks, because not every rank could "
                           "load its part; rank 1:")])
def test_a_nan_or_a_damaged_file_on_rank_1_ends_every_rank_naming_it(tmp_path, launcher, mode,
                                                                      said):
    """The jobs benchmarks/faults.py times: every rank raises the same error, which names
    rank 1, and the job fails."""
    prefix = local_command(2, [sys.executable]) if launcher == "mpiexec" else \
        fleetmpirun() + ["--np", "2"]
    result = run_job(prefix + [JOB, mode], env_extra={"FAILURE_JOB_DIR": str(tmp_path)})
    text = result.stdout + result.stderr
    assert result.returncode != 0, text
    for rank in (0, 1):
        assert f"[fleetmpi] rank {rank}/2 on node 0 failed" in text, text
    assert text.count(said) >= 2, text
    assert "finished" not in text, text


@pytest.mark.parametrize("ranks", [1, 2])
def test_amp_skipping_every_step_ends_every_rank_naming_the_step_and_the_scale(ranks):
    """amp with init_loss_scaling=8 and decr_every_n_nan_or_inf=2 whose last rank's batches all
    hold a NaN: steps 0-5 take the scale down to 1, steps 6 and 7 overflow there, and at
    step 7 every rank raises, naming it; the job fails instead of ending with status 0."""
    result = run_job(local_command(ranks, [sys.executable, JOB, "amp-nan"]))
    text = result.stdout + result.stderr
    assert result.returncode != 0, text
    said = ("NonFiniteError: amp: step 7: the gradients held an inf or NaN on some rank at 8 "
            "consecutive steps, the last 2 at a loss scale of 1, the lowest it goes (the floor "
            "of dynamic loss scaling)")
    for rank in range(ranks):
        assert f"[fleetmpi] rank {rank}/{ranks} on node 0 failed" in text, text
    assert text.count(said) >= ranks, text
    assert "finished" not in text, text


@pytest.mark.parametrize("log_dir", [False, True], ids=["terminal", "log_dir"])
def test_a_rank_leaving_with_status_0_does_not_pass_for_success(tmp_path, log_dir):
    """MPICH's launcher can report success when a rank leaves with status 0 without
    finalizing MPI (it ends the others, sometimes reporting their kill instead);
    fleetmpirun then names the ranks that did not run their script to its end and exits 1.
    Either way the job does not pass for success."""
    logs = ["--log_dir", str(tmp_path / "log")] if log_dir else []
    result = run_job(fleetmpirun() + ["--np", "2"] + logs + [JOB, "exit0"])
    text = result.stdout + result.stderr
    assert result.returncode != 0 and "rank 0 finished" not in text, text
    if result.returncode == 1:      # the MPI launcher said 0; fleetmpirun's check caught it
        assert "reported success, but rank(s) 0, 1 of 2 did not run their script to its " \
               "end" in text, text
    if log_dir:
        assert sorted(os.listdir(tmp_path / "log")) == ["workerlog.0", "workerlog.1"]
    finished = run_job(fleetmpirun() + ["--np", "2"] + logs + [JOB, "place"])
    assert finished.returncode == 0, finished.stdout + finished.stderr


def test_python_m_fleetmpi_launch_job_ends_with_the_traceback_in_the_rank_log(tmp_path):
    result = run_job([sys.executable, "-m", "fleetmpi.launch", "--np", "2",
                      "--log_dir", str(tmp_path), JOB, "raise"])
    log = (tmp_path / "workerlog.1").read_text()
    assert_rank_one_reported(result, log)
    assert "[fleetmpi] rank 1/2" not in (tmp_path / "workerlog.0").read_text()


def test_abort_on_error_knob_is_validated():
    assert failure.abort_on_error_enabled({})
    assert failure.abort_on_error_enabled({knobs.ABORT_ON_ERROR.name: "1"})
    assert not failure.abort_on_error_enabled({knobs.ABORT_ON_ERROR.name: "0"})
    with pytest.raises(ValueError, match="FLEETMPI_ABORT_ON_ERROR='yes' must be 0 or 1"):
        failure.abort_on_error_enabled({knobs.ABORT_ON_ERROR.name: "yes"})


def test_report_names_the_place_and_carries_the_traceback():
    try:
        raise KeyError("missing")
    except KeyError as exc:
        text = failure._report("rank 3/8 on node 1", type(exc), exc, exc.__traceback__,
                               "loader")
    assert text.startswith("[fleetmpi] rank 3/8 on node 1 failed (in thread loader):\n")
    assert "Traceback (most recent call last)" in text
    assert "KeyError: 'missing'" in text


def test_install_leaves_handlers_someone_else_installed(monkeypatch):
    def mine(*args):
        pass

    monkeypatch.setattr(sys, "excepthook", mine)
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
    monkeypatch.delenv(knobs.ABORT_ON_ERROR.name, raising=False)
    assert failure.install(0, 1, 0) == ["threading"]
    assert sys.excepthook is mine
    assert threading.excepthook is not threading.__excepthook__


def test_install_does_nothing_when_switched_off(monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
    monkeypatch.setenv(knobs.ABORT_ON_ERROR.name, "0")
    assert failure.install(0, 1, 0) == []
    assert sys.excepthook is sys.__excepthook__
    assert threading.excepthook is threading.__excepthook__


@pytest.mark.parametrize("mode", ["kill9", "kill9-async"])
def test_a_killed_rank_is_named_with_its_process_id(mode):
    """MPICH's report of a killed process names one PID (not always the killed one's);
    fleetmpirun's report says which rank each process id was. ``kill9-async``: the rank dies
    while an asynchronous allreduce that the others wait on is in flight."""
    result = run_job(fleetmpirun() + ["--np", "3", JOB, mode])
    text = result.stdout + result.stderr
    assert result.returncode != 0, text
    pid = re.search(r"rank 1 pid (\d+)", text).group(1)
    line = re.search(r"fleetmpirun: rank\(s\) that did not run their script to its end: (.*)",
                     text).group(1)
    assert f"1 (pid {pid} on {socket.gethostname()})" in line, text
    assert "finished" not in text, text


SLEEPING_JOB = """
import os, sys, time
import fleetmpi as fleet
fleet.init(is_collective=True)
# Written under another name and renamed, so the test never reads a pid file half written.
partial = os.path.join(sys.argv[1], f"partial.{fleet.worker_index()}")
with open(partial, "w") as f:
    f.write(str(os.getpid()))
os.rename(partial, os.path.join(sys.argv[1], f"pid.{fleet.worker_index()}"))
time.sleep(60)
"""


def running(pid):
    """Whether ``pid`` runs (a zombie waiting for its parent does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_fleetmpirun_ends_every_rank_and_sets_the_status(tmp_path, signum, status):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPING_JOB)
    env = dict(os.environ, FLEETMPI_DEVICE="cpu")
    job = subprocess.Popen(fleetmpirun() + ["--np", "2", str(script), str(tmp_path)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + HANG_SECONDS
        while len(list(tmp_path.glob("pid.*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [int(path.read_text()) for path in tmp_path.glob("pid.*")]
        assert len(pids) == 2, job.stdout.read() if job.poll() is not None else "no pids"
        job.send_signal(signum)
        code = job.wait(timeout=HANG_SECONDS)
        ended = time.monotonic()
        while any(running(pid) for pid in pids) and time.monotonic() - ended < 1.0:
            time.sleep(0.02)
        assert not any(running(pid) for pid in pids), "ranks outlived fleetmpirun by 1 s"
        assert code == status, job.stdout.read()
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)


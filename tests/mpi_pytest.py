"""Run the pytest-mpi tests under ``mpiexec -n N`` and report every rank.

Each rank's pytest output goes to its own log file; afterwards rank 0's log is printed whole,
and any other rank's log is printed whole too if that rank failed or never finished, so a
failure on one rank is never hidden. Failures are written as they happen (pytest-instafail), so
they survive a hung test, which pytest-timeout ends by taking the job down with it; the whole run
is bounded by ``--job-timeout`` seconds as a last resort. ``--junit-dir DIR`` has each rank
write its JUnit XML to ``DIR/rank-<rank>.xml``.

    python tests/mpi_pytest.py -n 4 [--junit-dir DIR] [-- pytest args]
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import pytest

from fleetmpi.launch.mpi_command import local_command

HERE = os.path.dirname(os.path.abspath(__file__))


class NameTheHang:
    """pytest-timeout's thread method (the one that can end a rank blocked in MPI) ends the
    rank with every thread's stack but not the test's name: this writes the name first."""

    def __init__(self, rank, log):
        self.rank, self.log, self.timer = rank, log, None  # the log past pytest's capture

    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_timeout_set_timer(self, item, settings):
        def say():
            self.log.write(f"\n[rank {self.rank}] {item.nodeid} hangs: still running after "
                           f"{settings.timeout:.0f} s, pytest-timeout ends this rank\n")
            self.log.flush()
        self.timer = threading.Timer(max(settings.timeout - 0.5, 0.0), say)
        self.timer.daemon = True
        self.timer.start()  # and pytest-timeout's own timer, after this one

    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_timeout_cancel_timer(self, item):
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


def rank_main(log_dir, pytest_args, junit_dir=None):
    """Inside mpiexec: run pytest on this rank with its output in its own log file."""
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    log_path = os.path.join(log_dir, f"rank-{rank}.log")
    log = open(log_path, "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    if junit_dir:
        pytest_args = pytest_args + [f"--junitxml={os.path.join(junit_dir, f'rank-{rank}.xml')}"]
    code = pytest.main(["--with-mpi", "-m", "mpi", "-q", "-p", "no:cacheprovider",
                        "--instafail", "--timeout=300", "--timeout-method=thread",
                        f"--basetemp={os.path.join(log_dir, f'rank-{rank}-tmp')}", HERE]
                       + pytest_args, plugins=[NameTheHang(rank, log)])
    with open(os.path.join(log_dir, f"rank-{rank}.rc"), "w") as f:
        f.write(str(int(code)))
    return int(code)


def launcher_main(n, job_timeout, pytest_args, junit_dir=None):
    log_dir = tempfile.mkdtemp(prefix=f"fleetmpi-tests-{n}-")
    junit = ["--junit-dir", os.path.abspath(junit_dir)] if junit_dir else []
    cmd = local_command(n) + [sys.executable, os.path.abspath(__file__),
                              "--rank-log-dir", log_dir] + junit + ["--"] + pytest_args
    try:
        launched = subprocess.run(cmd, timeout=job_timeout, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        said, launched = launched.stdout, launched.returncode
    except subprocess.TimeoutExpired as timeout:
        said = timeout.stdout.decode(errors="replace") if timeout.stdout else ""
        print(f"mpiexec -n {n} did not finish within {job_timeout} s")
        launched = 124
    failed = launched != 0
    if failed:
        print(f"{' '.join(cmd)}\nexited {launched}, saying:\n{said.strip() or '(nothing)'}")
    for rank in range(n):
        rc_path = os.path.join(log_dir, f"rank-{rank}.rc")
        rc = open(rc_path).read() if os.path.exists(rc_path) else "never finished"
        log_path = os.path.join(log_dir, f"rank-{rank}.log")
        text = open(log_path).read() if os.path.exists(log_path) else "(no output)\n"
        if rank == 0 or rc != "0" or launched != 0:
            print(f"--- rank {rank} of {n} (pytest exit: {rc}) ---")
            print(text, end="")
        else:
            lines = text.strip().splitlines()
            print(f"--- rank {rank} of {n}: {lines[-1] if lines else 'no output'}")
        failed |= rc != "0"
    shutil.rmtree(log_dir, ignore_errors=True)
    return 1 if failed else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, help="number of ranks to launch")
    parser.add_argument("--job-timeout", type=int, default=1200)
    parser.add_argument("--junit-dir", help="each rank writes its JUnit XML here")
    parser.add_argument("--rank-log-dir", help=argparse.SUPPRESS)
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    if args.rank_log_dir:
        return rank_main(args.rank_log_dir, args.pytest_args, args.junit_dir)
    return launcher_main(args.n, args.job_timeout, args.pytest_args, args.junit_dir)


if __name__ == "__main__":
    sys.exit(main())

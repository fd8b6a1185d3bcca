"""How long a test lets a job it starts run before it calls the job hung.

Only a hang reaches it: a healthy job of these tests takes seconds on a 2-core machine, and a
few times that beside another CPU-bound job, so a verdict never depends on the machine's load.
It stays under the per-test limit of ``tests/run`` and ``tests/mpi_pytest.py`` (pytest-timeout,
300 s), so that the test itself reports the hang, with the job's output, rather than
pytest-timeout's stack dump.
"""
import os
import signal
import subprocess

import pytest

HANG_SECONDS = 240


def run_to_end(argv, **popen):
    """Run ``argv`` (``popen``: more of ``subprocess.Popen``'s arguments) in a session of its own
    to its end; ``(code, stdout, stderr)``. Past ``HANG_SECONDS`` its whole process group is
    killed, so that no rank outlives a failed test, and the test fails with the output."""
    process = subprocess.Popen(argv, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True, **popen)
    try:
        out, err = process.communicate(timeout=HANG_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"{argv} did not end within {HANG_SECONDS} s:\n{out}\n{err}")
    return process.returncode, out, err

"""A rank that hangs before a collective that every rank has made before, once or 999 times,
is named by the waiting ranks' watchdogs: repeated calls skip the argument agreement, so the
report must come from the watchdog, which sees every call (``fleetmpi.comm.watchdog``)."""
import os
import re
import subprocess
import sys

import pytest

from fleetmpi.launch.mpi_command import local_command

from job_limits import HANG_SECONDS

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "stall_jobs.py")
COLLECTIVES = ["allreduce", "allreduce_many", "broadcast", "broadcast_many", "barrier",
               "allgather", "reduce_scatter", "alltoall", "allgatherv", "gather", "scatter",
               "allreduce_async"]


def run_job(n, *args, timeout="1"):
    """``(return code, output)`` of ``stall_jobs.py args`` on ``n`` ranks, with
    ``FLEETMPI_STALL_TIMEOUT=timeout`` (None: unset, the default). The non-finite check is
    off, so that a training step makes one call (its gradient reduction), whose number the
    reports give."""
    env = dict(os.environ, FLEETMPI_DEVICE="cpu", FLEETMPI_STALL_TIMEOUT=timeout or "",
               FLEETMPI_NONFINITE="off")
    if timeout is None:
        del env["FLEETMPI_STALL_TIMEOUT"]
    result = subprocess.run(local_command(n, [sys.executable, JOB, *map(str, args)]), env=env,
                            capture_output=True, text=True, timeout=HANG_SECONDS)
    return result.returncode, result.stdout + result.stderr


def reports(text):
    """{reporting rank: the rest of its stall line}."""
    return {int(m.group(1)): m.group(2)
            for m in re.finditer(r"\[fleetmpi\] stall: rank (\d+)/\d+ (.*)", text)}


def waited(line):
    """The seconds a stall report says its rank waited."""
    return float(re.search(r"has waited ([\d.]+) s", line).group(1))


def check_hang_reported(code, text, waiting, collective, call):
    """Every rank of ``waiting`` (and no other) reports that rank 1 has not arrived at call
    number ``call`` of ``collective``, naming rank 1's last call, once the stall time of 1 s
    had passed; the job failed (by itself: a hang would have run into ``HANG_SECONDS``)."""
    assert code != 0, text
    found = reports(text)
    assert all(waited(line) >= 1.0 for line in found.values()), text
    assert set(found) == set(waiting), text
    for line in found.values():
        assert f"in {collective}, call #{call} of its communicator" in line, text
        assert "rank(s) 1 have not arrived there: rank 1 is in no collective; its last " \
               f"call here #{call - 1} ({collective}" in line, text
        assert "FLEETMPI_STALL_TIMEOUT is exceeded" in line, text
    assert "finished" not in text, text


@pytest.mark.parametrize("calls", [2, 3, 10, 1000])
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_a_rank_that_hangs_after_repeats_is_named(collective, calls):
    """``allreduce_async``: rank 1 starts its operations and never waits on them."""
    code, text = run_job(2, "repeat", collective, calls)
    name = "allreduce" if collective == "allreduce_async" else collective
    check_hang_reported(code, text, [0], name, calls)


@pytest.mark.parametrize("elements", [1000, 1000000])
@pytest.mark.parametrize("algorithm", ["ring", "native", "hierarchical", "shm"])
@pytest.mark.parametrize("collective", ["allreduce", "allreduce_many"])
def test_every_algorithm_and_size_is_watched(collective, algorithm, elements):
    code, text = run_job(2, "repeat", collective, 3, elements, algorithm)
    check_hang_reported(code, text, [0], collective, 3)


@pytest.mark.parametrize("collective", ["allreduce", "broadcast", "allreduce_async"])
def test_every_waiting_rank_of_three_reports(collective):
    code, text = run_job(3, "repeat", collective, 10)
    check_hang_reported(code, text, [0, 2], "allreduce" if collective ==
                        "allreduce_async" else collective, 10)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("idiom", ["minimize", "backward"])
def test_a_rank_that_hangs_before_a_training_step_is_named(idiom, n):
    """Rank 1 hangs before step 5: the others wait in step 5's gradient reduction, call #7 of
    the world's communicator (#1 and #2 are distributed_model's check that every rank built
    the same model and its broadcast of the parameters)."""
    code, text = run_job(n, "train", idiom, 5)
    check_hang_reported(code, text, [r for r in range(n) if r != 1],
                        "allreduce_many", 7)

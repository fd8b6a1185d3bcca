"""A rank that hangs before a collective that every rank has made before, once or 999 times,
is named by the waiting ranks' watchdogs: repeated calls skip the argument agreement, so the
report must come from the watchdog, which sees every call (``fleetmpi.comm.watchdog``)."""
import os
import re
import subprocess
import sys
import tempfile

import pytest

from fleetmpi.launch.mpi_command import local_command

from job_limits import HANG_SECONDS
from job_prefetch import start_the_next_job  # noqa: F401 (an autouse fixture)

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "stall_jobs.py")
COLLECTIVES = ["allreduce", "allreduce_many", "broadcast", "broadcast_many", "barrier",
               "allgather", "reduce_scatter", "alltoall", "allgatherv", "gather", "scatter",
               "allreduce_async"]


class StallJob:
    """``stall_jobs.py words`` on ``ranks`` ranks with ``FLEETMPI_STALL_TIMEOUT=timeout``
    (None: unset, the default), its output in a file; started once, by its test or ahead of it
    (tests/job_prefetch.py). The non-finite check is off, so that a training step makes one
    call (its gradient reduction), whose number the reports give. ``named`` words are also
    attributes (``job.calls``)."""

    def __init__(self, ranks, *words, timeout="1", **named):
        self.ranks, self.timeout = ranks, timeout
        self.words = [str(w) for w in [*words, *named.values()]]
        self.__dict__.update(named)
        self.process = self.output = None

    def __str__(self):
        return "-".join(self.words[1:])

    def start(self):
        if self.process is not None:
            return
        env = dict(os.environ, FLEETMPI_DEVICE="cpu", FLEETMPI_STALL_TIMEOUT=self.timeout or "",
                   FLEETMPI_NONFINITE="off")
        if self.timeout is None:
            del env["FLEETMPI_STALL_TIMEOUT"]
        self.output = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            local_command(self.ranks, [sys.executable, JOB, *self.words]), env=env,
            stdout=self.output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def result(self):
        """``(return code, output)``; a job still running after ``HANG_SECONDS`` hangs."""
        self.start()
        try:
            code = self.process.wait(timeout=HANG_SECONDS)
        finally:
            self.end()
        self.output.seek(0)
        return code, self.output.read()

    def end(self):
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


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


@pytest.mark.parametrize("job", [StallJob(2, "repeat", collective=collective, calls=calls)
                                 for collective in COLLECTIVES for calls in (2, 3, 10, 1000)],
                         ids=str)
def test_a_rank_that_hangs_after_repeats_is_named(job):
    """``allreduce_async``: rank 1 starts its operations and never waits on them."""
    code, text = job.result()
    name = "allreduce" if job.collective == "allreduce_async" else job.collective
    check_hang_reported(code, text, [0], name, job.calls)


@pytest.mark.parametrize("job", [
    StallJob(2, "repeat", collective=collective, calls=3, elements=elements,
             algorithm=algorithm)
    for collective in ("allreduce", "allreduce_many")
    for algorithm in ("ring", "native", "hierarchical", "shm") for elements in (1000, 1000000)],
    ids=str)
def test_every_algorithm_and_size_is_watched(job):
    code, text = job.result()
    check_hang_reported(code, text, [0], job.collective, 3)


@pytest.mark.parametrize("job", [StallJob(3, "repeat", collective=collective, calls=10)
                                 for collective in ("allreduce", "broadcast",
                                                    "allreduce_async")], ids=str)
def test_every_waiting_rank_of_three_reports(job):
    code, text = job.result()
    check_hang_reported(code, text, [0, 2], "allreduce" if job.collective ==
                        "allreduce_async" else job.collective, 10)


@pytest.mark.parametrize("job", [StallJob(n, "train", idiom=idiom, steps=5)
                                 for idiom in ("minimize", "backward") for n in (2, 3)],
                         ids=lambda job: f"{job.idiom}-{job.ranks}")
def test_a_rank_that_hangs_before_a_training_step_is_named(job):
    """Rank 1 hangs before step 5: the others wait in step 5's gradient reduction, call #7 of
    the world's communicator (#1 and #2 are distributed_model's check that every rank built
    the same model and its broadcast of the parameters)."""
    code, text = job.result()
    check_hang_reported(code, text, [r for r in range(job.ranks) if r != 1],
                        "allreduce_many", 7)


@pytest.mark.parametrize("job", [StallJob(2, "diverge", how=how, timeout="3")
                                 for how in ("skip", "shape")], ids=str)
def test_a_repeated_broadcast_that_differs_on_one_rank_is_named(job):
    """Rank 1 skips the second of three repeated broadcasts of rank 0, or passes another shape
    to the third: the root's broadcasts return (they only send), so rank 0 finishes its
    script. Skipped, rank 1 has received the third broadcast in place of the second: both
    ranks name the call counts at the end; another shape, rank 1 names rank 0's third call
    at once, not after the stall time. Either way the job fails; no rank is called silent."""
    code, text = job.result()
    assert code != 0, text
    assert "did not answer" not in text and "every rank answered" not in text, text
    if job.how == "skip":
        for rank, made, other in ((0, 3, "rank 1: 2"), (1, 2, "rank 0: 3")):
            assert f"[fleetmpi] rank {rank}/2 finished its script after {made} call(s) of a " \
                   f"communicator, the last broadcast of float64 (4,), but the other ranks " \
                   f"made other numbers of calls there ({other}): a rank skipped" in text, text
        return
    found = reports(text)
    assert set(found) == {1}, text
    assert waited(found[1]) < 3.0, text
    assert "in broadcast, call #3 of its communicator (broadcast of float64 (5,))" in found[1]
    assert "(this rank's call is at stall_jobs.py:" in found[1], text
    assert "rank 0 made a different call at this number: broadcast of float64 (4,), then " \
           "finished its script" in found[1], text

"""The stall inspector: a collective some rank never reaches is reported, then the job ends."""
import gc
import math
import os
import re
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest

from fleetmpi.core import knobs
from fleetmpi.comm import exit_report, stall, stall_report, watchdog
from fleetmpi.launch.mpi_command import local_command

from comm_support import equal, ok, world
from job_limits import HANG_SECONDS

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "failure_jobs.py")


def stalled_job(n, late, collective, how="sleep", timeout="1", directory=""):
    env = dict(os.environ, FLEETMPI_DEVICE="cpu", FLEETMPI_STALL_TIMEOUT=timeout,
               FAILURE_JOB_DIR=str(directory))
    result = subprocess.run(local_command(n, [sys.executable, JOB, "stall", str(late),
                                              collective, how]),
                            env=env, capture_output=True, text=True, timeout=HANG_SECONDS)
    return result, result.stdout + result.stderr


def ended(text):
    """Whether some rank of a failure job got to the end of its script."""
    return re.search(r"^rank \d+ finished$", text, re.M) is not None


def reports(text):
    """{reporting rank: the rest of its stall line}."""
    return {int(m.group(1)): m.group(2)
            for m in re.finditer(r"\[fleetmpi\] stall: rank (\d+)/\d+ (.*)", text)}


WHERE_RANK_1_IS = {"sleep": "rank 1 is in no collective; its last call here #1 (allreduce of "
                              "float64 (4,))",
                    "skip": "rank 1 finished its script after 1 call(s) of this communicator"}


@pytest.mark.parametrize("how", ["sleep", "skip"])
@pytest.mark.parametrize("collective", ["allreduce", "allreduce_async"])
def test_rank_1_missing_is_named_by_the_waiting_rank(how, collective):
    """``allreduce_async``: rank 1 starts its operations but never waits on them; the other
    rank's background thread waits in the second one, which rank 1 never starts. Rank 1
    sleeps (reported after the stall time) or ends its script (reported at once)."""
    result, text = stalled_job(2, 1, collective, how)
    assert result.returncode != 0, text
    found = reports(text)
    assert set(found) == {0}, text
    assert "in allreduce, call #2 of its communicator" in found[0], text
    assert f"rank(s) 1 have not arrived there: {WHERE_RANK_1_IS[how]}" in found[0], text
    assert not ended(text), text


def test_a_rank_that_alone_changes_a_repeated_call_is_reported():
    """After repeats that skipped the agreement, rank 1 alone makes a new call (its reused
    arrays' dtype set in place): it waits in the agreement while rank 0 repeats its call.
    Both are at call #4 in different calls: each names the other's, and the job ends."""
    env = dict(os.environ, FLEETMPI_DEVICE="cpu", FLEETMPI_STALL_TIMEOUT="1")
    result = subprocess.run(local_command(2, [sys.executable, JOB, "diverge"]), env=env,
                            capture_output=True, text=True, timeout=HANG_SECONDS)
    text = result.stdout + result.stderr
    assert result.returncode != 0, text
    found = reports(text)
    assert set(found) <= {0, 1} and found, text
    other = {0: "rank 1 waits in a different call at this number: allreduce of float32 (16,)",
             1: "rank 0 waits in a different call at this number: allreduce of float64 (8,)"}
    for rank, line in found.items():
        assert "in allreduce, call #4 of its communicator" in line, text
        assert other[rank] in line and "they cannot arrive" in line, text
    assert not ended(text), text


def test_every_waiting_rank_writes_the_report():
    result, text = stalled_job(3, 2, "broadcast")
    assert result.returncode != 0, text
    found = reports(text)
    assert set(found) == {0, 1}, text
    for line in found.values():
        assert "in broadcast, call #2 of its communicator" in line, text
        assert "rank(s) 2 have not arrived there" in line, text


@pytest.mark.parametrize("collective", ["barrier_worker", "checkpoint"])
def test_a_rank_that_never_reaches_barrier_worker_or_a_checkpoint_save_is_named(
        collective, tmp_path):
    result, text = stalled_job(3, 1, collective, "skip", directory=tmp_path)
    assert result.returncode != 0, text
    found = reports(text)
    assert set(found) <= {0, 2} and found, text
    name = {"barrier_worker": "barrier_worker", "checkpoint": "checkpoint.save"}[collective]
    for line in found.values():
        assert f"in {name}, call #" in line, text
        assert "rank(s) 1 have not arrived there: rank 1 finished its script" in line, text
    assert not ended(text), text


def test_a_missing_rank_0_is_named_by_the_others():
    result, text = stalled_job(3, 0, "barrier")
    assert result.returncode != 0, text
    found = reports(text)
    assert set(found) == {1, 2}, text
    for line in found.values():
        assert "in barrier, call #2 of its communicator (barrier); rank(s) 0 have not " \
               "arrived there: rank 0 is in no collective; its last call here #1" in line


@pytest.mark.parametrize("text, seconds", [(None, 600.0), ("", 600.0), ("2.5", 2.5),
                                           ("0", math.inf), ("30", 30.0)])
def test_stall_time_knob(text, seconds):
    environ = {} if text is None else {knobs.STALL_TIMEOUT.name: text}
    assert watchdog.stall_seconds(environ) == seconds


@pytest.mark.parametrize("text", ["abc", "-1", "nan", "inf"])
def test_bad_stall_time_is_named(text):
    with pytest.raises(ValueError, match=f"FLEETMPI_STALL_TIMEOUT='{text}' must be a number"):
        watchdog.stall_seconds({knobs.STALL_TIMEOUT.name: text})


def test_rank_lists_are_written_as_ranges():
    assert stall_report.ranks_text([7, 1, 2, 3]) == "1-3, 7"
    assert stall_report.ranks_text([4]) == "4"
    assert stall_report.ranks_text([0, 2, 4, 5]) == "0, 2, 4-5"


def test_message_names_the_call_the_missing_ranks_and_why():
    mine = {"name": "allreduce_many", "text": "allreduce_many of float32 (10,)"}
    text = stall_report.stall_message(1, 8, mine, 12, 5.0, [3, 4, 6], ["a", "b"], False)
    assert text.startswith("[fleetmpi] stall: rank 1/8 has waited 5.0 s in allreduce_many, "
                           "call #12 of its communicator (allreduce_many of float32 (10,)); "
                           "rank(s) 3-4, 6 have not arrived there: a; b; ")
    assert text.endswith("FLEETMPI_STALL_TIMEOUT is exceeded, aborting the job")
    certain = stall_report.stall_message(1, 8, mine, 12, 5.0, [3], ["a"], True)
    assert certain.endswith("they cannot arrive, aborting the job")


def answer(started, name="allreduce", text="allreduce of float64 (4,)", in_flight=False,
           elsewhere=()):
    return {"started": started, "name": name, "text": text, "in_flight": in_flight,
            "elsewhere": list(elsewhere)}


MINE = {"name": "allreduce", "text": "allreduce of float64 (4,)"}


def test_verdict_waits_for_ranks_that_may_still_come():
    """Arrived ranks are not named; one computing, or silent, is named but may still come."""
    answers = {1: answer(6, in_flight=True), 2: answer(5), 3: None}
    missing, lines, certain = stall_report.verdict(MINE, 6, answers, {}, {}, True)
    assert missing == [2, 3] and not certain
    assert lines[0] == "rank 2 is in no collective; its last call here #5 (allreduce of " \
                       "float64 (4,))"
    assert lines[1].startswith("rank 3 did not answer")


@pytest.mark.parametrize("blocking", [True, False])
def test_verdict_is_certain_when_a_rank_cannot_come(blocking):
    """A rank blocked where this rank has not been, or in another call at this number,
    cannot come while this rank's caller waits here (``blocking``); a finished rank never."""
    elsewhere = [(77, 3, "barrier_worker", True)]
    for answers, finished in [({1: answer(5, elsewhere=elsewhere)}, {}),
                              ({1: answer(6, name="barrier", text="barrier",
                                          in_flight=True)}, {}),
                              ({1: answer(6, text="allreduce of float64 (2,)",
                                          in_flight=True)}, {})]:
        missing, _, certain = stall_report.verdict(MINE, 6, answers, finished, {77: 2},
                                                   blocking)
        assert missing == [1] and certain == blocking
    missing, lines, certain = stall_report.verdict(MINE, 6, {}, {1: 5}, {}, False)
    assert missing == [1] and certain
    assert lines == ["rank 1 finished its script after 5 call(s) of this communicator"]


def test_verdict_needs_proof_that_a_rank_blocked_elsewhere_waits_for_this_one():
    """Blocked in a call this rank has made already, or on a communicator without this
    rank, or in a call whose shapes may differ: it may still come."""
    for elsewhere, counts in [([(77, 3, "barrier_worker", True)], {77: 3}),
                              ([(77, 3, "barrier_worker", False)], {})]:
        _, _, certain = stall_report.verdict(MINE, 6, {1: answer(5, elsewhere=elsewhere)}, {},
                                             counts, True)
        assert not certain
    gather = {"name": "allgather", "text": "allgather of float64 (4,)"}
    _, _, certain = stall_report.verdict(
        gather, 6, {1: answer(6, "allgather", "allgather of float64 (2,)", True)}, {}, {},
        True)
    assert not certain
    missing, _, _ = stall_report.verdict(MINE, 6, {1: answer(7), 2: answer(6)}, {2: 6}, {},
                                         True)
    assert missing == []


def test_verdict_names_a_rank_whose_call_at_this_number_was_another():
    """A repeated call skips the agreement: a root whose broadcast at this number had another
    shape has returned (and may have ended its script), an allgather whose trailing shape or
    dtype differs waits: either way this rank cannot be joined, and is told at once."""
    mine = {"name": "broadcast", "text": "broadcast of float64 (5,)"}
    root = answer(3, "broadcast", "broadcast of float64 (4,)")
    missing, lines, certain = stall_report.verdict(mine, 3, {0: root}, {0: 3}, {}, True)
    assert missing == [0] and certain
    assert lines == ["rank 0 made a different call at this number: broadcast of float64 (4,), "
                     "then finished its script; a repeated call skips the agreement on "
                     "arguments (FLEETMPI_CHECK_COLLECTIVES=always makes every call agree)"]
    gather = {"name": "allgather", "text": "allgather of float64 (4, 3)"}
    for other, different in [("allgather of float64 (2, 3)", False),
                             ("allgather of float32 (4, 3)", True),
                             ("allgather of float64 (4, 2)", True)]:
        waiting = dict(answer(6, "allgather", other, True), site="train.py:9 in main")
        missing, lines, _ = stall_report.verdict(gather, 6, {1: waiting}, {}, {}, True)
        assert missing == ([1] if different else []), other
        if different:
            assert lines == [f"rank 1 waits in a different call at this number: {other} (at "
                             f"train.py:9 in main)"]


def test_different_call_counts_at_the_end_are_named():
    text = exit_report.count_message(1, 2, 2, "broadcast of float64 (4,)", {0: 3})
    assert text.startswith("[fleetmpi] rank 1/2 finished its script after 2 call(s) of a "
                           "communicator, the last broadcast of float64 (4,), but the other "
                           "ranks made other numbers of calls there (rank 0: 3): a rank "
                           "skipped or added a collective")


@pytest.mark.mpi(min_size=2)
def test_polled_exchange_gives_every_rank_every_row_and_counts_calls():
    comm = world()
    control = comm._control
    before = stall.call_state(control).calls
    for call in range(3):
        row = np.array([comm.rank, call, 7 * comm.rank + call], dtype=np.int64)
        rows = stall.gather_rows(control, row, "test")
        expected = np.array([[r, call, 7 * r + call] for r in range(comm.size)])
        equal(rows, expected)
    ok(stall.call_state(control).calls == before + 3)
    counts = control.allgather(stall.call_state(control).calls)
    ok(len(set(counts)) == 1, f"call counters differ across ranks: {counts}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("collective", ["broadcast_many", "allgather", "allreduce"])
def test_a_finished_collective_leaves_its_arrays_to_the_caller(collective):
    """The watch keeps the text of a communicator's last call, not its arrays: an array
    broadcast once is freed when the caller drops it, not kept until the next call."""
    comm = world()
    values = np.arange(1000, dtype=np.float64) + comm.rank
    call = {"broadcast_many": lambda: comm.broadcast_many([values], root=0),
            "allgather": lambda: comm.allgather(values),
            "allreduce": lambda: comm.allreduce(values, op="max")}[collective]
    call()
    alive = weakref.ref(values)
    del values
    gc.collect()
    ok(alive() is None, f"the array of the last {collective} is still referenced")
    text = stall_report.call_text(comm._watch.what)
    ok(text.startswith(f"{collective} of float64 (1000,)"), f"the watch says {text!r}")


@pytest.mark.parametrize("size", list(range(1, 70)) + [128, 1000, 1024, 4096])
def test_the_tree_covers_every_rank_once_with_log_p_children(size):
    limit = max(1, math.ceil(math.log2(size))) if size > 1 else 0
    covered = np.zeros(size, dtype=int)
    for rank in range(size):
        children = stall.tree_children(rank, size)
        ok(len(children) <= limit, f"rank {rank} of {size} has {len(children)} children")
        for child in children:
            ok(stall.tree_parent(child) == rank)
        span = stall.subtree_size(rank, size)
        ok(span == 1 + sum(stall.subtree_size(c, size) for c in children))
        if rank:
            covered[rank] += 1
    ok(stall.subtree_size(0, size) == size and (covered[1:] == 1).all())


class CountingComm:
    """An MPI communicator that counts the point-to-point messages a rank posts."""

    def __init__(self, comm):
        self.comm, self.receives, self.sends = comm, 0, 0

    def Irecv(self, *args, **kwargs):
        self.receives += 1
        return self.comm.Irecv(*args, **kwargs)

    def Issend(self, *args, **kwargs):
        self.sends += 1
        return self.comm.Issend(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.comm, name)


@pytest.mark.mpi(min_size=2)
def test_each_rank_exchanges_log_p_messages():
    """One agreement exchange: a rank receives from its children in the tree (at most
    ceil(log2 P)) and sends once to its parent; rank 0 sends nothing but the broadcast."""
    comm = world()
    counting = CountingComm(comm._control.Dup())
    try:
        row = np.array([comm.rank, 5], dtype=np.int64)
        rows = stall.gather_rows(counting, row, "test")
        equal(rows, np.array([[r, 5] for r in range(comm.size)]))
        ok(counting.receives == len(stall.tree_children(comm.rank, comm.size)))
        ok(counting.receives <= math.ceil(math.log2(comm.size)))
        ok(counting.sends == (0 if comm.rank == 0 else 1))
        counts = comm._control.allgather((counting.receives, counting.sends))
        ok(sum(r for r, _ in counts) == comm.size - 1 == sum(s for _, s in counts))
    finally:
        counting.comm.Free()


def test_the_report_comes_at_the_stall_time_and_the_end_one_linger_later():
    """When the report and the end come, as docs/reliability.md and docs/launch.md state: the
    waiting rank's watchdog reports once the call has been in flight ``FLEETMPI_STALL_TIMEOUT``
    (within a tick of its thread) and aborts ``REPORT_LINGER_SECONDS`` later, answering the
    others meanwhile. Times run from the late rank's ``FAULT`` line; lower bounds are exact,
    upper ones leave room for a busy machine."""
    stall_time, linger = 1.0, stall_report.REPORT_LINGER_SECONDS
    env = dict(os.environ, FLEETMPI_DEVICE="cpu", FLEETMPI_STALL_TIMEOUT=str(stall_time))
    job = subprocess.Popen(local_command(2, [sys.executable, JOB, "stall", "1", "allreduce",
                                             "sleep"]),
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    arrivals = []
    reader = threading.Thread(target=lambda: arrivals.extend(
        (time.time(), line) for line in job.stdout), daemon=True)
    reader.start()
    try:
        job.wait(timeout=HANG_SECONDS)
    finally:
        job.kill()
    ended = time.time()
    reader.join(5)
    text = "".join(line for _, line in arrivals)
    # not anchored to a line: mpiexec may join two ranks' lines into one
    fault = float(re.search(r"FAULT (\d+(?:\.\d+)?)", text).group(1))
    report = next(t for t, line in arrivals if line.startswith("[fleetmpi] stall: rank 0/2"))
    assert stall_time - 0.05 <= report - fault <= stall_time + 1.0, text
    assert stall_time + linger - 0.05 <= ended - fault <= stall_time + linger + 2.0, text

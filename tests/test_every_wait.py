"""Every wait is watched: a point-to-point ``recv`` whose sender never sends (a plain
``Communicator.recv``, and a pipeline stage whose peer raised inside ``train_batch`` and
caught it) is reported by the waiting rank, naming itself, the call and where the peer is;
a rank that finished its script reports the ranks that never finish theirs instead of
waiting in ``MPI_Finalize``; a parameter-server worker whose server hung ends the job.
Each within the stall time and a few seconds, and the job ends
non-zero leaving nothing behind."""
import re

import pytest

from wait_support import (REPORT_MARGIN_SECONDS, STALL_SECONDS, check_ended_cleanly,
                          fleetmpirun, launcher_command, run_job)

CERTAIN = "it cannot arrive, aborting the job"
TIMED_OUT = "FLEETMPI_STALL_TIMEOUT is exceeded, aborting the job"
RECV = "recv #2 from rank 1 of float64 (3,); rank 1 has not made the matching send: "
# HOW rank 1 does not send: (the ranks that report, what rank 0 says of rank 1, certain).
PEER = {
    "sleep": ({0}, "rank 1 is in no call; it has made 1 send(s) to this rank; its last "
                   "point-to-point call send #1 to rank 0 of float64 (3,)", False),
    "finish": ({0}, "rank 1 finished its script after 1 send(s) to this rank", True),
    "recv": ({0, 1}, "rank 1 waits in recv #1 from rank 0 of float64 (3,)", True),
    "barrier": ({0}, "rank 1 waits in barrier, call #1 of this communicator, which this rank "
                     "has not reached", True),
}


def check_waited(line, certain):
    """A report at once may come at any time; one at the stall time says it waited that."""
    assert (CERTAIN if certain else TIMED_OUT) in line, line
    if not certain:
        assert float(re.search(r"has waited (\S+) s", line).group(1)) >= STALL_SECONDS, line


@pytest.mark.parametrize("how", sorted(PEER))
def test_a_recv_whose_sender_never_sends_is_reported(how):
    job = run_job(launcher_command("fleetmpirun", 2, ["wait_jobs.py", "recv", how]))
    reporters, said, certain = PEER[how]
    found = job.reports()
    assert set(found) == reporters, job.text
    assert found[0].startswith(f"has waited ") and RECV + said in found[0], job.text
    check_waited(found[0], certain)
    if 1 in reporters:
        assert "in recv #1 from rank 0 of float64 (3,); rank 0 has not made the matching " \
               "send: rank 0 waits in recv #2 from rank 1" in found[1], job.text
    assert job.reported_within() <= STALL_SECONDS + REPORT_MARGIN_SECONDS, job.text
    assert "rank 0 finished" not in job.text, job.text
    check_ended_cleanly(job)


@pytest.mark.parametrize("how", ["finish", "sleep"])
def test_a_pipeline_stage_whose_peer_raised_in_train_batch_is_reported(how):
    """The last stage's loss raises at step 2 and the script catches it: that rank ends its
    script (reported at once) or sleeps (at the stall time); the first stage waits in the
    ``recv`` of the header of a gradient (an int64 (36,)) that never comes."""
    job = run_job(launcher_command("fleetmpirun", 2, ["wait_jobs.py", "pipeline", how]))
    found = job.reports()
    assert set(found) == {0}, job.text
    assert "rank 1 caught: the last stage's loss fails on purpose" in job.text, job.text
    assert re.search(r"in recv #\d+ from rank 1 of int64 \(36,\); rank 1 has not made the "
                     r"matching send: ", found[0]), job.text
    said = ("rank 1 finished its script after" if how == "finish" else
            "rank 1 is in no call; it has made")
    assert said in found[0], job.text
    check_waited(found[0], how == "finish")
    assert job.reported_within() <= STALL_SECONDS + REPORT_MARGIN_SECONDS, job.text
    assert "rank 0 finished" not in job.text, job.text
    check_ended_cleanly(job)


@pytest.mark.parametrize("launcher", ["mpiexec", "fleetmpirun"])
def test_a_rank_that_never_finishes_is_reported_by_the_finished_ones(launcher):
    """Rank 1 hangs before the last of 10 broadcasts; rank 0, the root, returns from it and
    ends its script, where it waited in MPI_Finalize for good."""
    job = run_job(launcher_command(launcher, 2, ["wait_jobs.py", "exit", "broadcast"]))
    found = job.reports()
    assert set(found) == {0}, job.text
    assert re.match(r"finished its script and has waited (\S+) s for rank\(s\) 1 to finish "
                    r"theirs: rank 1 is in no call; its last collective here #9 \(broadcast "
                    r"of float64 \(4,\)\); .*aborting the job instead of waiting in "
                    r"MPI_Finalize", found[0]), job.text
    assert float(re.search(r"has waited (\S+) s", found[0]).group(1)) >= STALL_SECONDS
    assert "rank 0 finished" in job.text and "rank 1 finished" not in job.text, job.text
    assert job.reported_within() <= STALL_SECONDS + REPORT_MARGIN_SECONDS, job.text
    check_ended_cleanly(job, launcher)


def test_a_timeline_rank_0_cannot_write_is_named_and_the_job_ends(tmp_path):
    """``FLEETMPI_TIMELINE`` names a folder: rank 0 cannot put the file there. Every rank
    names the path and the error, keeps its part file, and the job ends (its status is the
    training's: 0), where the other ranks waited for good in the exit hook's barrier."""
    folder = tmp_path / "timeline"
    folder.mkdir()
    job = run_job(launcher_command("mpiexec", 2, ["wait_jobs.py", "timeline", "allreduce"]),
                  FLEETMPI_TIMELINE=str(folder))
    assert job.code == 0, job.text
    for rank in range(2):
        assert f"[fleetmpi rank {rank}/2 node 0] ERROR timeline: rank 0 could not write " \
               f"{folder}: [Errno 21] Is a directory" in job.text, job.text
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "timeline", "timeline.rank0.part", "timeline.rank1.part"]
    assert job.reported_within("[fleetmpi rank") <= STALL_SECONDS + REPORT_MARGIN_SECONDS
    assert job.left_behind()[0] == [], job.text


@pytest.mark.parametrize("mode", ["async", "geo"])
def test_a_worker_whose_server_hung_ends_the_job_naming_it(mode):
    """Server 0 hangs at its fourth push: the worker waiting for its answer raises
    ``ServerError`` after twice ``FLEETMPI_PS_TIMEOUT`` and, where an async or GEO worker
    that raises leaves alone, ends the job, naming the server; before, the job never
    ended. The timeout leaves a loaded machine's slow server time to reach its fourth push
    before a worker gives up on it."""
    ps_timeout = 4
    command = fleetmpirun() + ["--server_num", "1", "--worker_num", "2", "pserver_jobs.py",
                               "server-hang", "--servers", "1", "--mode", mode]
    job = run_job(command, FLEETMPI_PS_TIMEOUT=str(ps_timeout))
    said = re.findall(r"\[fleetmpi\] worker (\d) \(rank \d\) leaves because server 0 \(rank 2\) "
                      rf"did not answer within {2 * ps_timeout} s \(twice FLEETMPI_PS_TIMEOUT\); "
                      r"a hung server would keep the job from ending: aborting the job", job.text)
    assert said, job.text
    assert "ServerError: server 0 (rank 2) did not answer worker" in job.text, job.text
    # a worker whose pushes all came before the hang may finish; none that waited does
    finished = re.findall(r"ok leave \w+ worker (\d)", job.text)
    assert not set(said) & set(finished), job.text
    bound = 2 * ps_timeout + REPORT_MARGIN_SECONDS
    assert job.reported_within("[fleetmpi] worker") <= bound, job.text
    check_ended_cleanly(job)


def peer_answer(sent=0, received=0, in_flight=False, peer=None, text="send #1 to rank 0",
                started=0, blocked_here=False, elsewhere=()):
    return {"started": started, "text": "barrier", "blocked_here": blocked_here,
            "elsewhere": list(elsewhere),
            "p2p": {"sent": sent, "received": received, "in_flight": in_flight, "peer": peer,
                    "text": text}}


RECV_4 = ("recv", 1, 4, "float64", (2,))
SEND_2 = ("send", 1, 2, "float64", (2,))


@pytest.mark.parametrize("what, answer, finished, arrived, certain, said", [
    (RECV_4, peer_answer(sent=4, in_flight=True, peer=0), None, True, False, "has arrived"),
    (SEND_2, peer_answer(received=2), None, True, False, "has arrived"),
    (RECV_4, None, {"sent": 3, "received": 0}, False, True,
     "finished its script after 3 send(s) to this rank"),
    (SEND_2, None, {"sent": 0, "received": 1}, False, True,
     "finished its script after 1 receive(s) from this rank"),
    (RECV_4, None, None, False, False, "did not answer"),
    (RECV_4, peer_answer(sent=3), None, False, False, "is in no call; it has made 3 send(s)"),
    (RECV_4, peer_answer(sent=3, in_flight=True, peer=0, text="recv #9 from rank 0"), None,
     False, True, "waits in recv #9 from rank 0"),
    (RECV_4, peer_answer(sent=3, in_flight=True, peer=2, text="recv #1 from rank 2"), None,
     False, False, "waits in recv #1 from rank 2"),
    (RECV_4, peer_answer(sent=3, started=6, blocked_here=True), None, False, True,
     "waits in barrier, call #6 of this communicator, which this rank has not reached"),
    (RECV_4, peer_answer(sent=3, started=5, blocked_here=True), None, False, False,
     "is in no call"),
    (RECV_4, peer_answer(sent=3, elsewhere=[(77, 2, "allreduce", True)]), None, False, True,
     "waits in allreduce, call #2 of another communicator"),
    (RECV_4, peer_answer(sent=3, elsewhere=[(78, 2, "allreduce", False)]), None, False,
     False, "is in no call"),
])
def test_the_peer_verdict_tells_where_the_peer_is(what, answer, finished, arrived, certain,
                                                  said):
    """Counts per peer, not call numbers, say whether the peer arrived; only a peer that
    finished, or waits on this rank, makes the wait certainly hopeless."""
    from fleetmpi.comm.peer_watch import peer_verdict

    line, got_arrived, got_certain = peer_verdict(what, 0, answer, finished, (5, {77: 1}))
    assert (got_arrived, got_certain) == (arrived, certain) and said in line, line

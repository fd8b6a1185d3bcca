"""``fleetmpi.testing``, the pytest plugin, as a user meets it: pytest under ``mpiexec`` on a
small test file of their own."""
import os
import re
import subprocess
import sys
import textwrap
import time
from xml.etree import ElementTree

import pytest

from fleetmpi.launch.mpi_command import local_command

from job_limits import HANG_SECONDS
from wait_support import (REPORT_MARGIN_SECONDS, STALL_SECONDS, Job, check_ended_cleanly,
                          launcher_command)

RANK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugin_rank.py")


def run_pytest(tmp_path, source, ranks=2, stall_timeout=None):
    path = tmp_path / "test_user.py"
    path.write_text(textwrap.dedent(source))
    env = dict(os.environ)
    env.pop("FLEETMPI_STALL_TIMEOUT", None)
    if stall_timeout is not None:
        env["FLEETMPI_STALL_TIMEOUT"] = str(stall_timeout)
    done = subprocess.run(local_command(ranks) + [
        sys.executable, "-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider",
        "-p", "no:randomly", str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=HANG_SECONDS)
    return done, done.stdout + done.stderr


def test_the_fixtures(tmp_path):
    done, output = run_pytest(tmp_path, """
        import os
        import numpy as np
        import pytest

        @pytest.mark.mpi(min_size=2)
        def test_fixtures(rank, world_size, comm, mpi_tmp_path, tmp_path):
            from mpi4py import MPI
            assert world_size == MPI.COMM_WORLD.Get_size() and rank == MPI.COMM_WORLD.Get_rank()
            total = comm.allreduce(np.array([rank + 1.0]))
            assert total[0] == world_size * (world_size + 1) / 2
            (mpi_tmp_path / f"from-{rank}").write_text("x")
            (tmp_path / "mine").write_text(str(rank))
            shared = MPI.COMM_WORLD.allgather(str(mpi_tmp_path))
            own = MPI.COMM_WORLD.allgather(str(tmp_path))
            assert len(set(shared)) == 1 and len(set(own)) == world_size
            MPI.COMM_WORLD.Barrier()
            assert {f"from-{r}" for r in range(world_size)} <= set(os.listdir(mpi_tmp_path))
            assert os.environ["FLEETMPI_STALL_TIMEOUT"] == "30"
        """)
    assert done.returncode == 0, output
    assert output.count("1 passed") == 2


def test_a_failure_on_one_rank_fails_the_test_on_every_rank(tmp_path):
    done, output = run_pytest(tmp_path, """
        def test_first(rank):
            assert rank != 1, "rank 1 disagrees"

        def test_second(rank):
            pass
        """)
    assert done.returncode != 0
    assert "[rank 1] FAILED" in output and "rank 1 disagrees" in output
    # rank 0 passed the test's call and reports rank 1's failure at its end; then both ranks
    # run the next test
    assert "ERROR test_user.py::test_first - rank 1 failed this test (call: " in output
    assert "2 passed, 1 error" in output and "1 failed, 1 passed" in output


USER_TESTS = """
    import time
    import numpy as np

    def test_before(comm):
        comm.allreduce(np.ones(2))

    def test_collective(rank, comm):
        if rank == 1:
            with open("fault", "w") as f:
                f.write(repr(time.time()))
        assert rank != 1, "rank 1 fails before the allreduce"
        comm.allreduce(np.ones(4))

    def test_after(comm):
        comm.allreduce(np.ones(3))
    """
ALLREDUCE_LINE = 13  # of the allreduce that rank 1 never joins, in test_user.py


def run_ranks(tmp_path, source, ranks):
    """``source`` as ``test_user.py`` run under ``fleetmpirun`` (which removes an aborted job's
    shared memory) by ``plugin_rank.py`` with ``FLEETMPI_STALL_TIMEOUT=STALL_SECONDS``:
    ``(the job, {rank: its pytest output}, {rank: its JUnit testcases as {name: [(tag,
    message)]}}, seconds from the fault to the job's end)``."""
    (tmp_path / "test_user.py").write_text(textwrap.dedent(source))
    env = dict(os.environ, FLEETMPI_DEVICE="cpu", FLEETMPI_STALL_TIMEOUT=str(STALL_SECONDS))
    done = subprocess.run(launcher_command("fleetmpirun", ranks, [RANK, "test_user.py"]),
                          cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=HANG_SECONDS)
    ended = time.time()
    job = Job(done.returncode, [(ended, line) for line in
                                (done.stdout + done.stderr).splitlines(keepends=True)])
    logs = {r: (tmp_path / f"rank-{r}.log").read_text() for r in range(ranks)}
    junit = {}
    for r in range(ranks):
        cases = junit[r] = {}
        for case in ElementTree.parse(tmp_path / f"junit-{r}.xml").getroot().iter("testcase"):
            cases.setdefault(case.get("name"), []).extend(
                (e.tag, e.get("message")) for e in case if e.tag in ("failure", "error"))
    fault = float((tmp_path / "fault").read_text()) if (tmp_path / "fault").exists() else None
    return job, logs, junit, None if fault is None else ended - fault


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_rank_failing_before_a_collective_ends_the_session_with_every_ranks_summary(
        tmp_path, ranks):
    """Rank 1 fails a test before an allreduce that the other ranks wait in. Every rank
    reports that test failed, naming rank 1's error and each waiting rank's collective and
    line; the test before it passed; every rank writes its summary and JUnit file and names
    the test not run; the job ends non-zero within the stall time and 5 s of the failure,
    leaving nothing behind."""
    job, logs, junit, waited = run_ranks(tmp_path, USER_TESTS, ranks)
    check_ended_cleanly(job)
    assert waited <= STALL_SECONDS + REPORT_MARGIN_SECONDS, (waited, job.text)
    failed = ("rank 1 failed this test (call: AssertionError: rank 1 fails before the "
              "allreduce) and waits at the end of test_user.py::test_collective")
    waiting = [f"rank {r} waits in allreduce of float64 (4,), call #" for r in range(ranks)
               if r != 1]
    site = f", at test_user.py:{ALLREDUCE_LINE} in test_collective"
    for r, log in logs.items():
        assert f"rank {r}: the session ends early" in log, log
        assert failed in log and "1 test(s) not run" in log, log
        assert "not run: test_user.py::test_after" in log, log
        for line in waiting:
            assert line in log and re.search(re.escape(line) + r"\d+ of its communicator"
                                             + re.escape(site), log), log
        summary = "1 failed, 1 passed, 1 error in " if r == 1 else "1 failed, 1 passed in "
        assert summary in log, log
        cases = junit[r]
        assert set(cases) == {"test_before", "test_collective"}, cases
        assert cases["test_before"] == [], cases
        messages = "\n".join(message for _, message in cases["test_collective"])
        assert failed in messages and all(line in messages for line in waiting), messages
        tags = [tag for tag, _ in cases["test_collective"]]
        assert tags == (["failure", "error"] if r == 1 else ["failure"]), cases
    assert "AssertionError: rank 1 fails before the allreduce" in junit[1]["test_collective"][0][1]


def test_a_rank_stuck_outside_fleetmpi_is_named_by_the_others(tmp_path):
    """Rank 0 waits in an MPI receive of its own that nothing sends, rank 1 at the end of
    the test: after the stall time rank 1 ends the session, and rank 0 ends its own,
    naming where it is."""
    job, logs, junit, _ = run_ranks(tmp_path, """
        import numpy as np
        from mpi4py import MPI

        def test_stuck(rank):
            if rank == 0:
                MPI.COMM_WORLD.Recv(np.zeros(1), source=1, tag=99)  # never sent
        """, 2)
    check_ended_cleanly(job)
    for r, log in logs.items():
        assert "rank 0 is in no fleetmpi collective, at test_user.py:7 in test_stuck" in log, log
        assert "rank 1 waits at the end of test_user.py::test_stuck" in log, log
        assert ("1 failed in " if r == 0 else "1 passed, 1 error in ") in log, log


def test_the_projects_own_multi_rank_tests_run_the_standard_way(tmp_path):
    """``mpiexec -n 2 python -m pytest --with-mpi -m mpi tests/...``, without the repository's
    wrapper: each rank its own temporary folders, every test in lockstep."""
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run(local_command(2) + [
        sys.executable, "-m", "pytest", "--with-mpi", "-m", "mpi", "-q", "-p",
        "no:cacheprovider", os.path.join(here, "test_checkpoint.py"),
        os.path.join(here, "test_io.py")], cwd=tmp_path, capture_output=True, text=True,
        timeout=HANG_SECONDS * 3)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    # one summary per rank; the two ranks' lines may come out joined
    summaries = re.findall(r"\d+ passed[^\n]*? in [0-9.]+s", output)
    assert len(summaries) == 2 and all("failed" not in s for s in summaries), summaries

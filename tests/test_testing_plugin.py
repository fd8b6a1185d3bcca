"""``fleetmpi.testing``, the pytest plugin, as a user meets it: pytest under ``mpiexec`` on a
small test file of their own."""
import os
import re
import subprocess
import sys
import textwrap

import pytest

from fleetmpi.launch.mpi_command import local_command

from job_limits import HANG_SECONDS



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


def test_a_rank_left_waiting_in_a_collective_ends_the_job_within_the_stall_timeout(tmp_path):
    done, output = run_pytest(tmp_path, """
        import numpy as np

        def test_collective(rank, comm):
            assert rank != 1, "rank 1 fails before the allreduce"
            comm.allreduce(np.ones(4))
        """, stall_timeout=3)
    assert done.returncode != 0
    assert "rank 1 fails before the allreduce" in output


def test_a_rank_stuck_outside_fleetmpi_is_named_by_the_others(tmp_path):
    done, output = run_pytest(tmp_path, """
        import numpy as np
        from mpi4py import MPI

        def test_stuck(rank):
            if rank == 0:
                MPI.COMM_WORLD.Recv(np.zeros(1), source=1, tag=99)  # never sent
        """, stall_timeout=3)
    assert done.returncode != 0
    assert "[rank 1] waited" in output and "for rank(s) 0" in output, output


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

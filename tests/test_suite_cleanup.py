"""The test run removes the MPICH segments that its own aborted plain-mpiexec jobs leave in
/dev/shm (tests/conftest.py), and no other."""
import os
import subprocess
import sys
import textwrap

import pytest

from fleetmpi.launch import shm
from fleetmpi.launch.mpi_command import local_command

from job_limits import HANG_SECONDS

HERE = os.path.dirname(os.path.abspath(__file__))
# Two ranks that map their job's segment, say its name, and abort.
ABORTING_JOB = ("from mpi4py import MPI; from fleetmpi.launch import shm; import os; "
                "print('SEGMENTS', *sorted(shm.mapped_segments(os.getpid())), flush=True); "
                "MPI.COMM_WORLD.Barrier(); MPI.COMM_WORLD.Abort(3)")


def test_a_run_removes_what_its_aborted_jobs_left_and_keeps_the_rest(tmp_path):
    if not os.path.isdir(shm.SHM_DIR):
        pytest.skip(f"no {shm.SHM_DIR} on this system")
    older = os.path.join(shm.SHM_DIR, f"mpich_shm_{os.getpid():x}0ld_0")
    with open(older, "wb"):  # there before the run: never the run's to remove
        pass
    said = tmp_path / "segments"
    (tmp_path / "test_aborts.py").write_text(textwrap.dedent(f"""
        import subprocess
        def test_a_job_aborts():
            job = subprocess.run({local_command(2, [sys.executable, "-c", ABORTING_JOB])!r},
                                 capture_output=True, text=True, timeout={HANG_SECONDS})
            assert job.returncode != 0
            names = {{n for line in job.stdout.splitlines() if line.startswith("SEGMENTS")
                     for n in line.split()[1:]}}
            open({str(said)!r}, "w").write(" ".join(sorted(names)))
    """))
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest",
                              "-p", "no:cacheprovider", str(tmp_path / "test_aborts.py")],
                             capture_output=True, text=True, timeout=HANG_SECONDS,
                             env=dict(os.environ, PYTHONPATH=HERE, FLEETMPI_DEVICE="cpu"))
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
        left = said.read_text().split()
        assert left, "the aborted job mapped no MPICH segment"
        assert not [n for n in left if os.path.exists(os.path.join(shm.SHM_DIR, n))]
        assert os.path.exists(older)
    finally:
        os.unlink(older)

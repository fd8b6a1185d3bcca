"""Running a job that must report a wait and end: its output line by line with the time each
line came, and what it left behind (processes, MPICH segments in /dev/shm)."""
import os
import re
import subprocess
import sys
import threading
import time

from fleetmpi.launch import shm
from fleetmpi.launch.mpi_command import local_command

from test_failure import fleetmpirun

HERE = os.path.dirname(os.path.abspath(__file__))
STALL_SECONDS = 3
# The report must come within the stall time and this much more, on a busy machine too.
REPORT_MARGIN_SECONDS = 5
# A job that hangs runs into this and fails the test instead of hanging it.
JOB_SECONDS = 120


def launcher_command(launcher, n, program):
    if launcher == "mpiexec":
        return local_command(n, [sys.executable] + program)
    return fleetmpirun() + ["--np", str(n)] + program


class Job:
    """A finished job: ``code``, ``text`` (its output), ``arrivals`` ([(time, line)])."""

    def __init__(self, code, arrivals):
        self.code, self.arrivals = code, arrivals
        self.text = "".join(line for _, line in arrivals)

    def first(self, prefix):
        """When the first line starting with ``prefix`` came (None: never)."""
        return next((t for t, line in self.arrivals if line.startswith(prefix)), None)

    def fault(self):
        # not anchored to a line: mpiexec may join two ranks' lines into one
        return float(re.search(r"FAULT (\d+(?:\.\d+)?)", self.text).group(1))

    def reports(self):
        """{reporting rank: the rest of its stall line}."""
        return {int(m.group(1)): m.group(2)
                for m in re.finditer(r"\[fleetmpi\] stall: rank (\d+)/\d+ (.*)", self.text)}

    def reported_within(self, prefix="[fleetmpi] stall: "):
        """Seconds from the fault to the first report (starting with ``prefix``)."""
        return self.first(prefix) - self.fault()

    def left_behind(self):
        """The job's processes still running and its MPICH segments still in /dev/shm."""
        pids = [int(p) for p in re.findall(r"^PID (\d+)$", self.text, re.M)]
        segments = {name for line in re.findall(r"^SEGMENTS(.*)$", self.text, re.M)
                    for name in line.split()}
        running = [pid for pid in pids if _running(pid)]
        return running, sorted(n for n in segments if os.path.exists(os.path.join(shm.SHM_DIR,
                                                                                  n)))


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run_job(command, **env_extra):
    """Run ``command`` with the stall time ``STALL_SECONDS``; a ``Job``."""
    env = dict(os.environ, FLEETMPI_DEVICE="cpu", FLEETMPI_STALL_TIMEOUT=str(STALL_SECONDS),
               **env_extra)
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, cwd=HERE)
    arrivals = []
    reader = threading.Thread(target=lambda: arrivals.extend(
        (time.time(), line) for line in job.stdout), daemon=True)
    reader.start()
    try:
        job.wait(timeout=JOB_SECONDS)
    finally:
        job.kill()
    reader.join(5)
    return Job(job.returncode, arrivals)


def check_ended_cleanly(job, launcher="fleetmpirun"):
    """The job failed, and left no process behind, nor (under ``fleetmpirun``, which removes
    them; plain ``mpiexec`` leaves an aborted job's, docs/reliability.md) any shared-memory
    segment."""
    assert job.code != 0, job.text
    time.sleep(0.5)  # a rank the launcher killed may take a moment to be reaped
    running, segments = job.left_behind()
    assert not running, f"processes {running} outlived the job:\n{job.text}"
    if launcher == "fleetmpirun":
        assert not segments, f"{segments} left in {shm.SHM_DIR}:\n{job.text}"

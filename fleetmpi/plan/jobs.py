"""Short ``mpiexec`` jobs the planner measures with: one rank's result line comes back as JSON.

Every job runs with ``FLEETMPI_DEVICE=cpu`` and one BLAS thread per rank, so a job of any size
computes at the same per-rank speed until the ranks outnumber the cores.
"""
import json
import os
import subprocess
import sys

from ..core import knobs
from fleetmpi.launch.mpi_command import local_command

RESULT = "PLAN-RESULT "


def job_env():
    return {**os.environ, knobs.DEVICE.name: "cpu", knobs.NUM_THREADS.name: "1",
            "OMP_NUM_THREADS": "1"}


def run(module, ranks, args, timeout=300):
    """Run ``python -m module args`` on ``ranks`` ranks; the dict its rank 0 printed."""
    cmd = local_command(ranks, [sys.executable, "-m", module, *map(str, args)])
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=job_env(),
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(cmd)} ran past {timeout} s") from None
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    raise RuntimeError(f"{' '.join(cmd)} failed (exit {done.returncode}):\n"
                       f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def report(result):
    print(RESULT + json.dumps(result), flush=True)

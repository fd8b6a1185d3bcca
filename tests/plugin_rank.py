"""One rank of a user's pytest run under a launcher, as tests/test_testing_plugin.py starts it:

    fleetmpirun --np N tests/plugin_rank.py [pytest args]

prints ``PID <pid>`` and ``SEGMENTS <the MPICH segments it mapped>`` (for
``wait_support.Job.left_behind``), then runs ``pytest --with-mpi --junitxml=junit-{rank}.xml``
(the plugin puts the rank in) with its output in ``rank-<rank>.log``, in the current folder:
the launcher joins the ranks' lines, and the test checks every rank's own.
"""
import os
import sys

import pytest
from mpi4py import MPI

from fleetmpi.launch import shm


def main(args):
    rank = MPI.COMM_WORLD.Get_rank()
    print(f"PID {os.getpid()}", flush=True)
    print("SEGMENTS", *sorted(shm.mapped_segments(os.getpid())), flush=True)
    log = open(f"rank-{rank}.log", "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    return pytest.main(["--with-mpi", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                        "--junitxml=junit-{rank}.xml"] + args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

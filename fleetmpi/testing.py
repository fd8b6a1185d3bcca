"""``fleetmpi.testing``: a pytest plugin for multi-rank tests of one's own code, with
pytest-mpi, registered through the ``pytest11`` entry point (nothing to configure):

    mpiexec -n 2 python -m pytest --with-mpi tests/

Under MPI (``--with-mpi`` or ``--only-mpi``, more than one rank) it does three things:

- **Lockstep.** After each test every rank tells the others how the test went on it; a test
  that failed on one rank fails on every rank, with that rank's message, so no rank moves on
  to the next test while another is still in this one. A failure is also printed at once
  with its rank (the other ranks may never reach the end of the run). A rank that waits
  there longer than ``FLEETMPI_STALL_TIMEOUT`` names the ranks that did not arrive and ends
  the job: they are stuck in the test, in a call the failing rank never made.
- **A short stall timeout.** ``FLEETMPI_STALL_TIMEOUT`` defaults to ``PYTEST_STALL_SECONDS``
  instead of 600, so a collective that a failed rank left waits seconds, not minutes.
- **A temporary folder per rank.** pytest's ``tmp_path`` lives under a folder of each rank's
  own (unless ``--basetemp`` is given): ranks that share pytest's default root would number
  and prune each other's folders.

Fixtures: ``rank`` and ``world_size`` (of ``MPI.COMM_WORLD``), ``comm`` (the world's
``fleetmpi.comm.Communicator``, after ``fleet.init()``); pytest-mpi's ``mpi_tmp_path`` is the
folder all ranks share (rank 0's ``tmp_path``).
"""
import os
import sys
import tempfile
import time

import pytest

from .core.knobs import STALL_TIMEOUT

PYTEST_STALL_SECONDS = 30
# The longest failure text one rank sends the others (the head is kept).
MESSAGE_BYTES = 8192
_BUFFER_BYTES = 4 * MESSAGE_BYTES


def _world(config):
    """``MPI.COMM_WORLD`` where this run tests under MPI with more than one rank, else None."""
    if not (config.getoption("--with-mpi", default=False)
            or config.getoption("--only-mpi", default=False)):
        return None
    from mpi4py import MPI

    return MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() > 1 else None


def pytest_configure(config):
    world = _world(config)
    if world is None:
        return
    os.environ.setdefault(STALL_TIMEOUT.name, str(PYTEST_STALL_SECONDS))
    if config.option.basetemp is None:  # a fresh folder of rank 0's, then one per rank in it
        root = world.bcast(tempfile.mkdtemp(prefix="pytest-fleetmpi-")
                           if world.Get_rank() == 0 else None)
        config.option.basetemp = os.path.join(root, f"rank-{world.Get_rank()}")
    config.pluginmanager.register(Lockstep(world.Dup()), "fleetmpi-lockstep")


class Lockstep:
    """The per-test agreement of the ranks (module docstring), over its own communicator."""

    def __init__(self, comm):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.failures = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = (yield).get_result()
        if report.failed:
            text = report.longreprtext
            self.failures.setdefault(item.nodeid, f"{report.when}: {text}"[-MESSAGE_BYTES:])
            sys.stderr.write(f"\n[rank {self.rank}] FAILED {item.nodeid} ({report.when})\n"
                             f"{text}\n")
            sys.stderr.flush()
        if call.when != "teardown":
            return
        mine = self.failures.get(item.nodeid)
        heard = self._exchange((item.nodeid, mine), item.nodeid)
        elsewhere = [(rank, nodeid, failure) for rank, (nodeid, failure) in heard.items()
                     if failure is not None or nodeid != item.nodeid]
        if elsewhere and mine is None and not report.failed:
            report.outcome = "failed"
            report.longrepr = "\n".join(
                f"rank {rank} failed this test ({failure})" if nodeid == item.nodeid else
                f"rank {rank} ended {nodeid} instead: the ranks collected different tests"
                for rank, nodeid, failure in elsewhere)

    def _exchange(self, payload, nodeid):
        """``{rank: payload}`` of every other rank; ends the job, naming the ranks that did not
        arrive, after the stall timeout."""
        sends = [self.comm.isend(payload, dest=r) for r in range(self.size) if r != self.rank]
        pending = {r: self.comm.irecv(bytearray(_BUFFER_BYTES), source=r)
                   for r in range(self.size) if r != self.rank}
        heard, limit = {}, _stall_seconds()
        start, pause = time.monotonic(), 0.0
        while pending:
            for r, request in list(pending.items()):
                done, value = request.test()
                if done:
                    heard[r] = value
                    del pending[r]
            if not pending:
                break
            waited = time.monotonic() - start
            if waited > limit:
                sys.stderr.write(
                    f"\n[rank {self.rank}] waited {waited:.0f} s after {nodeid} for rank(s) "
                    f"{', '.join(map(str, sorted(pending)))}, still in that test or an earlier "
                    f"one ({STALL_TIMEOUT.name}={limit:g}); ending the job\n")
                sys.stderr.flush()
                self.comm.Abort(1)
            time.sleep(pause)
            pause = min(pause * 2 or 1e-4, 0.02)
        for request in sends:
            request.wait()
        return heard


def _stall_seconds():
    value = STALL_TIMEOUT.value()
    return float("inf") if not value else float(value)


@pytest.fixture(scope="session")
def world_size():
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()


@pytest.fixture(scope="session")
def rank():
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


@pytest.fixture(scope="session")
def comm():
    """The world's ``fleetmpi.comm.Communicator``, after ``fleet.init()``."""
    from .core import job
    from . import world
    from .comm import Communicator

    world.init(is_collective=True)
    return Communicator(job.topology())

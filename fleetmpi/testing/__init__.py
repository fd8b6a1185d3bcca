"""``fleetmpi.testing``: a pytest plugin for multi-rank tests of one's own code, with
pytest-mpi, registered through the ``pytest11`` entry point (nothing to configure):

    mpiexec -n 2 python -m pytest --with-mpi tests/

Under MPI (``--with-mpi`` or ``--only-mpi``, more than one rank) it does these things:

- **Lockstep.** After each test every rank tells the others how the test went on it; a test
  that failed on one rank fails on every rank, with that rank's message, so no rank moves on
  to the next test while another is still in this one. A failure is also printed at once
  with its rank. The wait at the end of a test is a watched call of the stall watchdog
  (``fleetmpi.comm.watchdog``), named ``the end of <test>``.
- **One failing rank ends the session, not the run.** A rank that fails a test before a
  collective leaves the others blocked in it, inside an MPI call that cannot be cancelled.
  Their watchdogs see it within about a second (the failing rank waits at the end of the
  test, a call they have not reached) and, instead of aborting the job, every rank ends its
  pytest session (``SessionEnd``): the test is reported failed with each rank's state (the
  failing rank's error; each blocked rank's collective, call number and the test's line that
  made it), the summary of every test that ran is written, JUnit XML included
  (``--junitxml``), the tests not run are counted, and the job ends with status 1. A wait that
  is only long (a rank busy elsewhere) ends the same way after ``FLEETMPI_STALL_TIMEOUT``.
- **A short stall timeout.** ``FLEETMPI_STALL_TIMEOUT`` defaults to ``PYTEST_STALL_SECONDS``
  instead of 600, so a wait that is only long ends in seconds, not minutes.
- **A temporary folder per rank.** pytest's ``tmp_path`` lives under a folder of each rank's
  own (unless ``--basetemp`` is given): ranks that share pytest's default root would number
  and prune each other's folders. Likewise ``{rank}`` in ``--junitxml`` becomes the rank.

Fixtures: ``rank`` and ``world_size`` (of ``MPI.COMM_WORLD``), ``comm`` (the world's
``fleetmpi.comm.Communicator``, after ``fleet.init()``); pytest-mpi's ``mpi_tmp_path`` is the
folder all ranks share (rank 0's ``tmp_path``).
"""
import os
import sys
import tempfile
import time

import pytest

from fleetmpi.comm.stall_report import end_jobs_with
from fleetmpi.comm.watchdog import watch_of
from fleetmpi.core.knobs import STALL_TIMEOUT
from .session_end import SessionEnd

PYTEST_STALL_SECONDS = 30
# The longest failure text one rank sends the others (the head is kept).
MESSAGE_BYTES = 8192
_BUFFER_BYTES = 4 * MESSAGE_BYTES
LOCKSTEP_TAG = 7


def _world(config):
    """``MPI.COMM_WORLD`` where this run tests under MPI with more than one rank, else None."""
    if not (config.getoption("--with-mpi", default=False)
            or config.getoption("--only-mpi", default=False)):
        return None
    from mpi4py import MPI

    return MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() > 1 else None


@pytest.hookimpl(tryfirst=True)  # before pytest's junitxml plugin opens its file
def pytest_configure(config):
    world = _world(config)
    if world is None:
        return
    os.environ.setdefault(STALL_TIMEOUT.name, str(PYTEST_STALL_SECONDS))
    if config.option.xmlpath:
        config.option.xmlpath = config.option.xmlpath.replace("{rank}", str(world.Get_rank()))
    if config.option.basetemp is None:  # a fresh folder of rank 0's, then one per rank in it
        root = world.bcast(tempfile.mkdtemp(prefix="pytest-fleetmpi-")
                           if world.Get_rank() == 0 else None)
        config.option.basetemp = os.path.join(root, f"rank-{world.Get_rank()}")
    lockstep = Lockstep(world.Dup(), SessionEnd(config, world.Dup()))
    config.pluginmanager.register(lockstep, "fleetmpi-lockstep")
    end_jobs_with(lockstep.end.take_over)


def pytest_unconfigure(config):
    lockstep = config.pluginmanager.get_plugin("fleetmpi-lockstep")
    if lockstep is not None:
        end_jobs_with(None)
        lockstep.end.stop_listening()


class Lockstep:
    """The per-test agreement of the ranks (module docstring), over its own communicator;
    ``end`` is where the session ends when they cannot agree."""

    def __init__(self, comm, end):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.watch = watch_of(comm)
        self.end = end
        end.lockstep = self
        self.failures = {}

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session):
        self.end.start(session)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logstart(self, nodeid, location):
        self.end.logged = set()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.end.item = item
        yield
        self.end.item = None

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report):
        self.end.logged.add(report.when)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = (yield).get_result()
        if report.failed:
            text = report.longreprtext
            self.failures.setdefault(item.nodeid, f"{report.when}: {text}"[-MESSAGE_BYTES:])
            self.end.failed(report)
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
        """``{rank: payload}`` of every other rank: a watched call of the lockstep
        communicator, which the stall watchdog reports (module docstring)."""
        entered = self.watch.enter(("the end of a test", f"the end of {nodeid}"))
        try:
            sends = [self.comm.isend(payload, dest=r, tag=LOCKSTEP_TAG)
                     for r in range(self.size) if r != self.rank]
            pending = {r: self.comm.irecv(bytearray(_BUFFER_BYTES), source=r, tag=LOCKSTEP_TAG)
                       for r in range(self.size) if r != self.rank}
            heard, pause = {}, 0.0
            while pending:
                for r, request in list(pending.items()):
                    done, value = request.test()
                    if done:
                        heard[r] = value
                        del pending[r]
                time.sleep(pause)
                pause = min(pause * 2 or 1e-4, 0.02)
            for request in sends:
                request.wait()
            return heard
        finally:
            if entered:
                self.watch.leave()


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
    from fleetmpi.core import job
    from fleetmpi import world
    from fleetmpi.comm import Communicator

    world.init(is_collective=True)
    return Communicator(job.topology())

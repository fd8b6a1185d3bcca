"""The stall inspector: the agreement's exchange of rows, watched by a clock.

Every collective starts with the agreement (``fleetmpi.comm.agreement``), so the agreement is
where a rank waits for ranks that never come: one that skipped a collective, hangs, or is busy
elsewhere. A blocking ``Allgather`` would wait forever and could not say for whom. Here the
rows travel in requests that are polled:

* every rank but 0 sends its row to rank 0 with ``Issend`` (it completes only once rank 0 has
  posted the matching receive, that is, once rank 0 has arrived at this call) and posts an
  ``Ibcast`` for the table;
* rank 0 posts one ``Irecv`` per rank, and when all rows are in, broadcasts the table.

A rank that has waited ``FLEETMPI_STALL_TIMEOUT`` seconds (default 600; ``0`` waits forever)
writes which ranks have not arrived at which call (the collective and the communicator's call
number) and aborts the MPI job. Rank 0 knows exactly who is missing and sends the list to the
ranks that have arrived, so each of them writes it too; a rank whose row rank 0 has not taken
knows that rank 0 itself is missing.

Waiting first spins (yielding the core to other processes) for ``SPIN_SECONDS``, then sleeps
in growing steps up to ``SLEEP_MAX_SECONDS``, so ranks waiting on an oversubscribed machine do
not take the CPU from the rank they are waiting for.
"""
import math
import os
import time

import numpy as np

from ..knobs import env_seconds

STALL_ENV = "FLEETMPI_STALL_TIMEOUT"
DEFAULT_STALL_SECONDS = 600.0
ROW_TAG = 101
REPORT_TAG = 102
SPIN_SECONDS = 1e-3
SLEEP_MIN_SECONDS = 50e-6
SLEEP_MAX_SECONDS = 1e-3
# How long a rank that reports a stall waits before aborting, so that the other waiting ranks
# get to write their reports before the launcher ends them.
REPORT_LINGER_SECONDS = 1.0

_keyval = None


def stall_seconds(environ=os.environ):
    """``FLEETMPI_STALL_TIMEOUT`` in seconds: 600 when unset, ``inf`` for ``0`` (no limit)."""
    seconds = env_seconds(STALL_ENV, DEFAULT_STALL_SECONDS, zero_means="no limit",
                          environ=environ)
    return math.inf if seconds == 0 else seconds


class _CallState:
    """What one communicator remembers between agreements, cached on it as an MPI attribute."""

    def __init__(self):
        self.calls = 0
        self.timeout = stall_seconds()


def call_state(comm):
    """This communicator's ``_CallState`` (its call counter and stall time)."""
    global _keyval
    if _keyval is None:
        from mpi4py import MPI

        _keyval = MPI.Comm.Create_keyval()
    state = comm.Get_attr(_keyval)
    if state is None:
        state = _CallState()
        comm.Set_attr(_keyval, state)
    return state


class _Clock:
    """Paces a polling loop and tells when the stall time has run out."""

    def __init__(self, timeout):
        self.start = time.monotonic()
        self.deadline = self.start + timeout
        self.sleep = SLEEP_MIN_SECONDS

    def sleeping(self):
        """True once the spinning is over."""
        return self.sleep > SLEEP_MIN_SECONDS

    def waited(self):
        return time.monotonic() - self.start

    def pause(self):
        """Wait a little; False once the deadline has passed."""
        now = time.monotonic()
        if now >= self.deadline:
            return False
        if now - self.start < SPIN_SECONDS:
            os.sched_yield()
        else:
            time.sleep(self.sleep)
            self.sleep = min(2 * self.sleep, SLEEP_MAX_SECONDS)
        return True


def ranks_text(ranks):
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    parts, ranks = [], sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(parts)


def stall_message(rank, size, collective, call, missing, waited, reported_by=None):
    """The report one waiting rank writes; ``missing`` are the ranks not arrived (None: only
    rank 0 is known to be missing, the others unknown)."""
    where = f"{collective}, call #{call} of its communicator"
    head = f"[fleetmpi] stall: rank {rank}/{size} has waited {waited:.1f} s in {where}; "
    if missing is None:
        tail = ("rank 0 has not arrived there (rank 0 collects the other ranks' arrivals, so "
                "whether others are missing too is not known here)")
    else:
        source = "" if reported_by is None else f" (as rank {reported_by} reports)"
        tail = f"rank(s) {ranks_text(missing)} have not arrived there{source}"
    return head + tail + f"; {STALL_ENV} is exceeded, aborting the job"


def _stalled(message):
    from fleetmpi.failure import abort

    abort(message, linger=REPORT_LINGER_SECONDS)


def _wait(requests, clock, probe=None):
    """Poll ``requests`` until all complete (True) or the clock runs out (False); ``probe()``
    returning True also ends the wait (False). The probe is asked only once the spinning is
    over: a report cannot come sooner."""
    from mpi4py import MPI

    testall = MPI.Request.Testall
    while not testall(requests):
        if not clock.pause():
            return False
        if probe is not None and clock.sleeping() and probe():
            return False
    return True


def gather_rows(comm, row, collective):
    """Every rank's ``row`` (an int64 vector) stacked in rank order, on every rank; aborts the
    job with a stall report when ranks do not arrive in time (see the module docstring)."""
    state = call_state(comm)
    state.calls += 1
    rank, size = comm.Get_rank(), comm.Get_size()
    rows = np.empty((size, len(row)), dtype=np.int64)
    rows[rank] = row
    if size == 1:
        return rows
    clock = _Clock(state.timeout)
    if rank == 0:
        receives = [comm.Irecv(rows[r], source=r, tag=ROW_TAG) for r in range(1, size)]
        if not _wait(receives, clock):
            missing = [r for r, request in zip(range(1, size), receives) if not request.Test()]
            mask = np.zeros(size, dtype=np.int64)
            mask[missing] = 1
            reports = [comm.Isend(mask, dest=r, tag=REPORT_TAG)
                       for r in sorted(set(range(1, size)) - set(missing))]
            _wait(reports, _Clock(REPORT_LINGER_SECONDS))
            _stalled(stall_message(0, size, collective, state.calls, missing, clock.waited()))
        table = comm.Ibcast(rows, root=0)
        _wait([table], _Clock(math.inf))
        return rows
    send = comm.Issend(rows[rank], dest=0, tag=ROW_TAG)
    table = comm.Ibcast(rows, root=0)
    if _wait([send, table], clock, lambda: comm.Iprobe(source=0, tag=REPORT_TAG)):
        return rows
    if not comm.Iprobe(source=0, tag=REPORT_TAG) and not send.Test():
        _stalled(stall_message(rank, size, collective, state.calls, None, clock.waited()))
    # rank 0 has arrived and reports within its own stall time; wait that long for the report
    if _wait([table], _Clock(state.timeout), lambda: comm.Iprobe(source=0, tag=REPORT_TAG)):
        return rows
    mask = np.zeros(size, dtype=np.int64)
    if comm.Iprobe(source=0, tag=REPORT_TAG):
        comm.Recv(mask, source=0, tag=REPORT_TAG)
        _stalled(stall_message(rank, size, collective, state.calls, np.flatnonzero(mask),
                               clock.waited(), reported_by=0))
    _stalled(f"[fleetmpi] stall: rank {rank}/{size} has waited {clock.waited():.1f} s in "
             f"{collective}, call #{state.calls} of its communicator; rank 0 took this rank's "
             f"arrival but sent neither the agreement nor a stall report; aborting the job")

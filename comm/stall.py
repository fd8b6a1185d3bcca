"""The stall inspector: the agreement's exchange of rows, watched by a clock.

Every collective starts with the agreement (``fleetmpi.comm.agreement``), so the agreement is
where a rank waits for ranks that never come: one that skipped a collective, hangs, or is busy
elsewhere. A blocking ``Allgather`` would wait forever and could not say for whom. Here the
rows travel in requests that are polled, up a binomial tree and back down:

* rank ``r`` collects the rows of its subtree (ranks ``r .. r + lowbit(r) - 1``) from its
  children ``r + 1, r + 2, r + 4, ...`` (below ``lowbit(r)``), then sends them to its parent
  ``r - lowbit(r)`` with ``Issend`` (complete only once the parent has posted the matching
  receive, that is, has arrived at this call);
* rank 0, the root, holds every row once its children are in, and ``Ibcast`` hands the table
  to all. Each rank receives from at most ``ceil(log2 P)`` children and sends once: the
  exchange is O(log P) messages per rank.

A rank that has waited ``FLEETMPI_STALL_TIMEOUT`` seconds (default 600; ``0`` waits forever)
writes which ranks have not arrived at which call (the collective and the communicator's call
number) and aborts the MPI job. Only then does rank 0 learn exactly who is missing: it asks
every rank (``QUERY_TAG``), the ranks waiting in this exchange answer (``HERE_TAG``), and
after ``REPORT_LINGER_SECONDS`` the silent ones are the missing; rank 0 sends the list to the
ranks that answered, so each of them writes it too. A rank that rank 0 never asks within a
second stall time knows that rank 0 itself has not arrived.

Waiting first spins (yielding the core to other processes) for ``SPIN_SECONDS``, then sleeps
in growing steps up to ``SLEEP_MAX_SECONDS``, so ranks waiting on an oversubscribed machine do
not take the CPU from the rank they are waiting for.
"""
import math
import os
import time

import numpy as np

from ..knobs import STALL_TIMEOUT

ROW_TAG = 101
REPORT_TAG = 102
QUERY_TAG = 103
HERE_TAG = 104
SPIN_SECONDS = 1e-3
SLEEP_MIN_SECONDS = 50e-6
SLEEP_MAX_SECONDS = 1e-3
# How long a rank that reports a stall waits before aborting, so that the other waiting ranks
# get to write their reports before the launcher ends them.
REPORT_LINGER_SECONDS = 1.0

_keyval = None


def stall_seconds(environ=os.environ):
    """``FLEETMPI_STALL_TIMEOUT`` in seconds: 600 when unset, ``inf`` for ``0`` (no limit)."""
    seconds = STALL_TIMEOUT.value(environ)
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
    return head + tail + f"; {STALL_TIMEOUT.name} is exceeded, aborting the job"


def _stalled(message):
    from fleetmpi.failure import abort

    abort(message, linger=REPORT_LINGER_SECONDS)


def lowbit(rank):
    """The lowest set bit of ``rank`` (rank 0, the root, stands above every other)."""
    return rank & -rank


def tree_children(rank, size):
    """The children of ``rank`` in the binomial tree of ``size`` ranks, nearest first."""
    limit = lowbit(rank) if rank else size
    step, children = 1, []
    while step < limit and rank + step < size:
        children.append(rank + step)
        step *= 2
    return children


def subtree_size(rank, size):
    """How many ranks the subtree of ``rank`` holds: ``rank`` and the next ones below it."""
    return min(lowbit(rank) if rank else size, size - rank)


def tree_parent(rank):
    return rank - lowbit(rank)


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


class _Exchange:
    """One rank's part of one exchange up the tree and back down (module docstring)."""

    def __init__(self, comm, rows, collective, state):
        self.comm, self.rows, self.collective, self.state = comm, rows, collective, state
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.pending = [comm.Irecv(rows[c:c + subtree_size(c, self.size)], source=c,
                                   tag=ROW_TAG)
                        for c in tree_children(self.rank, self.size)]
        self.send = self.table = None
        self.asked = False

    def advance(self):
        """Move on as far as the messages allow; True once this rank holds every row."""
        from mpi4py import MPI

        if self.pending and not MPI.Request.Testall(self.pending):
            return False
        self.pending = []
        if self.table is None:
            if self.rank:
                mine = self.rows[self.rank:self.rank + subtree_size(self.rank, self.size)]
                self.send = self.comm.Issend(mine, dest=tree_parent(self.rank), tag=ROW_TAG)
            self.table = self.comm.Ibcast(self.rows, root=0)
        return self.table.Test() and (self.send is None or self.send.Test())

    def answer_query(self):
        """Answer rank 0's question whether this rank is here; True once rank 0 has asked."""
        if not self.asked and self.comm.Iprobe(source=0, tag=QUERY_TAG):
            question = np.empty(1, dtype=np.int64)
            self.comm.Recv(question, source=0, tag=QUERY_TAG)
            self.comm.Send(np.array([self.rank], dtype=np.int64), dest=0, tag=HERE_TAG)
            self.asked = True
        return self.asked

    def run(self, timeout):
        """Advance until done (True), a stall report is waiting (False), or ``timeout``."""
        clock = _Clock(timeout)
        while not self.advance():
            if self.rank and clock.sleeping():
                self.answer_query()
                if self.comm.Iprobe(source=0, tag=REPORT_TAG):
                    return False
            if not clock.pause():
                return False
        return True


def _root_stalled(exchange, waited):
    """Rank 0 after the stall time: ask every rank, name the silent ones, tell the others."""
    comm, size = exchange.comm, exchange.size
    question = np.zeros(1, dtype=np.int64)
    answers = np.zeros((size, 1), dtype=np.int64)
    exchange.asks = [comm.Isend(question, dest=r, tag=QUERY_TAG) for r in range(1, size)]
    replies = {r: comm.Irecv(answers[r], source=r, tag=HERE_TAG) for r in range(1, size)}
    _wait(list(replies.values()), _Clock(REPORT_LINGER_SECONDS))
    here = [r for r, request in replies.items() if request.Test()]
    missing = sorted(set(range(1, size)) - set(here))
    mask = np.zeros(size, dtype=np.int64)
    mask[missing] = 1
    _wait([comm.Isend(mask, dest=r, tag=REPORT_TAG) for r in here],
          _Clock(REPORT_LINGER_SECONDS))
    _stalled(stall_message(0, size, exchange.collective, exchange.state.calls, missing,
                           waited))


def _member_stalled(exchange, clock):
    """Any other rank after the stall time: wait up to one more stall time for rank 0's
    question and report (the exchange may still finish: then it returns the rows)."""
    if exchange.run(exchange.state.timeout):
        return exchange.rows
    comm, rank, size = exchange.comm, exchange.rank, exchange.size
    # rank 0, once it has asked, reports after waiting REPORT_LINGER_SECONDS for the answers
    answered = _Clock(3 * REPORT_LINGER_SECONDS)
    while exchange.asked and not comm.Iprobe(source=0, tag=REPORT_TAG) and answered.pause():
        pass
    if comm.Iprobe(source=0, tag=REPORT_TAG):
        mask = np.zeros(size, dtype=np.int64)
        comm.Recv(mask, source=0, tag=REPORT_TAG)
        _stalled(stall_message(rank, size, exchange.collective, exchange.state.calls,
                               np.flatnonzero(mask), clock.waited(), reported_by=0))
    if exchange.asked:
        _stalled(f"[fleetmpi] stall: rank {rank}/{size} has waited {clock.waited():.1f} s in "
                 f"{exchange.collective}, call #{exchange.state.calls} of its communicator; "
                 f"rank 0 asked who had arrived but sent no report; aborting the job")
    _stalled(stall_message(rank, size, exchange.collective, exchange.state.calls, None,
                           clock.waited()))


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
    exchange = _Exchange(comm, rows, collective, state)
    if exchange.run(state.timeout):
        return rows
    if rank == 0:
        if exchange.table is None:
            _root_stalled(exchange, clock.waited())
        _wait([exchange.table], _Clock(math.inf))
        return rows
    return _member_stalled(exchange, clock)

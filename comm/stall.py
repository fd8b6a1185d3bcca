"""The agreement's exchange of rows, polled, and watched by the stall watchdog.

Every checked collective starts with the agreement (``fleetmpi.comm.agreement``), and
``fleet.barrier_worker()`` and ``checkpoint.save`` are such an exchange alone. A blocking
``Allgather`` would keep a core busy while it waits; here the rows travel in requests that are
polled, up a binomial tree and back down:

* rank ``r`` collects the rows of its subtree (ranks ``r .. r + lowbit(r) - 1``) from its
  children ``r + 1, r + 2, r + 4, ...`` (below ``lowbit(r)``), then sends them to its parent
  ``r - lowbit(r)`` with ``Issend``;
* rank 0, the root, holds every row once its children are in, and ``Ibcast`` hands the table
  to all. Each rank receives from at most ``ceil(log2 P)`` children and sends once: the
  exchange is O(log P) messages per rank.

An exchange that is not part of a collective already being watched (a ``Communicator``'s
call) is a call of its communicator's ``Watch``: a rank that never arrives is reported by the
watchdog (``fleetmpi.comm.watchdog``), naming the ranks missing and where they are.

Waiting first spins (yielding the core to other processes) for ``SPIN_SECONDS``, then sleeps
in growing steps up to ``SLEEP_MAX_SECONDS``, so ranks waiting on an oversubscribed machine do
not take the CPU from the rank they are waiting for.
"""
import os
import time

import numpy as np

from .watchdog import watch_of

ROW_TAG = 101
SPIN_SECONDS = 1e-3
SLEEP_MIN_SECONDS = 50e-6
SLEEP_MAX_SECONDS = 1e-3

_keyval = None


class _CallState:
    """What one communicator remembers between agreements, cached on it as an MPI attribute:
    how many exchanges it made."""

    def __init__(self):
        self.calls = 0


def call_state(comm):
    """This communicator's ``_CallState`` (its exchange counter)."""
    global _keyval
    if _keyval is None:
        from mpi4py import MPI

        _keyval = MPI.Comm.Create_keyval()
    state = comm.Get_attr(_keyval)
    if state is None:
        state = _CallState()
        comm.Set_attr(_keyval, state)
    return state


class _Pacer:
    """Paces a polling loop: spins, yielding the core, then sleeps in growing steps."""

    def __init__(self):
        self.start = time.monotonic()
        self.sleep = SLEEP_MIN_SECONDS

    def pause(self):
        if time.monotonic() - self.start < SPIN_SECONDS:
            os.sched_yield()
        else:
            time.sleep(self.sleep)
            self.sleep = min(2 * self.sleep, SLEEP_MAX_SECONDS)


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


def _exchange(comm, rows):
    """Fill ``rows`` (one row per rank, this rank's filled) up the tree and back down."""
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    requests = [comm.Irecv(rows[c:c + subtree_size(c, size)], source=c, tag=ROW_TAG)
                for c in tree_children(rank, size)]
    pacer = _Pacer()
    while not MPI.Request.Testall(requests):
        pacer.pause()
    requests = []
    if rank:
        mine = rows[rank:rank + subtree_size(rank, size)]
        requests.append(comm.Issend(mine, dest=tree_parent(rank), tag=ROW_TAG))
    requests.append(comm.Ibcast(rows, root=0))
    while not MPI.Request.Testall(requests):
        pacer.pause()


def gather_rows(comm, row, collective):
    """Every rank's ``row`` (an int64 vector) stacked in rank order, on every rank; a call of
    ``comm``'s watch unless a watched call is in flight there already (module docstring)."""
    call_state(comm).calls += 1
    rank, size = comm.Get_rank(), comm.Get_size()
    rows = np.empty((size, len(row)), dtype=np.int64)
    rows[rank] = row
    if size == 1:
        return rows
    watch = watch_of(comm)
    entered = watch.enter((collective, collective))
    try:
        _exchange(comm, rows)
    finally:
        if entered:
            watch.ended += 1
    return rows

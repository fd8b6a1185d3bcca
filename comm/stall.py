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
import sys
import time

import numpy as np

from fleetmpi.core.knobs import CHECK_COLLECTIVES
from .stall_report import call_site, call_text
from .watchdog import watch_of

ROW_TAG = 101
# gather_rows' head (a row's width, then its collective's name) and the row's words that travel
# with it; the words of a call's arguments and of its call site named when the heads differ.
HEAD = 4
INLINE = 12
SITE_WORDS = 12
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


class CollectiveMismatchError(ValueError):
    """Raised on every rank when the ranks called a collective with different arguments, or
    reached different collectives."""


def _head(width, collective):
    """A row's head: its width, then the collective's name in ``HEAD - 1`` words."""
    head = np.zeros(HEAD, dtype=np.int64)
    name = collective.encode()[:8 * (HEAD - 1)]
    head[0] = width
    head[1:].view(np.uint8)[:len(name)] = np.frombuffer(name, dtype=np.uint8)
    return head


def _words(text, count):
    """``text`` in ``count`` int64 words (cut to fit)."""
    words = np.zeros(count, dtype=np.int64)
    data = text.encode()[:8 * count]
    words.view(np.uint8)[:len(data)] = np.frombuffer(data, dtype=np.uint8)
    return words


def _text(words):
    return bytes(words.view(np.uint8)).rstrip(b"\0").decode(errors="replace")


def each_call(comm, frame):
    """Every rank's current call on ``comm`` as its watch holds it: ``(number, arguments, call
    site)`` per rank, in rank order, after one more exchange (what a mismatch report names;
    ``frame``: where this rank's call site is looked for, outwards). Marks the watch
    ``diverged``: it is asked only once the ranks are known to differ."""
    size, rank = comm.Get_size(), comm.Get_rank()
    watch = watch_of(comm)
    watch.diverged = True
    calls = np.zeros((size, 1 + 2 * SITE_WORDS), dtype=np.int64)
    calls[rank, 0] = watch.started
    calls[rank, 1:1 + SITE_WORDS] = _words(call_text(watch.what), SITE_WORDS)
    calls[rank, 1 + SITE_WORDS:] = _words(call_site(frame), SITE_WORDS)
    _exchange(comm, calls)
    return [(int(c[0]), _text(c[1:1 + SITE_WORDS]), _text(c[1 + SITE_WORDS:])) for c in calls]


def _different_calls(comm, heads):
    """The error every rank raises when the ranks reached different exchanges, naming each
    rank's call (``each_call``).

    Besides a skipped or added collective, this is how a repeated call whose arguments changed
    on some ranks shows: a call whose arguments every rank has agreed on before in the same
    place skips the agreement (``fleetmpi.comm.call_checks``), so the ranks whose call repeats
    meet the others' agreement in the exchange of the call's own layout (the first dimensions
    an ``allgather`` or ``gather`` exchanges) or in their next one."""
    calls = each_call(comm, sys._getframe(1))
    said = "; ".join(f"rank {r}: {text}, call #{number} (at {site})"
                     for r, (number, text, site) in enumerate(calls))
    names = {_text(head[1:HEAD]) for head in heads}
    numbers = {number for number, _, _ in calls}
    agree = f"{CHECK_COLLECTIVES.name}=always makes every call agree"
    if len(names) == 1 and len(numbers) == 1:
        return CollectiveMismatchError(
            f"{names.pop()} call #{numbers.pop()} called with different arguments across "
            f"ranks: {said}. A repeated call skips the agreement on its arguments, so this "
            f"call, whose arguments changed on some ranks, met a call of the same arguments as "
            f"before on the others ({agree})")
    repeated = (f", or made a repeated call with other arguments than the others (a repeated "
                f"call skips the agreement on its arguments; {agree})" if len(numbers) > 1
                else "")
    return CollectiveMismatchError(
        f"the ranks reached different collectives: {said}. A rank skipped or added a "
        f"collective (one inside a caught exception, or in a branch only some ranks take)"
        f"{repeated}; every rank must call the same collectives in the same order")


def gather_rows(comm, row, collective):
    """Every rank's ``row`` (an int64 vector) stacked in rank order, on every rank; a call of
    ``comm``'s watch unless a watched call is in flight there already (module docstring).

    Each rank's row travels behind a head naming the collective and the row's width, with
    the first ``INLINE`` words of the row, so that ranks that reached different calls (a
    barrier on one, a checkpoint's exchange on another) raise ``CollectiveMismatchError``
    naming each call and where the script made it, instead of receiving rows of the wrong
    size (MPI's truncation error) or of another call; a longer row follows in a second
    exchange."""
    call_state(comm).calls += 1
    rank, size = comm.Get_rank(), comm.Get_size()
    row = np.asarray(row, dtype=np.int64)
    if size == 1:
        return row[None, :].copy()
    first = np.zeros((size, HEAD + INLINE), dtype=np.int64)
    first[rank, :HEAD] = _head(len(row), collective)
    first[rank, HEAD:HEAD + min(len(row), INLINE)] = row[:INLINE]
    watch = watch_of(comm)
    entered = watch.enter((collective, collective))
    try:
        _exchange(comm, first)
        if (first[:, :HEAD] != first[rank, :HEAD]).any():
            raise _different_calls(comm, first)
        if len(row) <= INLINE:
            return first[:, HEAD:HEAD + len(row)].copy()
        rows = np.empty((size, len(row)), dtype=np.int64)
        rows[rank] = row
        _exchange(comm, rows)
        return rows
    finally:
        if entered:
            watch.ended += 1

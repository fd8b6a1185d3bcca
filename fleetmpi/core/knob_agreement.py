"""Every rank started with the same values of ``knobs.AGREED``, checked once at ``fleet.init``.

Ranks started with different ``FLEETMPI_CHECK_COLLECTIVES`` values deadlocked at their first
collective (one rank waits in the argument agreement's exchange, the other in the reduction),
and were reported 600 s later as a stall that named no cause. So ``check`` gathers each rank's
text of every agreed variable (one allgather of a few hundred bytes, no pickle) and raises on
every rank, naming each variable that differs and which ranks hold which value.
"""
import hashlib
import os

import numpy as np

from .knobs import AGREED

# The bytes each rank sends of a variable: the first bytes of its text, to show, then a digest
# of the value it parses to, to compare (unset and the default's text agree; a set's order
# does not count).
SHOWN = 56
DIGEST = 8


class KnobMismatchError(RuntimeError):
    """The ranks were started with different values of a variable they must share."""


def _meaning(knob, environ):
    """What the variable's value means, as text; a value the knob refuses stands for itself
    here (the rank raises naming it when it reads the knob)."""
    try:
        value = knob.value(environ)
    except ValueError:
        return "refused " + environ.get(knob.name, "")
    return repr(sorted(value)) if isinstance(value, (set, frozenset)) else repr(value)


def _row(knob, environ):
    shown = environ.get(knob.name, "").encode("utf-8")[:SHOWN]
    row = np.zeros(SHOWN + DIGEST, dtype=np.uint8)
    row[:len(shown)] = np.frombuffer(shown, dtype=np.uint8)
    meaning = _meaning(knob, environ).encode("utf-8")
    row[SHOWN:] = np.frombuffer(hashlib.blake2b(meaning, digest_size=DIGEST).digest(), np.uint8)
    return row


def _shown(row):
    text = bytes(row[:SHOWN]).rstrip(b"\0").decode("utf-8", errors="replace")
    return repr(text) if text else "unset"


def differences(every, knobs=AGREED):
    """``[(variable name, {shown value: [ranks]})]`` of the variables whose meanings differ
    between ranks in ``every`` (ranks x knobs x bytes)."""
    found = []
    for index, knob in enumerate(knobs):
        rows = every[:, index]
        if (rows[:, SHOWN:] == rows[0, SHOWN:]).all():
            continue
        holders = {}
        for rank, row in enumerate(rows):
            holders.setdefault(_shown(row), []).append(rank)
        found.append((knob.name, holders))
    return found


def check(comm, environ=os.environ, knobs=AGREED):
    """Raise ``KnobMismatchError`` on every rank of the mpi4py ``comm`` when the ranks' texts
    of ``knobs`` differ; collective over ``comm``."""
    size = comm.Get_size()
    if size == 1:
        return
    mine = np.stack([_row(knob, environ) for knob in knobs])
    every = np.empty((size,) + mine.shape, dtype=np.uint8)
    comm.Allgather(mine, every)
    found = differences(every, knobs)
    if found:
        said = "; ".join(
            f"{name} is " + ", ".join(f"{value} on rank(s) {', '.join(map(str, ranks))}"
                                      for value, ranks in holders.items())
            for name, holders in found)
        raise KnobMismatchError(
            f"the ranks were started with different settings that decide which collectives "
            f"each rank calls: {said}. Start every rank with the same value of each (the "
            f"variables of every rank's environment; mpiexec and fleetmpirun pass theirs on)")

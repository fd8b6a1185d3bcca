"""Agreement on a collective's arguments before any data moves.

Every checked collective first allgathers a short vector of integers describing the call
(which collective, op, algorithm, compression, root, dtype, element count, number of arrays, a
checksum of all shapes and dtypes, whether the arguments passed this rank's own checks, and
the running hash of the calls since the last exchange). If the vectors differ, or some rank
rejected its arguments, every rank raises ``CollectiveMismatchError`` instead of entering a
transfer whose sizes do not match, which would hang or return garbage. The cost is one small
gather to rank 0 up a binomial tree and a broadcast back per call (per ``allreduce_many``/
``broadcast_many`` call, not per array), polled so that a rank that never arrives is reported instead of waited for
forever (``fleetmpi.comm.stall``).

Which calls are checked is the communicator's choice (``FLEETMPI_CHECK_COLLECTIVES``): every
call, or only a call whose arguments this rank has not seen agreed before; the others add their
row to the running hash that the next exchange compares.
"""
import sys
import zlib

import numpy as np

from .stall import CollectiveMismatchError, each_call, gather_rows

FIELDS = ("collective", "op", "algorithm", "compression", "root", "dtype", "count", "arrays",
          "shapes", "unchecked", "history", "rejected")
_REJECTED = FIELDS.index("rejected")


def _dtype_names():
    names = {}
    for t in set(np.sctypeDict.values()):
        d = np.dtype(t)
        names.setdefault(d.num, str(d))
    return names


_DTYPE_NAMES = _dtype_names()


def dtype_name(num):
    """The name of the NumPy dtype whose ``dtype.num`` is ``num``."""
    return _DTYPE_NAMES.get(num, f"dtype #{num}")


def describe_arrays(arrays):
    """(dtype code, total element count, number of arrays, checksum of shapes and dtypes)."""
    text = ";".join(f"{a.dtype.str}{tuple(a.shape)}" for a in arrays)
    dtype = arrays[0].dtype.num if arrays and all(a.dtype == arrays[0].dtype for a in arrays) else -1
    return dtype, sum(int(a.size) for a in arrays), len(arrays), zlib.crc32(text.encode())


def _code(value, table):
    return table.index(value) if value in table else -1


def _decode(field, value, tables):
    if field == "dtype":
        return "mixed" if value == -1 else dtype_name(value)
    if field in tables:
        table = tables[field]
        return repr(table[value]) if 0 <= value < len(table) else "invalid"
    return str(value)


def describe_shapes(arrays):
    """Each array's dtype and shape, as a mismatch report prints them: ``float32 (2, 3)``."""
    return ", ".join(f"{a.dtype} {tuple(a.shape)}" for a in arrays) or "no arrays"


def call_row(collective, tables, problem=None, **fields):
    """The agreement row of one call: ``FIELDS`` as integers (see ``agree``)."""
    values = []
    for name in FIELDS:
        if name == "collective":
            values.append(_code(collective, tables["collective"]))
        elif name == "rejected":
            values.append(int(problem is not None))
        elif name in tables:
            values.append(_code(fields.get(name), tables[name]))
        else:
            values.append(int(fields.get(name, 0)))
    return np.array(values, dtype=np.int64)


def row_code(row):
    """A number that stands for one agreed row, the same on every rank: what the running hash
    of the calls that skip the exchange is made of."""
    return zlib.crc32(row.tobytes())


HISTORY_PRIME = 1000003
HISTORY_MASK = 0x7FFFFFFFFFFFFFFF


def history_step(history, code):
    """The running hash after one more unchecked call whose row had ``code``."""
    return (history * HISTORY_PRIME + code) & HISTORY_MASK


def agree(comm, collective, tables, problem=None, described=(), layout=None, **fields):
    """Gather this call's description from every rank of the MPI ``comm``; raise on every rank
    if ranks differ, abort the job if some do not arrive (``fleetmpi.comm.stall``).

    ``tables`` maps field names (``collective``, ``op``, ...) to the tuple of allowed values;
    values are sent as their index. ``fields`` holds the raw values for this rank. ``problem``
    is the exception this rank's own argument checks produced, if any: it is raised here, after
    the other ranks have learnt that this rank rejected the call. When the shapes differ, every
    rank's dtypes and shapes (of the arrays ``described``) and ``layout`` are exchanged once
    more, so that the error prints them instead of their checksum. ``unchecked`` and
    ``history``: how many calls skipped the exchange since the last one, and the running hash
    of their rows (``history_step``); ranks that differ there called different collectives in
    between.
    """
    rows = gather_rows(comm, call_row(collective, tables, problem, **fields), collective)
    if problem is None and (rows == rows[0]).all():
        return
    rejecters = np.flatnonzero(rows[:, _REJECTED])
    if len(rejecters):
        if problem is not None:
            raise problem
        raise CollectiveMismatchError(
            f"{collective} aborted: rank(s) {', '.join(map(str, rejecters))} rejected their "
            f"arguments (their error says why)")
    differing = np.flatnonzero((rows != rows[0]).any(axis=0))
    if len(differing):
        calls = "; ".join(f"rank {r}: call #{number} at {site}"
                          for r, (number, _, site) in enumerate(each_call(comm,
                                                                          sys._getframe(1))))
        shapes = None
        if FIELDS.index("shapes") in differing:
            text = describe_shapes(described)
            shapes = comm.allgather(text if layout is None else f"{text}, counts {list(layout)}")
        parts = []
        for i in differing:
            seen = ", ".join(f"rank {r}: " + (shapes[r] if FIELDS[i] == "shapes" else
                                              _decode(FIELDS[i], int(rows[r, i]), tables))
                             for r in range(len(rows)))
            parts.append(f"{FIELDS[i]} differ{'' if FIELDS[i] == 'shapes' else 's'} ({seen})")
        diverged = any(FIELDS[i] in ("unchecked", "history") for i in differing)
        raise CollectiveMismatchError(
            f"{collective} called with different arguments across ranks: " + "; ".join(parts)
            + ("; the ranks called different collectives since the last call whose arguments "
               "were exchanged (a call whose arguments every rank has agreed on before skips "
               "the exchange; FLEETMPI_CHECK_COLLECTIVES=always checks every call)"
               if diverged else "") + f" (each rank's call of this communicator: {calls})")

"""A collective's argument checks and the agreement on them across ranks, before data moves.

Each collective runs its local checks (``check_array``, ``check_reduction``, ...) inside
``capture``, so that a rejected argument becomes the ``problem`` that ``CallAgreement.agree``
spreads: every rank then raises, instead of the others entering a transfer that never
completes. An ``algorithm=`` argument is checked against the algorithms registered for the
collective (``registry``), and the algorithm itself says whether it takes the call
(``Algorithm.refusal``, ``check_takes``). The checks read the communicator through its
``AlgorithmContext`` (``ctx``).
"""
import numbers
import zlib

import numpy as np

from . import agreement, registry
from .agreement import call_row, describe_arrays, history_step, row_code
from .compression import COMPRESSIONS, check_compression
from .ops import OPS, check_dtype, check_op, is_device_array

COLLECTIVES = ("allreduce", "allreduce_many", "broadcast", "broadcast_many", "allgather",
               "reduce_scatter", "barrier", "allgatherv", "alltoall", "gather", "scatter")
# The values each coded field of an agreement row can take (``agreement.call_row``).
TABLES = {
    "collective": COLLECTIVES,
    "op": (None,) + OPS,
    "algorithm": registry.NAMES,
    "compression": COMPRESSIONS,
}


def capture(check):
    """Run ``check``; return the exception it raised, or None."""
    try:
        check()
    except (TypeError, ValueError) as exc:
        return exc
    return None


def check_positive(name, value, kind=numbers.Real):
    """``value``, a positive number (an integer when ``kind`` is ``numbers.Integral``)."""
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive "
                         f"{'integer' if kind is numbers.Integral else 'number'}")
    return value


def check_array(ctx, x, name="x", writable=False):
    if not (isinstance(x, np.ndarray) or is_device_array(x)):
        raise TypeError(f"{name} must be a NumPy or CuPy array, not {type(x).__name__}")
    if x.dtype.kind not in "biufc":
        raise TypeError(f"{name} has dtype {x.dtype}; collectives move numeric arrays only")
    if ctx.transport_name == "nccl" and not is_device_array(x):
        raise TypeError(f"{name} is a NumPy array, but transport 'nccl' moves CuPy arrays; "
                        f"use transport='mpi' for host arrays")
    if writable and isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError(f"{name} is read-only; this collective writes into it")


def check_arrays(ctx, arrays, name="arrays"):
    if not isinstance(arrays, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of arrays, not {type(arrays).__name__}")
    for i, a in enumerate(arrays):
        check_array(ctx, a, f"{name}[{i}]", writable=True)
    if len({is_device_array(a) for a in arrays}) > 1:
        raise TypeError(f"{name} mixes NumPy and CuPy arrays; pass one kind per call")


def check_root(ctx, root):
    if isinstance(root, bool) or not isinstance(root, numbers.Integral) \
            or not 0 <= root < ctx.size:
        raise ValueError(f"root={root!r} must be a rank in 0..{ctx.size - 1}")


def check_peer(ctx, peer, name):
    if isinstance(peer, bool) or not isinstance(peer, numbers.Integral) \
            or not 0 <= peer < ctx.size or peer == ctx.rank:
        raise ValueError(f"{name}={peer!r} must be another rank: one of 0..{ctx.size - 1} "
                         f"other than this rank {ctx.rank}")


def check_algorithm(ctx, collective, algorithm):
    """The registered algorithm ``algorithm`` of ``collective``, checked to run on this
    communicator (``check_takes``); None for None (the table chooses)."""
    if algorithm is None:
        return None
    chosen = registry.lookup(collective, algorithm)
    check_takes(ctx, chosen)
    return chosen


def check_takes(ctx, algorithm, dtypes=(), op=None, compression=None):
    """Raise unless ``algorithm`` takes a call of ``op`` on ``dtypes`` with ``compression``
    on this communicator: what the algorithm states it supports."""
    if compression not in algorithm.compressions:
        carriers = [a.name for a in registry.algorithms_of(algorithm.collective)
                    if compression in a.compressions]
        raise ValueError(f"compression={compression!r} needs algorithm "
                         f"{' or '.join(map(repr, carriers))}; {algorithm.name!r} reduces in "
                         f"the array's own dtype")
    reason = algorithm.refusal(ctx, dtypes, op)
    if reason is not None:
        raise ValueError(reason)


def check_reduction(ctx, collective, dtypes, op, algorithm, compression):
    """A reduction's ``op``, ``dtypes`` and ``compression``, and that the algorithm it names
    (None: the table's) takes them."""
    check_op(op)
    chosen = None if algorithm is None else registry.lookup(collective, algorithm)
    for dtype in dtypes:
        check_dtype(dtype)
        check_compression(compression, dtype)
    if chosen is not None:
        check_takes(ctx, chosen, [np.dtype(d) for d in dtypes], op, compression)


def check_parts(algorithm, rows):
    """Raise when ``algorithm`` (None: the table's) takes equal parts only and the ranks'
    first dimensions ``rows`` differ."""
    if algorithm is not None and algorithm.equal_parts and len(set(rows)) > 1:
        raise ValueError(f"algorithm={algorithm.name!r} gathers equal shapes, but the ranks' "
                         f"first dimensions are {rows}; use algorithm=None")


def check_counts(ctx, counts, total=None, what=None):
    """``counts`` as a list of ``size`` non-negative integers (adding up to ``total``, the
    size of ``what``, when given)."""
    if (not isinstance(counts, (list, tuple)) or len(counts) != ctx.size
            or not all(isinstance(c, numbers.Integral) and not isinstance(c, bool)
                       and c >= 0 for c in counts)):
        raise ValueError(f"counts={counts!r} must be a list of {ctx.size} non-negative "
                         f"integers, one per rank")
    if total is not None and sum(counts) != total:
        raise ValueError(f"counts={list(counts)!r} add up to {sum(counts)}, but {what} "
                         f"is {total}")


class CallAgreement:
    """The agreement of one communicator's calls (over ``control``, its MPI communicator for
    the exchange, as ``check`` asks: ``Communicator``'s ``check``) and its bookkeeping:
    ``agreed`` (the row code of each call agreed before, by key), ``previous`` (the code of
    the previous call, -1 after one that raised), ``unchecked`` and ``history`` (the count and
    running hash of the calls made since the last exchange without one).
    ``Communicator.allreduce`` updates the last three itself on its repeated path, where a
    call more per repeat would show."""

    def __init__(self, control, check):
        self.control = control
        self.check = check
        self.agreed = {}
        self.previous = -1
        self.unchecked = 0
        self.history = 0

    def agree(self, collective, arrays, problem, layout, fields, described=None):
        """Check that every rank called ``collective`` alike; ``layout`` (a tuple of integers
        every rank must agree on, such as per-rank counts) joins the shapes' checksum;
        ``described`` (``arrays`` when None) is what a mismatch report prints.

        With ``check=True`` a call whose arguments this rank has seen agreed before, right
        after the same call as now (a step's sequence of calls repeats), makes no exchange: it
        adds its row's code to the running hash that the next exchange compares
        (``fleetmpi.comm.agreement``). So a mismatch at a call no rank has made before in that
        place raises on every rank at that call; ranks that go different ways among calls
        made before are told at the next new call; and a rank that goes on to a new call (or
        rejects its arguments) while the others repeat an old one waits in the exchange until
        the stall inspector reports it. ``check="always"`` exchanges at every call."""
        if not self.check:
            if problem is not None:
                raise problem
            return
        key = None
        if problem is None and self.check is True:
            key = (self.previous, collective, layout, tuple(fields.items()),
                   tuple((a.dtype.num, a.shape) for a in arrays))
            code = self.agreed.get(key)
            if code is not None:
                self.skip(code)
                return
        if problem is None:
            dtype, count, n, shapes = describe_arrays(arrays)
            if layout is not None:
                shapes = zlib.crc32(repr(tuple(layout)).encode(), shapes)
            fields.update(dtype=dtype, count=count, arrays=n, shapes=shapes)
        unchecked, history = self.unchecked, self.history
        self.forget()
        agreement.agree(self.control, collective, TABLES, problem,
                        arrays if described is None else described, layout,
                        unchecked=unchecked, history=history, **fields)
        if key is not None:
            self.previous = self.agreed[key] = row_code(call_row(collective, TABLES,
                                                                 **fields))

    def forget(self):
        """Start afresh, as every rank does after a call that raised (or before an exchange):
        no previous call, nothing unchecked."""
        self.unchecked = self.history = 0
        self.previous = -1

    def skip(self, code):
        """Account for a call that repeats an agreed one (its row's ``code``) without an
        exchange: the next exchange compares the count and the running hash."""
        if self.check:
            self.unchecked += 1
            self.history = history_step(self.history, code)
            self.previous = code

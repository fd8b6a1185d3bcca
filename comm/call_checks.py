"""A collective's argument checks and the agreement on them across ranks, before data moves.

Each collective runs its local checks (``check_array``, ``check_allreduce``, ...) inside
``capture``, so that a rejected argument becomes the ``problem`` that ``agree`` spreads: every
rank then raises, instead of the others entering a transfer that never completes.

The functions take the communicator and keep their bookkeeping on it: ``_agreed`` (the row
code of each call agreed before, by key), ``_previous`` (the code of the previous call, -1
after one that raised), ``_unchecked`` and ``_history`` (the count and running hash of the
calls made since the last exchange without one). ``Communicator.allreduce`` updates the last
three itself on its repeated path, where an attribute more per call would show.
"""
import numbers
import zlib

import numpy as np

from . import agreement
from .agreement import call_row, describe_arrays, history_step, row_code
from .algorithm_choice import ALLREDUCE_ALGORITHMS, BROADCAST_ALGORITHMS
from .compression import COMPRESSIONS, check_compression
from .ops import OPS, check_dtype, check_op, is_device_array

COLLECTIVES = ("allreduce", "allreduce_many", "broadcast", "broadcast_many", "allgather",
               "reduce_scatter", "barrier", "allgatherv", "alltoall", "gather", "scatter")
# The values each coded field of an agreement row can take (``agreement.call_row``).
TABLES = {
    "collective": COLLECTIVES,
    "op": (None,) + OPS,
    "algorithm": (None,) + ALLREDUCE_ALGORITHMS + BROADCAST_ALGORITHMS[:2],
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


def check_array(comm, x, name="x", writable=False):
    if not (isinstance(x, np.ndarray) or is_device_array(x)):
        raise TypeError(f"{name} must be a NumPy or CuPy array, not {type(x).__name__}")
    if x.dtype.kind not in "biufc":
        raise TypeError(f"{name} has dtype {x.dtype}; collectives move numeric arrays only")
    if comm.transport_name == "nccl" and not is_device_array(x):
        raise TypeError(f"{name} is a NumPy array, but transport 'nccl' moves CuPy arrays; "
                        f"use transport='mpi' for host arrays")
    if writable and isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError(f"{name} is read-only; this collective writes into it")


def check_arrays(comm, arrays, name="arrays"):
    if not isinstance(arrays, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of arrays, not {type(arrays).__name__}")
    for i, a in enumerate(arrays):
        check_array(comm, a, f"{name}[{i}]", writable=True)
    if len({is_device_array(a) for a in arrays}) > 1:
        raise TypeError(f"{name} mixes NumPy and CuPy arrays; pass one kind per call")


def check_root(comm, root):
    if isinstance(root, bool) or not isinstance(root, numbers.Integral) \
            or not 0 <= root < comm.size:
        raise ValueError(f"root={root!r} must be a rank in 0..{comm.size - 1}")


def check_peer(comm, peer, name):
    if isinstance(peer, bool) or not isinstance(peer, numbers.Integral) \
            or not 0 <= peer < comm.size or peer == comm.rank:
        raise ValueError(f"{name}={peer!r} must be another rank: one of 0..{comm.size - 1} "
                         f"other than this rank {comm.rank}")


def check_algorithm(algorithm, allowed, collective):
    """``algorithm`` is None or one of ``allowed``, the algorithms of ``collective``."""
    if algorithm is not None and algorithm not in allowed:
        article = "an" if collective[0] in "aeiou" else "a"
        raise ValueError(f"algorithm={algorithm!r} is not {article} {collective} algorithm; "
                         f"allowed: None, {', '.join(map(repr, allowed))}")


def check_allreduce(comm, dtypes, op, algorithm, compression):
    check_op(op)
    check_algorithm(algorithm, ALLREDUCE_ALGORITHMS, "allreduce")
    for dtype in dtypes:
        check_dtype(dtype)
        check_compression(compression, dtype)
    if compression is not None and algorithm in ("native", "shm"):
        raise ValueError(f"compression={compression!r} needs algorithm 'ring' or "
                         f"'hierarchical'; {algorithm!r} reduces in the array's own dtype")
    if algorithm == "shm" and not comm._single_node():
        raise ValueError("algorithm='shm' needs the MPI transport and all ranks on one node "
                         f"(this job: transport {comm.transport_name!r}, "
                         f"{comm.topology.num_nodes} node(s))")


def check_counts(comm, counts, total=None, what=None):
    """``counts`` as a list of ``size`` non-negative integers (adding up to ``total``, the
    size of ``what``, when given)."""
    if (not isinstance(counts, (list, tuple)) or len(counts) != comm.size
            or not all(isinstance(c, numbers.Integral) and not isinstance(c, bool)
                       and c >= 0 for c in counts)):
        raise ValueError(f"counts={counts!r} must be a list of {comm.size} non-negative "
                         f"integers, one per rank")
    if total is not None and sum(counts) != total:
        raise ValueError(f"counts={list(counts)!r} add up to {sum(counts)}, but {what} "
                         f"is {total}")


def agree(comm, collective, arrays, problem, layout, fields, described=None):
    """Check that every rank called ``collective`` alike; ``layout`` (a tuple of integers
    every rank must agree on, such as per-rank counts) joins the shapes' checksum;
    ``described`` (``arrays`` when None) is what a mismatch report prints.

    With ``check=True`` a call whose arguments this rank has seen agreed before, right after
    the same call as now (a step's sequence of calls repeats), makes no exchange: it adds its
    row's code to the running hash that the next exchange compares
    (``fleetmpi.comm.agreement``). So a mismatch at a call no rank has made before in that
    place raises on every rank at that call; ranks that go different ways among calls made
    before are told at the next new call; and a rank that goes on to a new call (or rejects
    its arguments) while the others repeat an old one waits in the exchange until the stall
    inspector reports it. ``check="always"`` exchanges at every call."""
    if not comm.check:
        if problem is not None:
            raise problem
        return
    key = None
    if problem is None and comm.check is True:
        key = (comm._previous, collective, layout, tuple(fields.items()),
               tuple((a.dtype.num, a.shape) for a in arrays))
        code = comm._agreed.get(key)
        if code is not None:
            skip_agreement(comm, code)
            return
    if problem is None:
        dtype, count, n, shapes = describe_arrays(arrays)
        if layout is not None:
            shapes = zlib.crc32(repr(tuple(layout)).encode(), shapes)
        fields.update(dtype=dtype, count=count, arrays=n, shapes=shapes)
    unchecked, history = comm._unchecked, comm._history
    comm._unchecked = comm._history = 0
    comm._previous = -1  # what every rank holds after a call that raised
    agreement.agree(comm._control, collective, TABLES, problem,
                    arrays if described is None else described, layout,
                    unchecked=unchecked, history=history, **fields)
    if key is not None:
        comm._previous = comm._agreed[key] = row_code(call_row(collective, TABLES, **fields))


def skip_agreement(comm, code):
    """Account for a call that repeats an agreed one (its row's ``code``) without an
    exchange: the next exchange compares the count and the running hash."""
    if comm.check:
        comm._unchecked += 1
        comm._history = history_step(comm._history, code)
        comm._previous = code

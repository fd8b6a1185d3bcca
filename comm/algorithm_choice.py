"""Which algorithm a collective runs when the caller leaves ``algorithm=None``: one table.

Each row of ``CHOICES`` names a collective, the request it applies to (the communicator's
``use_hierarchical_allreduce``, a ``compression``, or neither), the transport, the topology,
a range of flat-buffer sizes, the algorithm and why. ``choose`` returns the first row that
matches a call. ``TIMED`` in a row's algorithm is not an algorithm but an input: the
communicator times ring against shm once (``time_ring_against_shm``), on the first call that
needs it, and runs the faster (``Communicator.allreduce_algorithm``). ``python -m
fleetmpi.comm`` prints the table, and under ``mpiexec`` what this world chooses.

Collectives not in the table run one algorithm unless asked otherwise: allgather,
allgatherv and reduce_scatter the ring, alltoall pairwise, gather and scatter linear, barrier
the dissemination barrier.
"""
import time
from collections import namedtuple

import numpy as np
from mpi4py import MPI

ALLREDUCE_ALGORITHMS = ("ring", "hierarchical", "native", "shm")
BROADCAST_ALGORITHMS = ("tree", "chain", "native")
GATHER_ALGORITHMS = ("ring", "native")

# The library's own allreduce below this size, where a call's fixed cost (argument agreement,
# Python) outweighs the transfer; ours above (measured, benchmarks/).
NATIVE_BELOW_BYTES = 1 << 20
# Broadcast: the binomial tree up to this size, where latency dominates; the chain above.
TREE_MAX_BYTES = 64 << 10
TIMED = "timed"
# The buffer on which ``time_ring_against_shm`` times the two, and how often (the best counts).
PROBE_BYTES = 4 << 20
PROBE_REPEATS = 3

ANY = "any"
# Requests: what the communicator or the call asks for besides the size.
HIERARCHICAL, COMPRESSED, PLAIN = "use_hierarchical_allreduce", "compression", "plain"
# Topologies, as ``topology_of`` names a world.
ONE_NODE, ONE_RANK, NODES = "one node", "one rank", "several nodes"

Row = namedtuple("Row", "collective request transport topology min_bytes max_bytes algorithm why")
Row.__doc__ = ("One choice: ``algorithm`` for a call that matches every other field; sizes "
               "from ``min_bytes`` up to, not including, ``max_bytes`` (None: no bound).")

CHOICES = (
    Row("allreduce", HIERARCHICAL, ANY, ANY, 0, None, "hierarchical",
        "asked for: within each node, then across nodes"),
    Row("allreduce", COMPRESSED, ANY, ANY, 0, None, "ring",
        "float16 on the wire needs our own reduction; the library's reduces in the array's dtype"),
    Row("allreduce", PLAIN, ANY, ANY, 0, NATIVE_BELOW_BYTES, "native",
        "a call's fixed cost outweighs the transfer; the library's own call is the cheapest"),
    Row("allreduce", PLAIN, "mpi", ONE_NODE, NATIVE_BELOW_BYTES, None, TIMED,
        "the faster of ring and shm, timed once: which wins depends on the memory system"),
    Row("allreduce", PLAIN, ANY, ANY, NATIVE_BELOW_BYTES, None, "ring",
        "bandwidth-optimal: each rank sends and receives about twice its buffer"),
    Row("broadcast", PLAIN, ANY, ANY, 0, TREE_MAX_BYTES + 1, "tree",
        "log2(ranks) steps, each with the whole buffer: few and cheap for small buffers"),
    Row("broadcast", PLAIN, ANY, ANY, TREE_MAX_BYTES + 1, None, "chain",
        "pipelined in chunks: every link busy at once for large buffers"),
)


def topology_of(size, local_size):
    """The topology a world of ``size`` ranks, ``local_size`` of them on this node, has in
    ``CHOICES``."""
    if size == 1:
        return ONE_RANK
    return ONE_NODE if local_size == size else NODES


def choose(collective, nbytes, transport, topology, compression=None, hierarchical=False):
    """The first row of ``CHOICES`` for a ``collective`` of ``nbytes`` bytes (its flat buffer)
    over ``transport`` (``"mpi"`` or ``"nccl"``) on ``topology`` (``topology_of``), with a
    ``compression`` and the communicator's ``use_hierarchical_allreduce``."""
    request = HIERARCHICAL if hierarchical else COMPRESSED if compression is not None else PLAIN
    for row in CHOICES:
        if (row.collective == collective and row.request == request
                and row.transport in (ANY, transport) and row.topology in (ANY, topology)
                and row.min_bytes <= nbytes
                and (row.max_bytes is None or nbytes < row.max_bytes)):
            return row
    raise LookupError(f"no algorithm for {collective} of {nbytes} bytes "
                      f"({request}, {transport}, {topology})")


def time_ring_against_shm(allreduce_flat, control):
    """``"ring"`` or ``"shm"``, whichever allreduced a ``PROBE_BYTES`` buffer faster (the best
    of ``PROBE_REPEATS``, the slowest rank's): what a row whose algorithm is ``TIMED`` runs.
    ``allreduce_flat(buf, op, algorithm, compression, index)`` reduces in place; ``control``:
    an MPI communicator of the same ranks, which combines the times.

    Which one wins depends on the machine's memory system: shm copies every byte into a
    shared window and out again, the ring sends half of it through MPI, and on the same 2-core
    machine shm measured 1.4x faster than the ring in one month and 2.5x slower in the next.
    Every rank calls this at the same collective (the choice happens after the agreement), and
    the times are combined by an MPI allreduce, so every rank chooses alike.
    """
    # Written values: a zero-filled array that was never written reads the kernel's one
    # shared zero page, which made shm's copies look cheap (4 MiB: shm 1.35 ms against the
    # ring's 1.6 in place, but 2.1 against 1.8 on written pages).
    probe = np.ones(PROBE_BYTES // 4, np.float32)
    best = np.full(2, np.inf)
    for _ in range(PROBE_REPEATS):
        for i, algorithm in enumerate(("ring", "shm")):
            start = time.perf_counter()
            allreduce_flat(probe, "sum", algorithm, None, 0)
            best[i] = min(best[i], time.perf_counter() - start)
    control.Allreduce(MPI.IN_PLACE, best, op=MPI.MAX)
    return "shm" if best[1] < best[0] else "ring"


def size_range(row):
    """``row``'s sizes in words, such as ``"< 1 MiB"``, ``"> 64 KiB"`` or ``"any"``."""
    bounds = []
    if row.min_bytes:
        bounds.append(f">= {_bytes(row.min_bytes)}" if _round(row.min_bytes)
                      else f"> {_bytes(row.min_bytes - 1)}")
    if row.max_bytes is not None:
        bounds.append(f"< {_bytes(row.max_bytes)}" if _round(row.max_bytes)
                      else f"<= {_bytes(row.max_bytes - 1)}")
    return ", ".join(bounds) or "any"


_UNITS = (("GiB", 30), ("MiB", 20), ("KiB", 10))


def _round(n):
    return any(n % (1 << shift) == 0 for _, shift in _UNITS)


def _bytes(n):
    for unit, shift in _UNITS:
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def table_text(rows=CHOICES):
    """``rows`` as an aligned text table, one line per row."""
    header = ("collective", "request", "transport", "topology", "bytes", "algorithm", "why")
    lines = [(r.collective, r.request, r.transport, r.topology, size_range(r), r.algorithm,
              r.why) for r in rows]
    widths = [max(len(line[i]) for line in [header] + lines) for i in range(len(header) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) + "  " + line[-1]
                     for line in [header] + lines)

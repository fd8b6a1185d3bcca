"""Which algorithm a collective runs when the caller leaves ``algorithm=None``: one table.

Each row of ``CHOICES`` names a collective, the request it applies to (the communicator's
``use_hierarchical_allreduce``, a ``compression``, neither, or ``any``), the transport, the
topology, a range of flat-buffer sizes, the algorithm and why. ``choose`` returns the first row
that matches a call. Every algorithm a row names is registered under that name for its
collective (``registry``), and runs what the row covers; ``dispatch`` looks it up there.
``TIMED`` in a row's algorithm is not an algorithm but an input: the communicator times ring
against shm once (``time_ring_against_shm``), on the first call that needs it, and runs the
faster (``dispatch.allreduce_algorithm``). ``python -m fleetmpi.comm`` prints the table, and
under ``mpiexec`` what this world chooses.
"""
import time
from collections import namedtuple

import numpy as np
from mpi4py import MPI

from .topology import ONE_NODE

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
    Row("allgather", ANY, ANY, ANY, 0, None, "ring",
        "parts of any length, each passed once around the ring; the library's needs equal parts"),
    Row("reduce_scatter", ANY, ANY, ANY, 0, None, "ring",
        "parts of any length, float16 on the wire with compression"),
    Row("alltoall", ANY, ANY, ANY, 0, None, "pairwise",
        "every rank sends and receives once per step, so no step waits on a chain"),
    Row("gather", ANY, ANY, ANY, 0, None, "linear", "the root receives one part per peer"),
    Row("scatter", ANY, ANY, ANY, 0, None, "linear", "the root sends one part per peer"),
    Row("send", ANY, ANY, ANY, 0, None, "p2p", "the transport's own transfer"),
    Row("recv", ANY, ANY, ANY, 0, None, "p2p", "the transport's own transfer"),
    Row("barrier", ANY, ANY, ANY, 0, None, "dissemination",
        "log2(ranks) rounds of one-byte exchanges over the transport itself"),
)
_ROWS_OF = {}  # CHOICES by collective, in order: a call scans only its own
for _row in CHOICES:
    _ROWS_OF.setdefault(_row.collective, []).append(_row)


def choose(collective, nbytes, transport, topology, compression=None, hierarchical=False):
    """The first row of ``CHOICES`` for a ``collective`` of ``nbytes`` bytes (its flat buffer)
    over ``transport`` (``"mpi"`` or ``"nccl"``) on ``topology`` (``topology.topology_of``),
    with a ``compression`` and the communicator's ``use_hierarchical_allreduce``."""
    request = HIERARCHICAL if hierarchical else COMPRESSED if compression is not None else PLAIN
    for row in _ROWS_OF.get(collective, ()):
        if (row.request in (ANY, request)
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

"""Alpha-beta costs of the collectives as ``fleetmpi.comm`` runs them, message by message.

Every transfer of ``m`` bytes over a link costs ``alpha + m * beta`` (``Link``); reducing ``m``
bytes into an accumulator of the same dtype costs ``m * gamma``; rounding ``m`` bytes of float32
to float16 costs ``m * cast``, and adding (or copying) ``m`` bytes of float16 into float32
``m * widen``. Each function counts the messages, bytes, reductions and casts of one
algorithm of the comm layer:

* ``ring_allreduce`` (``comm/ring.py``): a reduce-scatter of ``p - 1`` steps, each sending one
  segment of ``n / p`` bytes in ``chunk_bytes`` pieces (one ``sendrecv`` per piece) and adding
  what arrives, then an allgather of ``p - 1`` steps, one ``sendrecv`` of a segment each:
  ``(p - 1) * (ceil(s / chunk) + 1) * alpha + 2 (p - 1) / p * n * beta + (p - 1) / p * n * gamma``
  with ``s = n / p``; the mean divides the owned segment (``n / p * gamma``).
* ``hierarchical_allreduce`` (``comm/hierarchical.py``): a ring reduce-scatter among the ``L``
  ranks of a node, a ring allreduce of the ``n / L`` segment among the ``N`` nodes (all ``L``
  segments cross the node's network link at once, so each gets ``1 / L`` of its bandwidth),
  and a ring allgather inside the node.
* ``fp16``: the same messages with half the bytes, every sent float32 chunk cast to float16 and
  the finished result cast back (``comm/compression.py``).
* ``native_allreduce``: the library's own allreduce, modelled as a bandwidth-optimal ring
  without our chunking (NCCL's algorithm; on this machine fitted to MPICH's measured times).
* ``shm_allreduce`` (``comm/shm.py``): copy in, reduce a ``1 / p`` part of every slot, copy
  out, two barriers per 256 KiB chunk.
* ``ring_allgather``: ``p - 1`` steps of one ``sendrecv`` of the whole per-rank payload.

A ring that spans nodes runs at the pace of its slowest hop (ranks are numbered node by node,
so each node boundary is crossed by one flow each way): its ``Link`` is the inter-node one.
"""
import math

from fleetmpi.comm.ring import DEFAULT_CHUNK_BYTES
from fleetmpi.comm.shm import CHUNK_BYTES as SHM_CHUNK_BYTES

FLOAT32_BYTES = 4
FLOAT16_BYTES = 2


def _steps(chunk_bytes, nbytes):
    return max(1, math.ceil(nbytes / chunk_bytes))


def reduce_scatter_ring(nbytes, p, link, reduce, chunk_bytes=DEFAULT_CHUNK_BYTES,
                        wire_ratio=1.0):
    """Seconds of ``reduce_scatter_ring`` on ``p`` ranks: ``nbytes`` of accumulator, sent at
    ``wire_ratio`` bytes per accumulator byte; ``reduce``: seconds per wire byte reduced."""
    if p == 1 or nbytes == 0:
        return 0.0
    wire = nbytes / p * wire_ratio
    return (p - 1) * (_steps(chunk_bytes, wire) * link.alpha + wire * link.beta + wire * reduce)


def allgather_ring(segment_bytes, p, link):
    """Seconds of ``allgather_ring``: ``p - 1`` steps of one ``segment_bytes`` message."""
    if p == 1:
        return 0.0
    return (p - 1) * (link.alpha + segment_bytes * link.beta)


def ring_allreduce(nbytes, p, link, gamma, cast=0.0, widen=0.0, compression=None,
                   chunk_bytes=DEFAULT_CHUNK_BYTES, mean=True):
    """Seconds of ``allreduce_ring`` of a float32 buffer of ``nbytes`` on ``p`` ranks (``mean``:
    op ``"mean"``, which divides the owned segment)."""
    if p == 1 or nbytes == 0:
        return 0.0
    ratio = FLOAT16_BYTES / FLOAT32_BYTES if compression == "fp16" else 1.0
    segment = nbytes / p
    seconds = (reduce_scatter_ring(nbytes, p, link, widen if ratio < 1 else gamma, chunk_bytes,
                                   ratio)
               + (segment * gamma if mean else 0.0)
               + allgather_ring(segment * ratio, p, link))
    if compression == "fp16":
        # sent chunks of the reduce-scatter and the owned segment rounded to float16, the
        # gathered result copied back into float32
        seconds += ((p - 1) * segment + segment) * cast + nbytes * ratio * widen
    return seconds


def hierarchical_allreduce(nbytes, local_size, nodes, intra, inter, gamma, cast=0.0,
                           widen=0.0, compression=None, chunk_bytes=DEFAULT_CHUNK_BYTES):
    """Seconds of ``allreduce_hierarchical``: ``local_size`` ranks per node, ``nodes`` nodes."""
    L, N = local_size, nodes
    if L * N == 1 or nbytes == 0:
        return 0.0
    ratio = FLOAT16_BYTES / FLOAT32_BYTES if compression == "fp16" else 1.0
    segment = nbytes / L
    shared = inter.shared(L)
    seconds = (reduce_scatter_ring(nbytes, L, intra, widen if ratio < 1 else gamma, chunk_bytes,
                                   ratio)
               + ring_allreduce(segment, N, shared, gamma, cast, widen, compression,
                                chunk_bytes, mean=False)
               + segment * gamma
               + allgather_ring(segment * ratio, L, intra))
    if compression == "fp16":
        # intra reduce-scatter sends, then finish_through_wire: owned segment and result
        seconds += ((L - 1) * segment + segment) * cast + nbytes * ratio * widen
    return seconds


def native_allreduce(nbytes, p, link, gamma):
    """Seconds of the library's own allreduce, as a bandwidth-optimal ring (unchunked)."""
    if p == 1 or nbytes == 0:
        return 0.0
    return (2 * (p - 1) * link.alpha + 2 * (p - 1) / p * nbytes * link.beta
            + (p - 1) / p * nbytes * gamma + nbytes / p * gamma)


def shm_allreduce(nbytes, p, barrier_alpha, copy_beta, gamma, chunk_bytes=SHM_CHUNK_BYTES):
    """Seconds of ``SharedMemoryAllreduce.allreduce`` on ``p`` ranks of one node: per chunk two
    barriers of ``ceil(log2 p)`` rounds; every byte copied in and out; ``(p - 1) / p`` of the
    bytes reduced by each rank."""
    if p == 1 or nbytes == 0:
        return 0.0
    rounds = math.ceil(math.log2(p))
    return (_steps(chunk_bytes, nbytes) * 2 * rounds * barrier_alpha + 2 * nbytes * copy_beta
            + (p - 1) / p * nbytes * gamma + nbytes / p * gamma)


def agreement(p, link, overhead):
    """Seconds of the argument agreement before each collective call: a gather of one short
    row to rank 0 and its broadcast back (``ceil(log2 p)`` rounds each way), plus the call's
    fixed cost ``overhead`` (Python, argument checks) measured on this machine."""
    if p == 1:
        return 0.0
    return overhead + 2 * math.ceil(math.log2(p)) * link.alpha

"""Ring allreduce as a reduce-scatter followed by an allgather, over any transport.

A flat buffer of ``n`` elements is cut into ``size`` segments whose lengths differ by at most
one (``n`` need not be a multiple of the world size, and may be smaller than it). In the
reduce-scatter each rank passes partial sums to its right neighbour for ``size - 1`` steps,
after which rank ``r`` holds the full reduction of segment ``r``; the allgather then passes the
finished segments around the ring. Reduce-scatter steps move ``chunk_bytes`` at a time through
a small receive buffer, so the reduction reads data that is still in cache.

``wire_dtype`` may differ from the accumulator's dtype (fp16 on the wire, float32 partial sums,
see ``compression``); the allgather then circulates the wire copy, so every rank ends with the
same bits.
"""
import numpy as np

from .compression import accumulate_dtypes, to_wire
from .ops import array_module, finish_mean, reduce_into

DEFAULT_CHUNK_BYTES = 1 << 20


def split_offsets(n, parts):
    """Offsets of ``parts`` near-equal segments of ``n`` elements (the first ``n % parts`` get one more)."""
    q, r = divmod(n, parts)
    offsets = [0]
    for i in range(parts):
        offsets.append(offsets[-1] + q + (1 if i < r else 0))
    return offsets


def count_offsets(counts, row=1):
    """Offsets of consecutive parts of ``counts[i]`` rows of ``row`` elements each."""
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + int(count) * row)
    return offsets


def overlap_counts(start, stop, offsets):
    """How many elements of ``[start, stop)`` lie in each segment that ``offsets`` cut."""
    return [max(0, min(stop, offsets[r + 1]) - max(start, offsets[r]))
            for r in range(len(offsets) - 1)]


def _chunks(start, stop, chunk):
    return [(i, min(i + chunk, stop)) for i in range(start, stop, chunk)]


def reduce_scatter_ring(transport, acc, op, offsets, wire_dtype=None,
                        chunk_bytes=DEFAULT_CHUNK_BYTES):
    """Reduce ``acc`` in place so that segment ``rank`` holds the reduction over all ranks.

    The other segments of ``acc`` are left holding partial sums. ``op="mean"`` sums here; the
    caller divides.
    """
    size, rank = transport.size, transport.rank
    if size == 1:
        return
    xp = array_module(acc)
    wire_dtype = np.dtype(wire_dtype or acc.dtype)
    cast = wire_dtype != acc.dtype
    chunk = max(1, chunk_bytes // wire_dtype.itemsize)
    longest = max(offsets[i + 1] - offsets[i] for i in range(size))
    recv_tmp = xp.empty(min(chunk, longest), wire_dtype)
    send_tmp = xp.empty(min(chunk, longest), wire_dtype) if cast else None
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):
        s = (rank - step - 1) % size
        r = (rank - step - 2) % size
        send_parts = _chunks(offsets[s], offsets[s + 1], chunk)
        recv_parts = _chunks(offsets[r], offsets[r + 1], chunk)
        for k in range(max(len(send_parts), len(recv_parts))):
            sendbuf = recvbuf = None
            if k < len(send_parts):
                a, b = send_parts[k]
                if cast:
                    sendbuf = send_tmp[:b - a]
                    to_wire(sendbuf, acc[a:b])
                else:
                    sendbuf = acc[a:b]
            if k < len(recv_parts):
                a, b = recv_parts[k]
                recvbuf = recv_tmp[:b - a]
            transport.sendrecv(sendbuf, right if sendbuf is not None else None,
                               recvbuf, left if recvbuf is not None else None)
            if recvbuf is not None:
                a, b = recv_parts[k]
                reduce_into(acc[a:b], recvbuf, op)


def allgather_ring(transport, buf, offsets):
    """Given segment ``rank`` of ``buf`` on each rank, fill in every other segment."""
    size, rank = transport.size, transport.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):
        s = (rank - step) % size
        r = (rank - step - 1) % size
        transport.sendrecv(buf[offsets[s]:offsets[s + 1]], right,
                           buf[offsets[r]:offsets[r + 1]], left)


def finish_through_wire(transport, buf, acc, offsets, wire_dtype):
    """Allgather the finished segments and leave the result in ``buf``.

    When the accumulator is wider than the wire, the owned segment is rounded to the wire dtype
    first and every rank (the owner included) reads its result from the wire copy.
    """
    xp = array_module(buf)
    lo, hi = offsets[transport.rank], offsets[transport.rank + 1]
    if np.dtype(wire_dtype) == acc.dtype:
        allgather_ring(transport, acc, offsets)
        if acc is not buf:
            xp.copyto(buf, acc, casting="unsafe")
        return
    wire = xp.empty(buf.size, wire_dtype)
    to_wire(wire[lo:hi], acc[lo:hi])
    allgather_ring(transport, wire, offsets)
    xp.copyto(buf, wire, casting="unsafe")


def allreduce_ring(transport, buf, op, compression=None, chunk_bytes=DEFAULT_CHUNK_BYTES,
                   mean_size=None):
    """Allreduce the flat contiguous array ``buf`` in place over ``transport``'s ranks.

    ``mean_size`` is the divisor for ``op="mean"`` (defaults to the transport's size; the
    hierarchical algorithm passes the world size).
    """
    mean_size = transport.size if mean_size is None else mean_size
    if transport.size == 1 or buf.size == 0:
        finish_mean(buf, op, mean_size)
        return
    acc_dtype, wire_dtype = accumulate_dtypes(buf.dtype, compression)
    acc = buf if acc_dtype == buf.dtype else buf.astype(acc_dtype)
    offsets = split_offsets(buf.size, transport.size)
    reduce_scatter_ring(transport, acc, op, offsets, wire_dtype, chunk_bytes)
    lo, hi = offsets[transport.rank], offsets[transport.rank + 1]
    finish_mean(acc[lo:hi], op, mean_size)
    finish_through_wire(transport, buf, acc, offsets, wire_dtype)

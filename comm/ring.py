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

The allreduce, allgather and reduce-scatter here are registered as the ``"ring"`` algorithm
of each (``RingAllreduceAlgorithm``, ``RingAllgatherAlgorithm``,
``RingReduceScatterAlgorithm``).
"""
import functools

import numpy as np

from .algorithm import AllgatherAlgorithm, AllreduceAlgorithm, ReduceScatterAlgorithm
from .compression import COMPRESSIONS, accumulate_dtypes, to_wire
from .ops import array_module, finish_mean, reducer

DEFAULT_CHUNK_BYTES = 1 << 20


@functools.lru_cache(maxsize=256)
def split_offsets(n, parts):
    """Offsets of ``parts`` near-equal segments of ``n`` elements (the first ``n % parts`` get
    one more), as a tuple."""
    q, r = divmod(n, parts)
    offsets = [0]
    for i in range(parts):
        offsets.append(offsets[-1] + q + (1 if i < r else 0))
    return tuple(offsets)


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


@functools.lru_cache(maxsize=256)
def _reduce_scatter_steps(offsets, rank, chunk):
    """The transfers of ``rank``'s reduce-scatter over the segments ``offsets`` cut, at most
    ``chunk`` elements each, and the longest of them: ``(first, send, recv)`` per transfer,
    ``send``/``recv`` the slice of the buffer sent to the right neighbour and reduced with
    what arrives from the left (None where that side has no chunk left), ``first`` true in
    the ring's first step. Computed once per layout: small messages repeat it every call."""
    size = len(offsets) - 1
    longest = min(chunk, max(offsets[i + 1] - offsets[i] for i in range(size)))
    steps = []
    for step in range(size - 1):
        s = (rank - step - 1) % size
        r = (rank - step - 2) % size
        sends = _chunks(offsets[s], offsets[s + 1], chunk)
        recvs = _chunks(offsets[r], offsets[r + 1], chunk)
        for k in range(max(len(sends), len(recvs))):
            steps.append((step == 0, slice(*sends[k]) if k < len(sends) else None,
                          slice(*recvs[k]) if k < len(recvs) else None))
    return tuple(steps), longest


@functools.lru_cache(maxsize=256)
def _allgather_steps(offsets, rank):
    """``(send, recv)`` slices of ``rank``'s allgather steps over the segments ``offsets`` cut."""
    size = len(offsets) - 1
    return tuple((slice(offsets[(rank - step) % size], offsets[(rank - step) % size + 1]),
                  slice(offsets[(rank - step - 1) % size], offsets[(rank - step - 1) % size + 1]))
                 for step in range(size - 1))


class RingReduceScatter:
    """One rank's part of a ring reduce-scatter over the segments ``offsets`` cut, for
    accumulators of ``dtype`` sent as ``wire_dtype``, with its schedule and scratch buffers
    (arrays of ``xp``) made once: a layout that repeats every step then costs only its
    transfers and reductions, which is what a small message's time is made of."""

    def __init__(self, transport, offsets, dtype, op, wire_dtype=None,
                 chunk_bytes=DEFAULT_CHUNK_BYTES, xp=np):
        size, rank = transport.size, transport.rank
        self.transport = transport
        wire = np.dtype(dtype if wire_dtype is None else wire_dtype)
        cast = wire != np.dtype(dtype)
        steps, longest = ((), 0) if size == 1 else _reduce_scatter_steps(
            tuple(offsets), rank, max(1, chunk_bytes // wire.itemsize))
        recv_tmp = xp.empty(longest, wire)
        send_tmp = xp.empty(longest, wire) if cast else None
        self.steps = tuple(
            (first, send, recv, None if recv is None else recv_tmp[:recv.stop - recv.start],
             None if send is None or not cast else send_tmp[:send.stop - send.start])
            for first, send, recv in steps)
        self.combine = reducer(xp, op)
        self.right, self.left = (rank + 1) % size, (rank - 1) % size

    def __call__(self, acc, src=None):
        """Reduce ``acc`` in place so that segment ``rank`` holds the reduction over all ranks.

        The other segments of ``acc`` are left holding partial sums (all but one of them; the
        segment sent first keeps what it held). ``src``: where this rank's own values are read
        from, when not ``acc`` itself (as MPI's separate send buffer: no copy into ``acc``
        first). ``op="mean"`` sums here; the caller divides."""
        src = acc if src is None else src
        if self.transport.size == 1:
            if src is not acc:
                array_module(acc).copyto(acc, src)
            return
        sendrecv, combine, right, left = (self.transport.sendrecv, self.combine, self.right,
                                          self.left)
        for first, send, recv, recvbuf, wire in self.steps:
            sendbuf = None
            if send is not None:
                sendbuf = (src if first else acc)[send]
                if wire is not None:
                    to_wire(wire, sendbuf)
                    sendbuf = wire
            sendrecv(sendbuf, right if send is not None else None,
                     recvbuf, left if recv is not None else None)
            if recv is not None:
                combine(src[recv], recvbuf, out=acc[recv], casting="unsafe")


def reduce_scatter_ring(transport, acc, op, offsets, wire_dtype=None,
                        chunk_bytes=DEFAULT_CHUNK_BYTES, src=None):
    """Reduce ``acc`` in place so that segment ``rank`` holds the reduction over all ranks
    (``RingReduceScatter``, made for this one call)."""
    RingReduceScatter(transport, offsets, acc.dtype, op, wire_dtype, chunk_bytes,
                      array_module(acc))(acc, src)


def allgather_ring(transport, buf, offsets):
    """Given segment ``rank`` of ``buf`` on each rank, fill in every other segment."""
    size, rank = transport.size, transport.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    for send, recv in _allgather_steps(tuple(offsets), rank):
        transport.sendrecv(buf[send], right, buf[recv], left)


def finish_through_wire(transport, buf, acc, offsets, wire_dtype):
    """Allgather the finished segments and leave the result in ``buf``.

    When the accumulator is wider than the wire, the owned segment is rounded to the wire dtype
    first and every rank (the owner included) reads its result from the wire copy.
    """
    xp = array_module(buf)
    lo, hi = offsets[transport.rank], offsets[transport.rank + 1]
    if wire_dtype == acc.dtype:
        allgather_ring(transport, acc, offsets)
        if acc is not buf:
            xp.copyto(buf, acc, casting="unsafe")
        return
    wire = xp.empty(buf.size, wire_dtype)
    to_wire(wire[lo:hi], acc[lo:hi])
    allgather_ring(transport, wire, offsets)
    xp.copyto(buf, wire, casting="unsafe")


class RingAllreduce:
    """The ring allreduce of flat buffers of ``n`` elements of ``dtype`` over ``transport``'s
    ranks, made once for that layout (see ``RingReduceScatter``).

    ``mean_size`` is the divisor for ``op="mean"`` (defaults to the transport's size; the
    hierarchical algorithm passes the world size). ``xp``: the module of the arrays it gets.
    """

    def __init__(self, transport, n, dtype, op, compression=None,
                 chunk_bytes=DEFAULT_CHUNK_BYTES, mean_size=None, xp=np):
        self.transport, self.op = transport, op
        self.mean_size = transport.size if mean_size is None else mean_size
        self.acc_dtype, self.wire_dtype = accumulate_dtypes(np.dtype(dtype), compression)
        self.widen = self.acc_dtype != np.dtype(dtype)
        self.through_wire = self.wire_dtype != self.acc_dtype
        self.offsets = split_offsets(n, transport.size)
        rank = transport.rank
        self.owned = slice(self.offsets[rank], self.offsets[rank + 1])
        self.gather_steps = _allgather_steps(self.offsets, rank)
        self.reduce_scatter = (None if transport.size == 1 or n == 0 else RingReduceScatter(
            transport, self.offsets, self.acc_dtype, op, self.wire_dtype, chunk_bytes, xp))

    def __call__(self, buf, src=None):
        """Allreduce the flat contiguous ``buf`` in place or, given ``src`` (flat, of ``buf``'s
        size and dtype), reduce ``src`` into ``buf`` without copying it there first."""
        src = buf if src is None else src
        if self.reduce_scatter is None:
            if src is not buf:
                array_module(buf).copyto(buf, src)
            finish_mean(buf, self.op, self.mean_size)
            return
        acc = buf
        if self.widen:
            acc = src = src.astype(self.acc_dtype)
        self.reduce_scatter(acc, src)
        if self.op == "mean":
            finish_mean(acc[self.owned], self.op, self.mean_size)
        if self.through_wire:
            finish_through_wire(self.transport, buf, acc, self.offsets, self.wire_dtype)
            return
        sendrecv, right, left = (self.transport.sendrecv, self.reduce_scatter.right,
                                 self.reduce_scatter.left)
        for send, recv in self.gather_steps:
            sendrecv(buf[send], right, buf[recv], left)


def allreduce_ring(transport, buf, op, compression=None, chunk_bytes=DEFAULT_CHUNK_BYTES,
                   mean_size=None, sendbuf=None):
    """Allreduce the flat contiguous array ``buf`` in place over ``transport``'s ranks (or
    reduce ``sendbuf`` into it): ``RingAllreduce``, made for this one call."""
    RingAllreduce(transport, buf.size, buf.dtype, op, compression, chunk_bytes, mean_size,
                  array_module(buf))(buf, sendbuf)


class RingAllreduceAlgorithm(AllreduceAlgorithm):
    """The ring allreduce: bandwidth-optimal, each rank sends and receives about twice its
    buffer; float16 on the wire with compression."""

    name = "ring"
    compressions = COMPRESSIONS

    def run(self, ctx, buf, op, compression, index, sendbuf=None):
        transport = ctx.transports[index]

        def fn(b, s=None):
            allreduce_ring(transport, b, op, compression, ctx.chunk_bytes, sendbuf=s)
        if sendbuf is None:
            ctx.run_on(index, fn, buf)
        else:
            ctx.run_on(index, fn, buf, sendbuf)

    def runner(self, ctx, x, op, compression, out):
        """The ``RingAllreduce`` of ``x``'s layout, made once per communicator and shared by
        the repeats of every call of that layout, reducing ``x`` into the result where it
        is."""
        transport = ctx.transports[0]
        if transport.device or not x.flags.c_contiguous:
            return None
        layout = (x.size, x.dtype, op, compression)
        ring = ctx.resource(("ring", layout),
                            lambda: RingAllreduce(transport, *layout, ctx.chunk_bytes))
        shape, dtype = x.shape, x.dtype
        if out is not None and out is not x and x.ndim == 1:
            return lambda x, out: ring(out, x)

        def run(x, out):
            result = np.empty(shape, dtype) if out is None else out
            ring(result.reshape(-1), None if result is x else x.reshape(-1))
            return result
        return run


class RingAllgatherAlgorithm(AllgatherAlgorithm):
    """The ring allgather: ``size - 1`` steps, each passing one finished part on; parts of
    any length."""

    name = "ring"

    def run(self, ctx, buf, offsets):
        transport = ctx.transports[0]
        ctx.run_on(0, lambda b: allgather_ring(transport, b, offsets), buf)


class RingReduceScatterAlgorithm(ReduceScatterAlgorithm):
    """The ring reduce-scatter (the first half of the ring allreduce); float16 on the wire
    with compression."""

    name = "ring"
    compressions = COMPRESSIONS

    def run(self, ctx, x, op, compression, offsets, overwrite_input):
        xp = array_module(x)
        lo, hi = offsets[ctx.rank], offsets[ctx.rank + 1]
        acc_dtype, wire_dtype = accumulate_dtypes(x.dtype, compression)
        in_place = overwrite_input and acc_dtype == x.dtype and x.flags.c_contiguous
        acc = x.reshape(-1) if in_place else xp.array(x, dtype=acc_dtype, order="C",
                                                      copy=True).reshape(-1)
        transport = ctx.transports[0]

        def ring(a):
            reduce_scatter_ring(transport, a, op, offsets, wire_dtype, ctx.chunk_bytes)
            finish_mean(a[lo:hi], op, ctx.size)
        ctx.run_on(0, ring, acc)
        if in_place and wire_dtype == acc.dtype:
            # The caller gave x up: its block is the result, without a copy.
            return acc[lo:hi]
        wire = xp.empty(hi - lo, wire_dtype)
        to_wire(wire, acc[lo:hi])
        return wire.astype(x.dtype, copy=False)

"""Personalised exchanges over any transport: alltoall, gather to a root and scatter from it.

Each moves the rows of flat contiguous buffers cut by offsets (``offsets[r]:offsets[r + 1]`` is
rank ``r``'s part), so parts may differ in length and be empty. alltoall runs ``size - 1``
pairwise steps, in step ``k`` sending to ``rank + k`` and receiving from ``rank - k`` (every
rank sends and receives once per step, so no step waits on a chain); gather and scatter are
linear at the root, which handles one part per peer. Registered as the alltoall
``"pairwise"``, the gather ``"linear"`` and the scatter ``"linear"``.
"""
from .algorithm import AlltoallAlgorithm, GatherAlgorithm, ScatterAlgorithm


def alltoall_pairwise(transport, send, send_offsets, recv, recv_offsets):
    """Send part ``r`` of ``send`` (``send_offsets``) to rank ``r``, and receive rank ``r``'s
    part for this rank into part ``r`` of ``recv`` (``recv_offsets``)."""
    size, rank = transport.size, transport.rank
    recv[recv_offsets[rank]:recv_offsets[rank + 1]] = \
        send[send_offsets[rank]:send_offsets[rank + 1]]
    for step in range(1, size):
        dest, source = (rank + step) % size, (rank - step) % size
        transport.sendrecv(send[send_offsets[dest]:send_offsets[dest + 1]], dest,
                           recv[recv_offsets[source]:recv_offsets[source + 1]], source)


def gather_linear(transport, buf, offsets, root):
    """Fill part ``r`` of the root's ``buf`` from rank ``r``'s (each rank's own part is
    already in place)."""
    rank = transport.rank
    if rank != root:
        transport.send(buf[offsets[rank]:offsets[rank + 1]], root)
        return
    for source in range(transport.size):
        if source != root:
            transport.recv(buf[offsets[source]:offsets[source + 1]], source)


def scatter_linear(transport, buf, offsets, part, root):
    """Give each rank ``r`` part ``r`` of the root's ``buf`` in its ``part``."""
    rank = transport.rank
    if rank != root:
        transport.recv(part, root)
        return
    for dest in range(transport.size):
        if dest != root:
            transport.send(buf[offsets[dest]:offsets[dest + 1]], dest)
    part[...] = buf[offsets[root]:offsets[root + 1]]


class PairwiseAlltoallAlgorithm(AlltoallAlgorithm):
    """``size - 1`` pairwise steps; parts of any length."""

    name = "pairwise"

    def run(self, ctx, send, send_offsets, recv, recv_offsets):
        transport = ctx.transports[0]
        ctx.run_on(0, lambda a, b: alltoall_pairwise(transport, a, send_offsets, b,
                                                     recv_offsets), send, recv)


class LinearGatherAlgorithm(GatherAlgorithm):
    """The root receives from each rank in turn; parts of any length."""

    name = "linear"

    def run(self, ctx, buf, offsets, root):
        transport = ctx.transports[0]
        ctx.run_on(0, lambda b: gather_linear(transport, b, offsets, root), buf)


class LinearScatterAlgorithm(ScatterAlgorithm):
    """The root sends to each rank in turn; parts of any length."""

    name = "linear"

    def run(self, ctx, buf, offsets, part, root):
        transport = ctx.transports[0]
        ctx.run_on(0, lambda b, p: scatter_linear(transport, b, offsets, p, root), buf, part)

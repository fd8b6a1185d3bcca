"""Dissemination barrier over any transport: ``ceil(log2(size))`` rounds of one-element exchanges.

In round ``k`` rank ``r`` signals rank ``r + 2**k`` and waits for rank ``r - 2**k``; after the
last round every rank has heard, directly or through others, from every rank. Registered
as the barrier ``"dissemination"``.
"""
import numpy as np

from .algorithm import BarrierAlgorithm


def barrier(transport, token):
    """Block until all of ``transport``'s ranks have entered; ``token`` is a 1-element scratch pair."""
    size, rank = transport.size, transport.rank
    distance = 1
    while distance < size:
        transport.sendrecv(token[:1], (rank + distance) % size,
                           token[1:2], (rank - distance) % size)
        distance <<= 1
    transport.synchronize()


def _token(transport_name):
    """The scratch pair a barrier exchanges, in the memory ``transport_name`` moves."""
    if transport_name == "nccl":
        import cupy
        return cupy.zeros(2, np.uint8)
    return np.zeros(2, np.uint8)


class DisseminationBarrierAlgorithm(BarrierAlgorithm):
    """``ceil(log2(size))`` rounds of one-byte exchanges."""

    name = "dissemination"

    def run(self, ctx):
        token = ctx.resource("barrier token", lambda: _token(ctx.transport_name))
        transport = ctx.transports[0]
        ctx.run_on(0, lambda t: barrier(transport, t), token)

"""Dissemination barrier over any transport: ``ceil(log2(size))`` rounds of one-element exchanges.

In round ``k`` rank ``r`` signals rank ``r + 2**k`` and waits for rank ``r - 2**k``; after the
last round every rank has heard, directly or through others, from every rank.
"""


def barrier(transport, token):
    """Block until all of ``transport``'s ranks have entered; ``token`` is a 1-element scratch pair."""
    size, rank = transport.size, transport.rank
    distance = 1
    while distance < size:
        transport.sendrecv(token[:1], (rank + distance) % size,
                           token[1:2], (rank - distance) % size)
        distance <<= 1
    transport.synchronize()

"""Broadcast over any transport: a binomial tree for small buffers, a pipelined chain for large
(which one runs when: ``algorithm_choice``).

The tree finishes in ``ceil(log2(size))`` rounds, which wins while latency dominates. The chain
passes the buffer down ranks ``root, root+1, ...`` in chunks; every inner rank receives chunk
``i`` while it forwards chunk ``i - 1``, so after the pipeline fills each link carries the
whole buffer once and the time approaches one buffer transfer regardless of the rank count.

Registered as the broadcasts ``"tree"`` and ``"chain"`` (``TreeBroadcastAlgorithm``,
``ChainBroadcastAlgorithm``).
"""
from .algorithm import BroadcastAlgorithm
from .ring import DEFAULT_CHUNK_BYTES, _chunks


def broadcast_tree(transport, buf, root):
    size = transport.size
    vrank = (transport.rank - root) % size
    mask = 1
    while mask < size:
        if vrank & mask:
            transport.recv(buf, (vrank - mask + root) % size)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if vrank + mask < size:
            transport.send(buf, (vrank + mask + root) % size)
        mask >>= 1


def broadcast_chain(transport, buf, root, chunk_bytes=DEFAULT_CHUNK_BYTES):
    size = transport.size
    vrank = (transport.rank - root) % size
    prev = (transport.rank - 1) % size
    nxt = (transport.rank + 1) % size if vrank + 1 < size else None
    parts = [buf[a:b] for a, b in _chunks(0, buf.size, max(1, chunk_bytes // buf.itemsize))]
    if not parts:
        return
    if vrank == 0:
        for part in parts:
            transport.send(part, nxt)
        return
    transport.recv(parts[0], prev)
    for i in range(1, len(parts)):
        transport.sendrecv(parts[i - 1] if nxt is not None else None, nxt, parts[i], prev)
    if nxt is not None:
        transport.send(parts[-1], nxt)


class _TransportBroadcast(BroadcastAlgorithm):
    """A broadcast written against one transport: ``broadcast(transport, buf, root)``."""

    @staticmethod
    def broadcast(transport, buf, root):
        raise NotImplementedError

    def run(self, ctx, buf, root, index):
        transport = ctx.transports[index]

        def fn(b):
            if ctx.size > 1 and b.size:
                self.broadcast(transport, b, root)
        ctx.run_on(index, fn, buf)


class TreeBroadcastAlgorithm(_TransportBroadcast):
    """The binomial tree: ``log2(size)`` steps, each with the whole buffer."""

    name = "tree"
    broadcast = staticmethod(broadcast_tree)


class ChainBroadcastAlgorithm(_TransportBroadcast):
    """The pipelined chain: every link busy at once for large buffers."""

    name = "chain"
    broadcast = staticmethod(broadcast_chain)

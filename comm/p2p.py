"""Point-to-point transfers of ``Communicator.send`` and ``recv``, registered as their
algorithm ``"p2p"``: the transport's own send and receive, waited for (the header that
describes the array travels first, on the communicator's control channel)."""
from .algorithm import RecvAlgorithm, SendAlgorithm


class PointToPointSendAlgorithm(SendAlgorithm):
    """The transport's send, completed before it returns."""

    name = "p2p"

    def run(self, ctx, buf, dest):
        transport = ctx.transports[0]
        ctx.run_on(0, lambda b: (transport.send(b, dest), transport.synchronize()), buf)


class PointToPointRecvAlgorithm(RecvAlgorithm):
    """The transport's receive, completed before it returns."""

    name = "p2p"

    def run(self, ctx, buf, source):
        transport = ctx.transports[0]
        ctx.run_on(0, lambda b: (transport.recv(b, source), transport.synchronize()), buf)

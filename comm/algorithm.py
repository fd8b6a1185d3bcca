"""What a collective algorithm is: an object that states what it supports and runs itself.

Every algorithm the communicator runs is an instance of one of the classes below, listed once
in ``registry``. ``call_checks`` asks the algorithm a call names whether it takes the call
(``refusal``, from what the class states); ``dispatch`` looks the algorithm up by collective
and name and calls its ``run``; nothing else tests an algorithm's name. Each collective's base
class fixes the signature of ``run``: the flat, contiguous buffers the communicator has
prepared, the offsets that cut them into per-rank parts, and ``ctx``, the ``AlgorithmContext``
of the communicator (its transports, settings and the state an algorithm keeps between calls).
An algorithm moves data with ``ctx.run_on(index, fn, *bufs)``, which runs ``fn`` on transport
``index`` (device arrays through host memory where the transport is MPI).

As Horovod's operations say when they are ``Enabled`` and execute themselves, with one
difference: which enabled algorithm runs for ``algorithm=None`` is not decided by the
algorithms but by the one table of ``algorithm_choice``, which prints its reasons.
"""
from .ops import DTYPES, OPS
from .topology import NODES, ONE_NODE, ONE_RANK

TRANSPORT_NAMES = ("mpi", "nccl")
TOPOLOGIES = (ONE_RANK, ONE_NODE, NODES)


class Algorithm:
    """One algorithm of one collective.

    What it supports: ``transports`` (``"mpi"``, ``"nccl"``), ``topologies`` (kinds of world,
    ``topology.topology_of``), for a reduction the ``ops`` and ``dtypes`` it computes and the
    ``compressions`` it carries on the wire, and with ``equal_parts`` that every rank's part
    must have one size."""

    collective = None
    name = None
    transports = TRANSPORT_NAMES
    topologies = TOPOLOGIES
    ops = None  # None: not a reduction
    dtypes = None  # None: any numeric dtype
    compressions = (None,)
    equal_parts = False

    def refusal(self, ctx, dtypes=(), op=None):
        """Why this algorithm cannot run a call of ``op`` (None: not a reduction, or not
        known yet) on arrays of ``dtypes`` on the communicator of ``ctx``, in words; None when
        it can. (Compression and part sizes are checked by ``call_checks``, which names the
        algorithms that take them.)"""
        if ctx.transport_name not in self.transports or ctx.world_topology not in self.topologies:
            return (f"algorithm={self.name!r} runs over transport "
                    f"{' or '.join(map(repr, self.transports))} on "
                    f"{' or '.join(self.topologies)} (this job: transport "
                    f"{ctx.transport_name!r}, {ctx.topology.num_nodes} node(s), {ctx.size} "
                    f"rank(s))")
        if op is not None and self.ops is not None and op not in self.ops:
            return (f"algorithm={self.name!r} does not compute op={op!r}; it computes "
                    f"{', '.join(self.ops)}")
        for dtype in dtypes:
            if self.dtypes is not None and dtype not in self.dtypes:
                return (f"algorithm={self.name!r} does not reduce {dtype}; it reduces "
                        f"{', '.join(str(d) for d in self.dtypes)}")
        return None

    def __repr__(self):
        return f"<{self.collective} algorithm {self.name!r}>"


class AllreduceAlgorithm(Algorithm):
    collective = "allreduce"
    ops = OPS
    dtypes = DTYPES

    def run(self, ctx, buf, op, compression, index, sendbuf=None):
        """Reduce the flat ``buf`` in place over every rank on transport ``index`` or, given
        the flat ``sendbuf`` (MPI's separate send buffer), reduce ``sendbuf`` into ``buf``."""
        raise NotImplementedError

    def runner(self, ctx, x, op, compression, out):
        """A faster ``(x, out) -> result`` for the repeats of one agreed call on host arrays
        like ``x`` and ``out`` (``dispatch.allreduce_runner``), or None: the general path."""
        return None


class BroadcastAlgorithm(Algorithm):
    collective = "broadcast"

    def run(self, ctx, buf, root, index):
        """Overwrite the flat ``buf`` with ``root``'s on transport ``index``."""
        raise NotImplementedError


class AllgatherAlgorithm(Algorithm):
    collective = "allgather"

    def run(self, ctx, buf, offsets):
        """Fill every rank's part ``offsets[r]:offsets[r + 1]`` of the flat ``buf``, which
        holds this rank's own part."""
        raise NotImplementedError


class ReduceScatterAlgorithm(Algorithm):
    collective = "reduce_scatter"
    ops = OPS
    dtypes = DTYPES

    def run(self, ctx, x, op, compression, offsets, overwrite_input):
        """This rank's part ``offsets[rank]:offsets[rank + 1]`` of the reduction of the flat
        ``x``, as a new flat array of ``x``'s dtype; ``overwrite_input``: ``x`` may be left
        holding partial sums."""
        raise NotImplementedError


class AlltoallAlgorithm(Algorithm):
    collective = "alltoall"

    def run(self, ctx, send, send_offsets, recv, recv_offsets):
        """Send part ``r`` of ``send`` to rank ``r`` and receive rank ``r``'s part for this
        rank into part ``r`` of ``recv``."""
        raise NotImplementedError


class GatherAlgorithm(Algorithm):
    collective = "gather"

    def run(self, ctx, buf, offsets, root):
        """Fill part ``r`` of the root's ``buf`` from rank ``r``'s own part of its ``buf``."""
        raise NotImplementedError


class ScatterAlgorithm(Algorithm):
    collective = "scatter"

    def run(self, ctx, buf, offsets, part, root):
        """Give each rank ``r`` part ``r`` of the root's ``buf`` in its ``part``."""
        raise NotImplementedError


class SendAlgorithm(Algorithm):
    collective = "send"

    def run(self, ctx, buf, dest):
        """Send the contiguous ``buf`` to rank ``dest`` and return once it has left."""
        raise NotImplementedError


class RecvAlgorithm(Algorithm):
    collective = "recv"

    def run(self, ctx, buf, source):
        """Receive rank ``source``'s message into the contiguous ``buf``."""
        raise NotImplementedError


class BarrierAlgorithm(Algorithm):
    collective = "barrier"

    def run(self, ctx):
        """Return once every rank has entered."""
        raise NotImplementedError

"""The communicator as its algorithms, ``dispatch`` and ``call_checks`` see it.

``Communicator`` is the facade the layers above use; behind it, nothing reads the
communicator's own attributes. What an algorithm may read and keep is this module's
``AlgorithmContext``, one per communicator, made once its transports have started.
"""
from .ops import is_device_array
from .topology import topology_of


class AlgorithmContext:
    """What an algorithm reads and keeps of the communicator it runs for.

    Settings, read-only: ``rank``, ``size``, ``topology`` (the ``Topology``),
    ``world_topology`` (its kind, ``topology.topology_of``), ``transport_name``, ``transports``
    (the ``nccl_comm_num`` transports), ``chunk_bytes``, ``use_hierarchical_allreduce``,
    ``hierarchical_allreduce_inter_nranks`` and ``control``, an MPI communicator of the same
    ranks for the comm layer's own small exchanges (the agreement, timing).

    ``make_transport(mpi_comm, stream=None)`` makes a transport of the communicator's kind over
    other ranks; ``resource(key, make)`` is state an algorithm keeps for this communicator (made
    once, freed with it); ``note(name)`` names the algorithm a call ran, for the call's timeline
    event; ``run_on(index, fn, *bufs)`` runs ``fn`` on transport ``index``.
    """

    def __init__(self, topology, transport_name, transports, make_transport, control,
                 chunk_bytes, use_hierarchical_allreduce, hierarchical_allreduce_inter_nranks):
        self.topology = topology
        self.rank = topology.rank
        self.size = topology.size
        self.world_topology = topology_of(topology.size, topology.local_size)
        self.transport_name = transport_name
        self.transports = transports
        self.make_transport = make_transport
        self.control = control
        self.chunk_bytes = chunk_bytes
        self.use_hierarchical_allreduce = use_hierarchical_allreduce
        self.hierarchical_allreduce_inter_nranks = hierarchical_allreduce_inter_nranks
        self.noted = None  # while a call's timeline event records: the algorithms it ran
        self._resources = {}

    def note(self, name):
        """Remember the algorithm a flat operation ran, for the timeline event of its call."""
        if self.noted is not None:
            self.noted.append(name)

    def resource(self, key, make):
        """What ``make()`` returned the first time ``key`` was asked for: state an algorithm
        keeps for this communicator (a shared-memory window, the transports of a level, the
        schedule of a layout). ``free`` releases whatever has a ``free()`` of its own."""
        found = self._resources.get(key)
        if found is None:
            found = self._resources[key] = make()
        return found

    def run_on(self, index, fn, *bufs):
        """Call ``fn(*bufs)`` on transport ``index``; device arrays go through host memory
        when the transport is MPI."""
        transport = self.transports[index]
        if bufs and is_device_array(bufs[0]) and not transport.device:
            host = [b.get() for b in bufs]
            fn(*host)
            for b, h in zip(bufs, host):
                b.set(h)
            return
        with transport.activate():
            fn(*bufs)

    def free(self):
        """Release the resources kept (those with a ``free()``)."""
        for found in self._resources.values():
            if hasattr(found, "free"):
                found.free()
        self._resources.clear()

"""This process's place in the job, once ``fleet.init`` (``fleetmpi.world``) has joined it:
the topology (a ``fleetmpi.comm.Topology``) and the role maker, held as plain state.

Every layer may read it, from the backend up; it imports nothing of fleetmpi, so reading it
never reaches above the reader's layer. Only ``fleet.init`` writes it (``join``).
"""
_topology = None
_role_maker = None


def join(topology, role_maker):
    """Record this process's place; ``fleet.init`` calls it once."""
    global _topology, _role_maker
    _topology, _role_maker = topology, role_maker


def joined():
    """Whether ``fleet.init`` has run in this process."""
    return _topology is not None


def topology():
    """The ``fleetmpi.comm.Topology`` of this job; ``fleet.init`` must have run."""
    if _topology is None:
        raise RuntimeError("fleetmpi is not initialized: call fleet.init() first")
    return _topology


def role_maker():
    """The role maker of this job (collective or parameter-server); ``init`` must have run."""
    topology()
    return _role_maker


def roles():
    """The role maker of parameter-server mode; None in collective mode."""
    return None if role_maker().is_collective else _role_maker


def worker_index():
    """This rank's index among the workers: its world rank in collective mode, its worker id
    in parameter-server mode (a server answers with its world rank)."""
    if roles() is not None and _role_maker.is_worker():
        return _role_maker.current_id
    return topology().rank


def worker_num():
    """The number of workers: the world size in collective mode, the workers alone in
    parameter-server mode."""
    return topology().size if roles() is None else _role_maker.worker_num()


def is_first_worker():
    """True on worker 0 only."""
    if roles() is not None:
        return _role_maker.is_worker() and _role_maker.current_id == 0
    return topology().rank == 0


def local_rank():
    """This rank's index among the ranks of its node."""
    return topology().local_rank


def local_size():
    """The number of ranks on this rank's node."""
    return topology().local_size


def node_index():
    """The index of this rank's node, nodes ordered by their lowest world rank."""
    return topology().node_index


def node_num():
    """The number of nodes in the job."""
    return topology().num_nodes

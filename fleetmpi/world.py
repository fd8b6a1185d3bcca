"""This process's place in the job: ``init`` and the role queries of Fleet's collective mode."""
from . import log

_topology = None


def init(role_maker=None, is_collective=True):
    """Join the job: bootstrap MPI through mpi4py and learn this rank's place.

    Works under ``mpirun``/``mpiexec``, ``srun`` and ``fleetmpirun``, and as a plain
    ``python train.py`` (a world of one). A second call does nothing.
    """
    global _topology
    if not is_collective or role_maker is not None:
        raise NotImplementedError(
            "parameter-server mode (is_collective=False or a role_maker) is not available in "
            "this version of fleetmpi; call fleet.init(is_collective=True)")
    if _topology is not None:
        return
    from mpi4py import MPI

    from .comm.topology import Topology

    _topology = Topology(MPI.COMM_WORLD)
    log.configure(_topology.rank, _topology.size, _topology.node_index)
    log.logger.info("joined: %d rank(s) on %d node(s), local rank %d of %d",
                    _topology.size, _topology.num_nodes, _topology.local_rank,
                    _topology.local_size)


def topology():
    """The ``fleetmpi.comm.Topology`` of this job; ``init`` must have run."""
    if _topology is None:
        raise RuntimeError("fleetmpi is not initialized: call fleet.init() first")
    return _topology


def worker_index():
    """This rank's index among the workers (its world rank)."""
    return topology().rank


def worker_num():
    """The number of workers (the world size)."""
    return topology().size


def is_first_worker():
    """True on worker 0 only."""
    return topology().rank == 0


def barrier_worker():
    """Wait until every worker has reached this call."""
    topology().world.Barrier()


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

"""Where each rank sits: the world, its node, and the ranks of the same local index on other nodes.

Nodes come from ``MPI.COMM_TYPE_SHARED``. ``FLEETMPI_LOCAL_SIZE=k`` instead makes each run of k
consecutive world ranks act as one node, so multi-node algorithms can be exercised on one machine.

The kind of a world, as the algorithm table (``algorithm_choice``) and the algorithms
(``algorithm.Algorithm.topologies``) name it, is ``topology_of``'s.
"""
import numpy as np

from fleetmpi.core.knobs import LOCAL_SIZE

# The kinds of world, as ``topology_of`` names them.
ONE_NODE, ONE_RANK, NODES = "one node", "one rank", "several nodes"


def topology_of(size, local_size):
    """The kind of a world of ``size`` ranks, ``local_size`` of them on this node."""
    if size == 1:
        return ONE_RANK
    return ONE_NODE if local_size == size else NODES


def _local_size_override(world_size):
    k = LOCAL_SIZE.value()
    if k is None:
        return None
    if world_size % k != 0:
        raise ValueError(f"{LOCAL_SIZE.name}={k} must be a positive divisor of the world "
                         f"size {world_size}")
    return k


class Topology:
    """The world communicator split into node-local and cross-node communicators.

    ``local`` holds the ranks of this node, ordered by world rank; ``cross`` holds the ranks
    that have this rank's ``local_rank`` on every node, ordered by node. Nodes are numbered
    in the order of their lowest world rank.
    """

    def __init__(self, world):
        from mpi4py import MPI

        self.world = world
        self.rank = world.Get_rank()
        self.size = world.Get_size()
        k = _local_size_override(self.size)
        if k is None:
            self.local = world.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        else:
            self.local = world.Split(color=self.rank // k, key=self.rank)
        self.local_rank = self.local.Get_rank()
        self.local_size = self.local.Get_size()

        leader = np.array([self.rank if self.local_rank == 0 else self.size], dtype=np.int64)
        self.local.Allreduce(MPI.IN_PLACE, leader, op=MPI.MIN)
        leaders = np.empty(self.size, dtype=np.int64)
        world.Allgather(leader, leaders)
        node_leaders = np.unique(leaders)
        self.node_index = int(np.searchsorted(node_leaders, leader[0]))
        self.num_nodes = len(node_leaders)
        self.cross = world.Split(color=self.local_rank, key=self.node_index)

    def free(self):
        """Release the derived communicators (the world stays)."""
        for comm in (self.local, self.cross):
            comm.Free()

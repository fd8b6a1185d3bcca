"""fleetmpi's communication layer: topology, transports, collective algorithms, fusion, compression.

    import fleetmpi as fleet
    from fleetmpi.comm import get_communicator
    fleet.init()
    comm = get_communicator()
    total = comm.allreduce(x)                      # ring / hierarchical / native / shm
    comm.allreduce_many(grads, compression="fp16")  # fused, in place

The layers above use the names exported here and nothing else of this package: the
``Communicator`` (which also answers what they ask of the algorithms: ``allreduce_algorithm``,
``prefers_native``, ``reduce_scatter_offsets``), ``overlap_counts``, the per-rank counts of
a range of elements cut by such offsets, and the one bucket plan (``plan_buckets`` over
``Extent``s, sizes in ``megabytes``) that the gradient strategies share with
``allreduce_many``.
"""
from .stall import CollectiveMismatchError
from .bucketing import Extent, megabytes, plan_buckets
from .communicator import Communicator
from .ring import overlap_counts
from .topology import Topology
from .transport_nccl import NCCLUnavailableError

_world = None


def get_communicator():
    """The world ``Communicator``, built on first use from ``fleet.init()``'s topology.

    Its knobs come from the environment (``FLEETMPI_TRANSPORT``, ``FLEETMPI_CHECK_COLLECTIVES``)
    and the defaults; layers that need other settings build their own ``Communicator``.
    """
    global _world
    if _world is None:
        from fleetmpi.core import job
        _world = Communicator(job.topology())
    return _world


def release_communicators():
    """Free the world ``Communicator`` and every communicator derived from it, so that the
    next ``get_communicator()`` builds a fresh one. Every rank calls it, with nothing in flight
    and nothing left that uses them: between the tests of a suite (a test that provokes a
    collective error leaves nothing behind for the next), not in a training script."""
    global _world
    if _world is not None:
        _world.free()
        _world = None


__all__ = ["CollectiveMismatchError", "Communicator", "Extent", "NCCLUnavailableError",
           "Topology", "get_communicator", "megabytes", "overlap_counts", "plan_buckets",
           "release_communicators"]

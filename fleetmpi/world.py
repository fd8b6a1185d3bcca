"""``fleet.init`` and the role queries of Fleet's API. What ``init`` learns is kept in
``fleetmpi.core.job``, which every layer may read; the queries here are its, re-exported."""
import copy
import os

import numpy as np

from .core import failure, job, knob_agreement, log
from .core.job import (is_first_worker, local_rank, local_size, node_index, node_num,  # noqa: F401
                       role_maker, roles, topology, worker_index, worker_num)

_init_strategy = None


def init(role_maker=None, is_collective=True, strategy=None):
    """Join the job: bootstrap MPI through mpi4py and learn this rank's place.

    Works under ``mpirun``/``mpiexec``, ``srun`` and ``fleetmpirun``, and as a plain
    ``python train.py`` (a world of one). A second call does nothing.

    The mode is the ``role_maker``'s, as in Paddle (``PaddleCloudRoleMaker(is_collective=True)``
    is collective, ``UserDefinedRoleMaker(...)`` and ``PaddleCloudRoleMaker()`` parameter-server
    mode); without one, ``is_collective`` chooses, with the roles from the launcher's variables
    (``fleetmpi.config.role_maker``).
    In collective mode a ``strategy`` whose ``hybrid_configs`` set degrees lays the ranks out
    over them (``fleetmpi.hybrid``), on every call; ``distributed_optimizer`` given no strategy
    runs the latest one given here.
    """
    from .config.role_maker import PaddleCloudRoleMaker, RoleMakerBase

    if role_maker is not None and not isinstance(role_maker, RoleMakerBase):
        raise TypeError(f"role_maker must be a fleetmpi.PaddleCloudRoleMaker or "
                        f"UserDefinedRoleMaker, not {type(role_maker).__name__}")
    collective = role_maker.is_collective if role_maker is not None else bool(is_collective)
    if job.joined():
        if collective != job.role_maker().is_collective:
            raise RuntimeError("fleet.init was already called in the other mode (collective or "
                               "parameter-server); a process runs in one mode")
        _start_communicator(collective)
        _build_layout(strategy)
        return
    role_maker = role_maker or PaddleCloudRoleMaker(is_collective=collective)
    from mpi4py import MPI

    from .comm.topology import Topology
    from .core.knobs import LOCAL_SIZE
    from .launcher_check import verify

    topology = Topology(MPI.COMM_WORLD)
    failure.install(topology.rank, topology.size, topology.node_index)
    verify(topology, collective=collective,
           emulated_nodes=os.environ.get(LOCAL_SIZE.name, "") != "")
    knob_agreement.check(topology.world)
    role_maker.bind(topology.rank, topology.size)
    job.join(topology, role_maker)
    if not collective:
        from .strategies.ps.runtime import join

        join(role_maker, topology)
    log.configure(topology.rank, topology.size, topology.node_index)
    log.logger.info("joined: %d rank(s) on %d node(s), local rank %d of %d",
                    topology.size, topology.num_nodes, topology.local_rank,
                    topology.local_size)
    _start_communicator(collective)
    _build_layout(strategy)


def _start_communicator(collective):
    """Make the world's communicator here, where every rank is, in collective mode: made
    later, on first use, a script whose ranks first use it apart (rank 0 sends, another
    receives) would have only some ranks in its collective construction."""
    if collective:
        from .comm import get_communicator

        get_communicator()


def _build_layout(strategy):
    """Keep a copy of ``strategy`` (``init_strategy``) and, in collective mode, lay the ranks
    out over its degrees."""
    global _init_strategy
    if strategy is None:
        return
    _init_strategy = copy.deepcopy(strategy)
    if job.role_maker().is_collective:
        from .hybrid import build_layout

        build_layout(strategy, job.topology())


def init_strategy():
    """A copy of the strategy the latest ``fleet.init(strategy=...)`` was given (None when
    none was): what ``distributed_optimizer`` runs when it is given none, as in Paddle."""
    return None if _init_strategy is None else copy.deepcopy(_init_strategy)


def barrier_worker():
    """Wait until every worker has reached this call (servers do not take part in
    parameter-server mode); a worker that never comes is named by the stall inspector after
    ``FLEETMPI_STALL_TIMEOUT``, and the job ends."""
    from .comm.stall import gather_rows

    if roles() is not None:
        from .strategies.ps.runtime import worker_communicator

        comm = worker_communicator()
    else:
        comm = topology().world
    gather_rows(comm, np.zeros(1, dtype=np.int64), "barrier_worker")


def _joined(endpoints, to_string):
    return ",".join(endpoints) if to_string else list(endpoints)


def worker_endpoints(to_string=False):
    """The workers' endpoint labels, in worker order (a comma-separated string with
    ``to_string=True``). They name MPI ranks; nothing listens on them
    (``fleetmpi.config.role_maker``)."""
    return _joined(role_maker().worker_endpoints, to_string)


def server_endpoints(to_string=False):
    """The servers' endpoint labels in parameter-server mode; empty in collective mode."""
    return _joined(role_maker().server_endpoints, to_string)

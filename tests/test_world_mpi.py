"""fleet.init, the role queries, the topology and strategy files across several ranks."""
import hashlib
import logging
import time

import numpy as np
import pytest
from mpi4py import MPI

import fleetmpi as fleet
from fleetmpi.core import log
from fleetmpi import world
from fleetmpi.comm.topology import Topology


def _allgather_int(value):
    out = np.empty(MPI.COMM_WORLD.Get_size(), dtype=np.int64)
    MPI.COMM_WORLD.Allgather(np.array([value], dtype=np.int64), out)
    return out


@pytest.mark.mpi(min_size=2)
def test_every_rank_knows_its_place():
    fleet.init(is_collective=True)
    fleet.init(is_collective=True)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    assert fleet.worker_index() == rank
    assert fleet.worker_num() == size
    assert fleet.is_first_worker() == (rank == 0)
    assert list(_allgather_int(fleet.worker_index())) == list(range(size))
    # one machine, no override: a single node holding every rank
    assert (fleet.local_rank(), fleet.local_size()) == (rank, size)
    assert (fleet.node_index(), fleet.node_num()) == (0, 1)


@pytest.mark.mpi(min_size=2)
def test_barrier_worker_waits_for_every_rank():
    fleet.init()
    rank = MPI.COMM_WORLD.Get_rank()
    time.sleep(0.05 * rank)
    before = time.time()
    fleet.barrier_worker()
    after = time.time()
    befores = MPI.COMM_WORLD.allgather(before)
    assert after >= max(befores)


@pytest.mark.mpi(min_size=2)
def test_local_size_override_makes_nodes_of_consecutive_ranks(monkeypatch):
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    k = 2 if size % 2 == 0 else 1
    monkeypatch.setenv("FLEETMPI_LOCAL_SIZE", str(k))
    topo = Topology(comm)
    try:
        assert (topo.local_rank, topo.local_size) == (rank % k, k)
        assert (topo.node_index, topo.num_nodes) == (rank // k, size // k)
        assert topo.local.Get_size() == k
        assert topo.cross.Get_size() == size // k
        assert topo.cross.Get_rank() == rank // k
        members = np.empty(topo.local.Get_size(), dtype=np.int64)
        topo.local.Allgather(np.array([rank], dtype=np.int64), members)
        assert list(members) == list(range(rank - rank % k, rank - rank % k + k))
    finally:
        topo.free()


@pytest.mark.mpi(min_size=2)
def test_log_lines_carry_each_rank():
    fleet.init()
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    handler = next(h for h in log.logger.handlers if getattr(h, "fleetmpi_rank_handler", False))
    record = logging.LogRecord("fleetmpi", logging.WARNING, __file__, 1, "step done", (), None)
    assert handler.filter(record)
    assert handler.format(record) == f"[fleetmpi rank {rank}/{size} node 0] WARNING step done"


@pytest.mark.mpi(min_size=2)
def test_a_strategy_saved_on_rank_0_loads_identically_everywhere(tmp_path):
    fleet.init()
    comm = MPI.COMM_WORLD
    path = comm.bcast(str(tmp_path / "shared.prototxt") if comm.Get_rank() == 0 else None)
    if fleet.is_first_worker():
        strategy = fleet.DistributedStrategy()
        strategy.gradient_merge = True
        strategy.gradient_merge_configs = {"k_steps": 4}
        strategy.dgc_configs = {"sparsity": [0.75, 0.999]}
        strategy.save_to_prototxt(path)
    fleet.barrier_worker()
    loaded = fleet.DistributedStrategy().load_from_prototxt(path)
    assert loaded.gradient_merge_configs["k_steps"] == 4
    digest = hashlib.sha256(loaded._message.SerializeToString(deterministic=True)).digest()
    digests = comm.allgather(digest)
    assert all(d == digests[0] for d in digests)
    fleet.barrier_worker()


@pytest.mark.mpi(min_size=2)
def test_topology_is_the_world():
    fleet.init()
    assert world.topology().world.Get_size() == MPI.COMM_WORLD.Get_size()

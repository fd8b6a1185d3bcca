"""Hierarchical allreduce on emulated nodes (FLEETMPI_LOCAL_SIZE) and on hierarchical_allreduce_inter_nranks groups."""
import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.comm import Communicator, Topology

from comm_support import all_data, close, equal, ok, raises, single_process, tolerance


def emulated_nodes(monkeypatch, local_size):
    """A communicator whose topology treats runs of ``local_size`` ranks as one node."""
    from mpi4py import MPI

    monkeypatch.setenv("FLEETMPI_LOCAL_SIZE", str(local_size))
    topology = Topology(MPI.COMM_WORLD)
    return Communicator(topology, chunk_bytes=128), topology


@pytest.mark.mpi(min_size=4)
def test_emulated_nodes_of_every_size(monkeypatch):
    """Every layout of the world into equal emulated nodes of more than one rank: 2 nodes x 2
    at four ranks; 4 nodes x 2 and 2 nodes x 4 at eight."""
    fleet.init()
    from mpi4py import MPI

    size = MPI.COMM_WORLD.Get_size()
    local_sizes = [d for d in range(2, size) if size % d == 0]
    if not local_sizes:
        pytest.fail(f"{size} ranks cannot be split into equal nodes of 2 or more ranks")
    for local_size in local_sizes:
        comm, topology = emulated_nodes(monkeypatch, local_size)
        try:
            ok(topology.num_nodes == size // local_size)
            ok(topology.local_size == local_size)
            check_hierarchical_sums(comm)
            with raises(ValueError, match="one node"):
                comm.allreduce(np.ones(3), algorithm="shm")
        finally:
            comm.free()
            topology.free()


def check_hierarchical_sums(comm):
    """The hierarchical allreduce equals one process's reduction and MPI's own, for every
    dtype and op, on sizes that do and do not divide evenly."""
    for case, n in enumerate((1, 3, 5, 1000)):
        for dtype in (np.float32, np.float64, np.int64, np.float16):
            stack = all_data(comm.size, n, dtype, case)
            for op in ("sum", "mean", "max", "min"):
                got = comm.allreduce(stack[comm.rank], op=op, algorithm="hierarchical")
                native = comm.allreduce(stack[comm.rank], op=op, algorithm="native")
                want = single_process(stack, op)
                if np.dtype(dtype).kind == "f":
                    rtol, atol = tolerance(dtype, comm.size)
                    close(got.astype(np.float64), want, rtol=rtol, atol=atol)
                    close(got.astype(np.float64), native.astype(np.float64), rtol=rtol,
                          atol=atol)
                else:
                    equal(got, want)
                    equal(got, native)


@pytest.mark.mpi
def test_every_inter_nranks_group_size():
    fleet.init()
    topology = fleet.world.topology()
    for k in [k for k in range(1, topology.size + 1) if topology.size % k == 0]:
        comm = Communicator(topology, hierarchical_allreduce_inter_nranks=k,
                            use_hierarchical_allreduce=True, chunk_bytes=64)
        try:
            stack = all_data(comm.size, 41, np.float64, case=k)
            got = comm.allreduce(stack[comm.rank], op="mean")
            close(got, stack.mean(axis=0), rtol=1e-13, atol=1e-13)
            ints = all_data(comm.size, 41, np.int32, case=k)
            equal(comm.allreduce(ints[comm.rank]), ints.sum(axis=0))
        finally:
            comm.free()


@pytest.mark.mpi
def test_inter_nranks_must_divide_world_size():
    fleet.init()
    topology = fleet.world.topology()
    with raises(ValueError, match=f"must divide the world size {topology.size}"):
        Communicator(topology, hierarchical_allreduce_inter_nranks=topology.size + 1)

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
def test_two_emulated_nodes_at_four_ranks(monkeypatch):
    fleet.init()
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() % 2:
        pytest.fail("this test needs an even number of ranks")
    comm, topology = emulated_nodes(monkeypatch, 2)
    try:
        ok(topology.num_nodes == comm.size // 2)
        ok(topology.local_size == 2)
        for case, n in enumerate((1, 3, 5, 1000)):
            for dtype in (np.float32, np.float64, np.int64, np.float16):
                stack = all_data(comm.size, n, dtype, case)
                for op in ("sum", "mean", "max", "min"):
                    got = comm.allreduce(stack[comm.rank], op=op, algorithm="hierarchical")
                    native = comm.allreduce(stack[comm.rank], op=op, algorithm="native")
                    want = single_process(stack, op)
                    if np.dtype(dtype).kind == "f":
                        rtol, atol = tolerance(dtype, comm.size)
                        close(got.astype(np.float64), want, rtol=rtol,
                                                   atol=atol)
                        close(got.astype(np.float64),
                                                   native.astype(np.float64), rtol=rtol,
                                                   atol=atol)
                    else:
                        equal(got, want)
                        equal(got, native)
        with raises(ValueError, match="one node"):
            comm.allreduce(np.ones(3), algorithm="shm")
    finally:
        comm.free()
        topology.free()


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("local_size", [4, 2], ids=["2 nodes x 4", "4 nodes x 2"])
def test_emulated_nodes_at_eight_ranks(monkeypatch, local_size):
    """The two levels at 8 ranks (``tests/run`` starts this test at 8 ranks)."""
    fleet.init()
    comm, topology = emulated_nodes(monkeypatch, local_size)
    try:
        ok(topology.num_nodes == comm.size // local_size and topology.local_size == local_size)
        for case, n in enumerate((1, 7, 1000)):
            for dtype in (np.float64, np.int64):
                stack = all_data(comm.size, n, dtype, case)
                for op in ("sum", "mean", "max"):
                    got = comm.allreduce(stack[comm.rank], op=op, algorithm="hierarchical")
                    want = single_process(stack, op)
                    if np.dtype(dtype).kind == "f":
                        rtol, atol = tolerance(dtype, comm.size)
                        close(got, want, rtol=rtol, atol=atol)
                    else:
                        equal(got, want)
    finally:
        comm.free()
        topology.free()


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

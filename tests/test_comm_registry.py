"""Collective algorithms as registered objects: the table names only registered algorithms that
take what its rows cover, an algorithm registered from a test runs by name and refuses what it
does not support, and the communicator answers what strategies ask of the algorithms."""
import functools
import types

import numpy as np
import pytest

from fleetmpi.comm import registry
from fleetmpi.comm.algorithm import AllreduceAlgorithm
from fleetmpi.comm.algorithm_choice import (ANY, CHOICES, COMPRESSED, NATIVE_BELOW_BYTES,
                                            TIMED)
from fleetmpi.comm.topology import NODES, ONE_NODE, ONE_RANK

from comm_support import all_data, close, equal, ok, raises, world

TOPOLOGIES = (ONE_RANK, ONE_NODE, NODES)


def context(transport, topology):
    """The part of an ``AlgorithmContext`` a refusal reads, for a world of that kind."""
    size, nodes = {ONE_RANK: (1, 1), ONE_NODE: (4, 1), NODES: (4, 2)}[topology]
    return types.SimpleNamespace(transport_name=transport, world_topology=topology, size=size,
                                 topology=types.SimpleNamespace(num_nodes=nodes))


class StarAllreduceAlgorithm(AllreduceAlgorithm):
    """Rank 0 adds every rank's buffer in rank order and sends the sum back: a test's own
    algorithm, float64 sums over MPI only."""

    name = "star"
    ops = ("sum",)
    dtypes = (np.dtype(np.float64),)
    transports = ("mpi",)

    def run(self, ctx, buf, op, compression, index, sendbuf=None):
        transport = ctx.transports[index]

        def fn(b, s=None):
            if s is not None:
                b[...] = s
            if ctx.rank:
                transport.send(b, 0)
                transport.recv(b, 0)
                return
            part = np.empty_like(b)
            for source in range(1, ctx.size):
                transport.recv(part, source)
                b += part
            for dest in range(1, ctx.size):
                transport.send(b, dest)
        if sendbuf is None:
            ctx.run_on(index, fn, buf)
        else:
            ctx.run_on(index, fn, buf, sendbuf)


@pytest.fixture
def star():
    algorithm = registry.register(StarAllreduceAlgorithm())
    yield algorithm
    registry.unregister(algorithm)


def test_every_row_names_a_registered_algorithm_that_takes_what_the_row_covers():
    for row in CHOICES:
        names = ("ring", "shm") if row.algorithm == TIMED else (row.algorithm,)
        transports = ("mpi", "nccl") if row.transport == ANY else (row.transport,)
        topologies = TOPOLOGIES if row.topology == ANY else (row.topology,)
        for name in names:
            algorithm = registry.lookup(row.collective, name)
            assert algorithm.collective == row.collective and algorithm.name == name
            if row.request in (COMPRESSED, ANY) and algorithm.ops is not None:
                assert "fp16" in algorithm.compressions, row
            for transport in transports:
                for topology in topologies:
                    assert algorithm.refusal(context(transport, topology)) is None, (row,
                                                                                     topology)


def test_each_collective_lists_its_algorithms_in_order_of_registration():
    assert [a.name for a in registry.algorithms_of("allreduce")] == [
        "ring", "hierarchical", "native", "shm"]
    assert [a.name for a in registry.algorithms_of("broadcast")] == ["tree", "chain", "native"]
    assert [a.name for a in registry.algorithms_of("reduce_scatter")] == ["ring", "native"]
    with pytest.raises(ValueError, match="algorithm='tree' is not an allgather algorithm; "
                                         "allowed: None, 'ring', 'native'"):
        registry.lookup("allgather", "tree")
    with pytest.raises(ValueError, match=r"algorithm=\['ring'\] is not an allreduce"):
        registry.lookup("allreduce", ["ring"])


def test_shm_refuses_nccl_and_several_nodes_saying_what_it_needs():
    shm = registry.lookup("allreduce", "shm")
    assert shm.refusal(context("mpi", ONE_NODE)) is None
    for transport, topology in (("nccl", ONE_NODE), ("mpi", NODES)):
        reason = shm.refusal(context(transport, topology))
        assert reason.startswith("algorithm='shm' runs over transport 'mpi' on one rank or one "
                                 f"node (this job: transport {transport!r}"), reason


def test_registering_adds_a_name_once_and_unregistering_takes_it_back():
    names = list(registry.NAMES)
    algorithm = registry.register(StarAllreduceAlgorithm())
    try:
        assert registry.lookup("allreduce", "star") is algorithm
        assert registry.NAMES == names + ["star"]
        with pytest.raises(ValueError, match="allreduce algorithm 'star' is registered already"):
            registry.register(StarAllreduceAlgorithm())
    finally:
        registry.unregister(algorithm)
    assert registry.NAMES == names
    with pytest.raises(ValueError, match="algorithm='star' is not an allreduce algorithm"):
        registry.lookup("allreduce", "star")


@pytest.mark.mpi
def test_an_algorithm_registered_from_a_test_runs_by_name_on_every_path(star):
    comm = world()
    stack = all_data(comm.size, 37, np.float64, case=5)
    want = functools.reduce(np.add, stack)  # rank order, as the star adds
    mine = stack[comm.rank]
    out = np.empty_like(mine)
    for _ in range(3):  # checked, then the repeats
        equal(comm.allreduce(mine, algorithm="star"), want)
        equal(comm.allreduce(mine, algorithm="star", out=out), want)
    arrays = [mine[:30].copy(), mine[30:].copy()]
    comm.allreduce_many(arrays, algorithm="star")
    equal(np.concatenate(arrays), want)
    equal(mine, stack[comm.rank])


@pytest.mark.mpi
def test_a_registered_algorithm_refuses_what_it_does_not_support_on_every_rank(star):
    comm = world()
    with raises(ValueError, match="algorithm='star' does not compute op='max'; it computes sum"):
        comm.allreduce(np.ones(3), op="max", algorithm="star")
    with raises(ValueError, match="algorithm='star' does not reduce float32; it reduces float64"):
        comm.allreduce(np.ones(3, np.float32), algorithm="star")
    with raises(ValueError, match="compression='fp16' needs algorithm 'ring' or 'hierarchical'; "
                                  "'star' reduces in the array's own dtype"):
        comm.allreduce(np.ones(3), algorithm="star", compression="fp16")
    close(comm.allreduce(np.ones(3), algorithm="star"), np.full(3, float(comm.size)))


@pytest.mark.mpi
def test_reduce_scatter_offsets_are_where_reduce_scatter_cuts():
    comm = world()
    for n in (0, 1, comm.size + 1, 257):
        offsets = comm.reduce_scatter_offsets(n)
        ok(offsets == tuple(np.cumsum([0] + [len(p) for p in np.array_split(np.arange(n),
                                                                             comm.size)])),
           f"offsets {offsets} of {n}")
        stack = all_data(comm.size, n, np.float64, case=n)
        block = comm.reduce_scatter(stack[comm.rank])
        close(block, stack.sum(axis=0)[offsets[comm.rank]:offsets[comm.rank + 1]],
              rtol=1e-12, atol=1e-9)


@pytest.mark.mpi
def test_the_small_message_policy_is_the_tables_native_row_with_or_without_two_levels():
    comm = world()
    for asked in (comm, comm.with_options(use_hierarchical_allreduce=True)):
        ok(asked.prefers_native(NATIVE_BELOW_BYTES - 1))
        ok(not asked.prefers_native(NATIVE_BELOW_BYTES))
        ok(not asked.prefers_native(4, compression="fp16"))

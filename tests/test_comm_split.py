"""``Communicator.split`` and ``with_options``: a derived communicator keeps every setting of
its parent but the ones named, the same request returns the same communicator, a rank given
no color gets None, and a sharding group inherits the strategy's hierarchical allreduce."""
import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.comm import get_communicator
from comm_support import equal, ok, raises
from strategy_support import make_mlp, make_strategy


def world():
    fleet.init(is_collective=True)
    return get_communicator()


@pytest.mark.mpi(min_size=2)
def test_split_inherits_every_setting_but_the_overrides_and_is_made_once():
    comm = world().with_options(chunk_bytes=4096, fuse_grad_size_in_MB=7)
    pairs = comm.split(comm.rank // 2, fuse_broadcast_MB=3)
    expected = dict(comm.settings(), fuse_broadcast_MB=3)
    if expected["hierarchical_allreduce_inter_nranks"] is not None and \
            pairs.size % expected["hierarchical_allreduce_inter_nranks"]:
        expected["hierarchical_allreduce_inter_nranks"] = None
    ok(pairs.settings() == expected, f"{pairs.settings()} != {expected}")
    ok(pairs.size == min(2, comm.size - comm.rank // 2 * 2), f"size {pairs.size}")
    ok(comm.split(comm.rank // 2, fuse_broadcast_MB=3) is pairs, "made again")
    ok(comm.with_options(chunk_bytes=4096) is comm, "no change made a new communicator")
    total = pairs.allreduce(np.array([float(comm.rank)]))
    first = comm.rank // 2 * 2
    equal(total, np.array([float(sum(range(first, first + pairs.size)))]))


@pytest.mark.mpi(min_size=2)
def test_a_rank_without_a_color_gets_none_and_the_others_a_group():
    comm = world()
    members = comm.split(None if comm.rank == 0 else 1)
    if comm.rank == 0:
        ok(members is None, "rank 0 got a communicator")
    else:
        total = float(members.allreduce(np.ones(1))[0])
        ok(members.size == comm.size - 1 and total == comm.size - 1.0,
           f"size {members.size}, sum {total}")


@pytest.mark.mpi(min_size=2)
def test_ranks_asking_for_different_splits_each_get_theirs():
    """Rank 0 asks for a split it asked for before, the others for a new one: every rank
    exchanges its request first, so all make the new one rather than some waiting."""
    comm = world()
    first = comm.split(0, fuse_broadcast_MB=5)
    again = comm.split(0, fuse_broadcast_MB=5 if comm.rank == 0 else 6)
    ok(again is not first and again.size == comm.size, "the split was not made anew")


@pytest.mark.mpi(min_size=2)
def test_an_unknown_setting_is_refused():
    comm = world()
    with raises(TypeError, match=r"unknown communicator setting\(s\) \['chunk'\]; allowed: "):
        comm.with_options(chunk=1)


@pytest.mark.mpi(min_size=4)
def test_a_sharding_group_keeps_the_hierarchical_allreduce():
    fleet.init(is_collective=True)
    if fleet.worker_num() != 4:
        pytest.skip("two sharding groups of two ranks")
    strategy = make_strategy(
        use_hierarchical_allreduce=True, hierarchical_allreduce_inter_nranks=2, sharding=True,
        sharding_configs={"stage": 2, "hybrid_dp": True, "sharding_group_size": 2})
    model = fleet.distributed_model(make_mlp())
    opt = fleet.distributed_optimizer(
        fleet.optimizer.SGD(0.1, parameters=model.parameters()), strategy)
    sharding = opt.strategies["sharding"]
    for name, group in (("group", sharding.group), ("replicas", sharding.replicas)):
        settings = group.settings()
        ok(settings["use_hierarchical_allreduce"], f"the {name} runs flat: {settings}")
        ok(settings["hierarchical_allreduce_inter_nranks"] == 2, f"{name}: {settings}")
        ok(settings["fuse_grad_size_in_MB"] == strategy.fuse_grad_size_in_MB, f"{name}")

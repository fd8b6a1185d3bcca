"""The hybrid layout: degrees resolved and refused naming each, ranks over (dp, pp, sharding,
mp) with mp innermost, and at N ranks every axis's communicator holding exactly the ranks that
differ from this one in that axis alone, with ``fleet.get_hybrid_communicate_group()``
answering Paddle's queries."""
import itertools

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.comm import hybrid_topology
from fleetmpi.comm.hybrid_topology import AXES, coordinates, rank_of, resolve_degrees
from comm_support import equal, ok, raises
from strategy_support import make_strategy, world_gather


def configs(dp=-1, mp=1, pp=1, sharding=1):
    return {"dp_degree": dp, "mp_degree": mp, "pp_degree": pp, "sharding_degree": sharding}


def test_dp_degree_minus_one_takes_what_the_others_leave():
    assert resolve_degrees(configs(mp=2), 8) == {"data": 4, "pipe": 1, "sharding": 1,
                                                 "model": 2}
    assert resolve_degrees(configs(mp=2, pp=2, sharding=2), 8)["data"] == 1
    assert resolve_degrees(configs(dp=2, mp=2), 4)["data"] == 2


def test_a_wrong_product_is_refused_naming_every_degree():
    with pytest.raises(ValueError, match=r"dp_degree=2, pp_degree=2, sharding_degree=1, "
                                         r"mp_degree=2.*= 8, but the world has 4 rank"):
        resolve_degrees(configs(dp=2, mp=2, pp=2), 4)
    with pytest.raises(ValueError, match=r"mp_degree x pp_degree x sharding_degree = 3 does "
                                         r"not divide the world size 4"):
        resolve_degrees(configs(mp=3), 4)
    with pytest.raises(ValueError, match=r"hybrid_configs\['dp_degree'\]=0"):
        resolve_degrees(configs(dp=0), 4)


def test_tensor_parallel_degree_is_the_model_parallel_degree():
    from fleetmpi import hybrid

    strategy = make_strategy(tensor_parallel=True,
                             tensor_parallel_configs={"tensor_parallel_degree": 2})
    assert hybrid.is_hybrid(strategy) and hybrid.hybrid_configs(strategy)["mp_degree"] == 2
    strategy.hybrid_configs = {"mp_degree": 4}
    with pytest.raises(ValueError, match="tensor_parallel_degree'\\]=2 and "
                                         "hybrid_configs\\['mp_degree'\\]=4"):
        hybrid.hybrid_configs(strategy)
    assert not hybrid.is_hybrid(make_strategy(hybrid_configs={"dp_degree": 4}))


def test_model_parallel_is_innermost():
    degrees = {"data": 2, "pipe": 3, "sharding": 2, "model": 2}
    ranks = []
    for coords in itertools.product(*(range(degrees[a]) for a in AXES)):
        named = dict(zip(AXES, coords))
        ranks.append(rank_of(named, degrees))
        assert coordinates(ranks[-1], degrees) == named
    assert ranks == list(range(24))
    assert coordinates(1, degrees)["model"] == 1 and coordinates(2, degrees)["sharding"] == 1


LAYOUTS = [configs(mp=2), configs(pp=2, mp=2), configs(dp=2, sharding=2),
           configs(mp=4), configs(pp=2, sharding=2), configs(dp=1, sharding=2, mp=2)]


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: "-".join(f"{k[:2]}{v}"
                                                                   for k, v in c.items()))
def test_every_axis_group_holds_the_ranks_differing_in_that_axis_alone(layout):
    fleet.init(is_collective=True)
    size = fleet.worker_num()
    if size != 4:
        pytest.skip("layouts of four ranks")
    strategy = make_strategy(hybrid_configs=layout)
    fleet.init(is_collective=True, strategy=strategy)
    group = fleet.get_hybrid_communicate_group()
    degrees = resolve_degrees(layout, size)
    rank = fleet.worker_index()
    mine = coordinates(rank, degrees)
    answers = {"model": (group.get_model_parallel_rank(), group.get_model_parallel_world_size(),
                         group.get_model_parallel_group()),
               "data": (group.get_data_parallel_rank(), group.get_data_parallel_world_size(),
                        group.get_data_parallel_group()),
               "pipe": (group.get_stage_id(), group.get_pipe_parallel_world_size(),
                        group.get_pipe_parallel_group()),
               "sharding": (group.get_sharding_parallel_rank(),
                            group.get_sharding_parallel_world_size(),
                            group.get_sharding_parallel_group())}
    for axis, (coordinate, world_size, communicator) in answers.items():
        ok(coordinate == mine[axis] and world_size == degrees[axis], f"{axis} on rank {rank}")
        expected = sorted(r for r in range(size)
                          if all(coordinates(r, degrees)[a] == mine[a] for a in AXES if a != axis))
        if world_size == 1:
            ok(communicator is None, f"{axis}: a group of one is None")
            continue
        members = communicator.allgather(np.array([rank], dtype=np.int64)).ravel().tolist()
        equal(members, expected, err_msg=axis)
        ok(communicator.rank == mine[axis], f"{axis}: ranked by its coordinate")
    data = group.data_communicator
    same_model = [r for r in range(size) if coordinates(r, degrees)["model"] == mine["model"]]
    if len(same_model) == 1:
        ok(data is None)
    else:
        members = data.allgather(np.array([rank], dtype=np.int64)).ravel().tolist()
        key = [(coordinates(r, degrees)["data"], coordinates(r, degrees)["sharding"],
                coordinates(r, degrees)["pipe"]) for r in same_model]
        equal(members, [r for _, r in sorted(zip(key, same_model))])
    equal(world_gather(np.array(list(mine.values()))), [list(coordinates(r, degrees).values())
                                                        for r in range(size)])
    fleet.init(is_collective=True, strategy=fleet.DistributedStrategy())
    with raises(RuntimeError, match="no hybrid layout"):
        fleet.get_hybrid_communicate_group()
    ok(hybrid_topology.current() is None)

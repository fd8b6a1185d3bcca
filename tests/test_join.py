"""Uneven data under ``fleet.Join`` (docs/reliability.md, docs/data.md): ranks whose batches
run out first answer the others' steps with zero gradients, the averages count only the ranks
that had a batch, and every rank ends where one process ends that trains, at each step, on
the union of that step's batches. Without ``Join`` the rank that runs out is reported
(``test_uneven.py``).

Rank ``r`` trains ``steps[r]`` steps on its shard of ``global_batch(t)``; the reference is one
process (``local=True``, the same strategy) training at step ``t`` on the shards of the ranks
with a ``t``-th batch, concatenated.
"""
import numpy as np
import pytest

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from fleetmpi.core import backend
from fleetmpi import nn, optimizer
from fleetmpi.strategies.join import NOT_JOINABLE, check_joinable
from comm_support import close, equal, ok
from strategy_support import global_batch, make_mlp, make_strategy, shard, world_gather
from test_amp import FP16_ATOL, SCHEDULE_CONFIGS

# Steps per rank, from the number of ranks.
COUNTS = {
    "first runs out": lambda size: [3] + [5] * (size - 1),
    "last runs out": lambda size: [5] * (size - 1) + [2],
    "one by one": lambda size: [2 + rank for rank in range(size)],
    "even": lambda size: [4] * size,
}
IDIOMS = ("minimize", "dygraph", "minimize(loss)")


def world():
    fleet.init(is_collective=True)
    return fleet.worker_num(), fleet.worker_index()


def momentum(parameters, learning_rate=0.1):
    """(optimizer, the scheduler the loop steps once per batch, or None)."""
    return optimizer.Momentum(learning_rate=learning_rate, momentum=0.9,
                              parameters=parameters), None


def adam(parameters):
    return optimizer.Adam(learning_rate=0.01, parameters=parameters), None


def decayed_momentum(parameters):
    scheduler = optimizer.lr.StepDecay(0.1, step_size=2, gamma=0.5)
    return momentum(parameters, scheduler)[0], scheduler


STRATEGIES = {
    "default": (make_strategy, momentum, "float64"),
    "lamb": (lambda: make_strategy(lamb=True), adam, "float64"),
    "fp16_allreduce": (lambda: make_strategy(fp16_allreduce=True), momentum, "float64"),
    "amp": (lambda: make_strategy(amp=True, amp_configs=dict(SCHEDULE_CONFIGS)), momentum,
            "float32"),
    "scheduler per batch": (make_strategy, decayed_momentum, "float64"),
}


def step_once(opt, model, x, y, idiom):
    if idiom == "minimize":
        opt.minimize(model, nn.CrossEntropyLoss(), x, y)
        return
    loss = F.cross_entropy(model(x), y)
    if idiom == "dygraph":
        loss.backward()
        opt.step()
    else:
        opt.minimize(loss)
    opt.clear_grad()


def rank_batch(step, rank, size):
    x, y = global_batch(step)
    return shard(x, rank, size), shard(y, rank, size)


def train_joined(steps, case, idiom, bad=None):
    """This rank trains ``steps[rank]`` steps inside ``fleet.Join``; ``bad``: (rank, step)
    whose batch holds a NaN. Returns (model, distributed optimizer, the Join)."""
    make, make_optimizer, dtype = STRATEGIES[case]
    fleet.init(is_collective=True)
    size, rank = fleet.worker_num(), fleet.worker_index()
    backend.manual_seed(0)
    model = fleet.distributed_model(make_mlp(dtype=dtype))
    inner, scheduler = make_optimizer(model.parameters())
    opt = fleet.distributed_optimizer(inner, make())
    with fleet.Join(opt) as join:
        for step in range(steps[rank]):
            x, y = rank_batch(step, rank, size)
            x = x.astype(dtype)
            if (rank, step) == bad:
                x[0, 0] = np.nan
            step_once(opt, model, x, y, idiom)
            if scheduler is not None:
                scheduler.step()
    return model, opt, join


def train_union(steps, case):
    """One process training at each step on the union of the batches of the ranks that have
    one at that step."""
    make, make_optimizer, dtype = STRATEGIES[case]
    size = len(steps)
    backend.manual_seed(0)
    model = make_mlp(dtype=dtype)
    inner, scheduler = make_optimizer(model.parameters())
    opt = fleet.distributed_optimizer(inner, make(), local=True)
    for step in range(max(steps)):
        parts = [rank_batch(step, rank, size) for rank in range(size) if step < steps[rank]]
        x = np.concatenate([x for x, _ in parts]).astype(dtype)
        y = np.concatenate([y for _, y in parts])
        opt.minimize(model, nn.CrossEntropyLoss(), x, y)
        if scheduler is not None:
            scheduler.step()
    return model, opt


def flat_state(model, opt):
    """Parameters and optimizer arrays, one vector."""
    state = opt.state_dict()
    arrays = [v for _, v in sorted(model.state_dict().items())]
    arrays += [np.asarray(state[k], dtype=np.float64) for k in sorted(state)
               if hasattr(state[k], "shape")]
    return np.concatenate([backend.to_numpy(a).astype(np.float64).ravel() for a in arrays])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("counts", sorted(COUNTS))
@pytest.mark.parametrize("idiom", IDIOMS)
def test_joined_ranks_train_as_one_process_on_the_union_of_the_batches(counts, idiom):
    size, _ = world()
    steps = COUNTS[counts](size)
    model, opt, join = train_joined(steps, "default", idiom)
    reference, ref_opt = train_union(steps, "default")
    for name, value in reference.state_dict().items():
        close(model.state_dict()[name], value, rtol=1e-10, atol=1e-12, err_msg=name)
    mine = flat_state(model, opt)
    equal(world_gather(mine), np.tile(mine, (size, 1)))
    last = max(r for r, s in enumerate(steps) if s == max(steps))
    ok(join.last_joined == last, f"last_joined {join.last_joined}, want {last}")
    ok(opt.step_count == max(steps) and opt.inner.step_count == ref_opt.inner.step_count,
       f"steps {opt.step_count}, {opt.inner.step_count}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", sorted(set(STRATEGIES) - {"default"}))
def test_strategies_that_join_train_as_one_process_on_the_union(case):
    size, _ = world()
    steps = COUNTS["one by one"](size)
    model, opt, _ = train_joined(steps, case, "dygraph")
    reference, ref_opt = train_union(steps, case)
    tolerance = {"atol": FP16_ATOL} if case in ("amp", "fp16_allreduce") else {"atol": 1e-12}
    for name, value in reference.state_dict().items():
        close(model.state_dict()[name], value, rtol=1e-6 if tolerance["atol"] > 1e-6 else 1e-10,
              err_msg=name, **tolerance)
    mine = flat_state(model, opt)
    equal(world_gather(mine), np.tile(mine, (size, 1)))
    if case == "amp":
        ok(opt.strategies["amp"].state_dict() == ref_opt.strategies["amp"].state_dict(),
           f"{opt.strategies['amp'].state_dict()} != {ref_opt.strategies['amp'].state_dict()}")
    if case == "scheduler per batch":
        lr = world_gather(np.array([opt.inner.get_lr()]))
        equal(lr, np.full_like(lr, ref_opt.inner.get_lr()))


@pytest.mark.mpi(min_size=2)
def test_a_nan_on_a_rank_still_training_stops_every_rank_the_joined_ones_too():
    size, rank = world()
    steps = [2] + [4] * (size - 1)
    error = None
    try:
        train_joined(steps, "default", "minimize", bad=(size - 1, 3))
    except fleet.NonFiniteError as raised:
        error = raised
    ok(error is not None, f"rank {rank}: no NonFiniteError")
    ok(f"step 3: rank {size - 1} (loss and local gradient)" in str(error), str(error))


@pytest.mark.mpi(min_size=2)
def test_join_with_equal_counts_is_bit_for_bit_the_run_without_it():
    """With every rank training every step the Join's averages are the plain mean."""
    size, rank = world()
    joined, opt, _ = train_joined([3] * size, "default", "minimize")
    backend.manual_seed(0)
    model = fleet.distributed_model(make_mlp())
    plain = fleet.distributed_optimizer(momentum(model.parameters())[0], make_strategy())
    for step in range(3):
        step_once(plain, model, *rank_batch(step, rank, size), "minimize")
    for name, value in model.state_dict().items():
        equal(joined.state_dict()[name], value, err_msg=name)


def test_alone_join_changes_nothing_and_names_rank_0():
    joined, _, join = train_joined([3], "default", "dygraph")
    reference, _ = train_union([3], "default")
    for name, value in reference.state_dict().items():
        equal(joined.state_dict()[name], value, err_msg=name)
    assert join.last_joined == 0


@pytest.mark.parametrize("name", sorted(NOT_JOINABLE))
def test_every_strategy_that_cannot_join_is_refused_with_its_reason(name):
    with pytest.raises(ValueError, match=f"cannot carry strategy {name}: "
                                         f"{NOT_JOINABLE[name][:30]}"):
        check_joinable(["amp", name])
    check_joinable(["amp", "recompute", "lamb", "fp16_allreduce", "nonfinite_check"])


@pytest.mark.parametrize("fields", [{"sync_batch_norm": True},
                                    {"gradient_merge": True,
                                     "gradient_merge_configs": {"k_steps": 2}}])
def test_join_refuses_an_optimizer_whose_strategy_cannot_join(fields):
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = fleet.distributed_model(make_mlp())
    opt = fleet.distributed_optimizer(momentum(model.parameters())[0], make_strategy(**fields))
    name = next(iter(fields))
    with pytest.raises(ValueError, match=f"fleet.Join cannot carry strategy {name}"):
        with fleet.Join(opt):
            pass
    ok(all(hook.name != "join" for hook in opt.hooks), "the refused Join left its hook")


def test_join_takes_a_distributed_optimizer():
    with pytest.raises(TypeError, match="not Momentum"):
        fleet.Join(momentum(make_mlp().parameters())[0])

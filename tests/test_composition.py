"""Composition of strategies: the fixed hook order, every pair the code says works really runs
(at N ranks, with all ranks ending identical), every pair it refuses is refused naming both
and why, recompute never changes the math of what it is combined with, the pair table in the
docs is current, and fields without effect are reported."""
import itertools
import logging

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.core import backend
from fleetmpi import nn, optimizer
from fleetmpi.core.log import logger
from fleetmpi.strategies import compose, field_effects, inert_fields
from fleetmpi.strategies.gradient_allreduce import plan_gradient_buckets
from comm_support import equal, ok, raises
from strategy_support import is_running_statistic, make_strategy, train, world_gather


CONFIGS = {
    "sync_batch_norm": None,
    "recompute": {"checkpoints": ["act0", "act1"]},
    "amp": {"init_loss_scaling": 1024.0},
    "gradient_merge": {"k_steps": 2},
    "localsgd": {"k_steps": 2, "begin_step": 1},
    "adaptive_localsgd": {"init_k_steps": 2, "begin_step": 1},
    "lars": {"lars_coeff": 0.01},
    "lamb": None,
    "dgc": {"sparsity": [0.5]},
    "tensor_parallel": None,
    "pipeline": {"micro_batch": 2},
    "fp16_allreduce": None,
    "sharding": None,
}
# Three steps end every schedule above on a step where the ranks synchronise.
STEPS = 3
SEED_TABLE = [("amp", "recompute"), ("dgc", "recompute"), ("lars", "recompute"),
              ("lamb", "recompute"), ("amp", "localsgd"), ("amp", "adaptive_localsgd"),
              ("amp", "lars"), ("amp", "lamb"), ("amp", "recompute", "lars"),
              ("amp", "recompute", "lamb")]
WORKING_PAIRS = [pair for pair in itertools.combinations(compose.ORDER, 2)
                 if frozenset(pair) not in compose.CONFLICTS]


def model_with_batch_norm():
    return nn.Sequential(("fc0", nn.Linear(6, 16)), ("bn0", nn.BatchNorm1D(16)),
                         ("act0", nn.Tanh()), ("fc1", nn.Linear(16, 12)), ("act1", nn.ReLU()),
                         ("fc2", nn.Linear(12, 4)))


def strategy_of(names):
    fields = {}
    for name in names:
        fields[name] = True
        if CONFIGS[name] is not None:
            fields[f"{name}_configs"] = CONFIGS[name]
    return make_strategy(**fields)


def optimizer_for(names):
    if "lamb" in names:
        return lambda ps: optimizer.Adam(learning_rate=0.01, parameters=ps)
    return lambda ps: optimizer.Momentum(learning_rate=0.05, momentum=0.9, parameters=ps)


def run(names, local=False):
    backend.manual_seed(0)
    start = model_with_batch_norm().state_dict()
    model, opt, losses = train(strategy_of(names), optimizer_for(names), steps=STEPS,
                               make_model=model_with_batch_norm, local=local)
    return start, model, opt, losses


def check_trained(names, start, model, losses):
    label = "+".join(names)
    ok(np.all(np.isfinite(losses)), f"{label}: losses {losses}")
    state = model.state_dict()
    ok(all(np.all(np.isfinite(v)) for v in state.values()), f"{label}: non-finite parameters")
    ok(any(not np.array_equal(start[n], state[n]) for n in start), f"{label}: nothing trained")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("names", WORKING_PAIRS + SEED_TABLE, ids="+".join)
def test_working_combination_trains_and_ranks_agree(names):
    start, model, opt, losses = run(names)
    check_trained(names, start, model, losses)
    expected = [name for name in compose.ORDER if name in names
                and name not in ("fp16_allreduce", "sharding")]
    if "amp" not in names:  # amp's loss scaling checks the gradients itself
        expected.append("nonfinite_check")
    expected.append("sharding" if "sharding" in names else "fp16_allreduce"
                    if "fp16_allreduce" in names else "gradient_allreduce")
    ok([hook.name for hook in opt.hooks] == expected,
       f"hooks {[hook.name for hook in opt.hooks]}, expected {expected}")
    for name, value in model.state_dict().items():
        if not is_running_statistic(name):
            equal(world_gather(value)[0], value, err_msg=f"{'+'.join(names)}: {name}")


@pytest.mark.parametrize("names", WORKING_PAIRS + SEED_TABLE, ids="+".join)
def test_working_combination_trains_in_one_process(names):
    fleet.init(is_collective=True)
    start, model, _, losses = run(names, local=True)
    check_trained(names, start, model, losses)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("names", [c for c in WORKING_PAIRS + SEED_TABLE if "recompute" in c],
                         ids="+".join)
def test_recompute_leaves_the_math_of_its_partners_unchanged(names):
    _, with_recompute, _, losses = run(names)
    _, without, _, plain_losses = run(tuple(n for n in names if n != "recompute"))
    equal(np.array(losses), np.array(plain_losses))
    for name, value in with_recompute.state_dict().items():
        equal(value, without.state_dict()[name], err_msg=name)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pair", sorted(tuple(sorted(p)) for p in compose.CONFLICTS),
                         ids="+".join)
def test_conflicting_pair_is_refused_naming_both(pair):
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = model_with_batch_norm()
    with raises(ValueError, match=f"strategies ({pair[0]} and {pair[1]}|{pair[1]} and "
                                  f"{pair[0]}) cannot be combined: .+"):
        fleet.distributed_optimizer(optimizer_for(pair)(model.parameters()),
                                    strategy_of(pair))


def test_every_strategy_field_is_implemented_refused_or_reported():
    message = fleet.DistributedStrategy()._message
    fields = []
    for field in message.DESCRIPTOR.fields:
        if field.name in ("build_strategy", "execution_strategy"):
            fields += [f"{field.name}.{sub.name}" for sub in field.message_type.fields]
        else:
            fields.append(field.name)
    strategies = set(compose.ORDER) | set(compose.SEARCHED)
    handled = (strategies | {f"{name}_configs" for name in strategies}
               | set(field_effects.EFFECTIVE) | set(field_effects.NO_EFFECT))
    assert not set(field_effects.EFFECTIVE) & set(field_effects.NO_EFFECT)
    assert set(fields) <= handled, sorted(set(fields) - handled)


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_fields_without_effect_are_reported_once():
    fleet.init(is_collective=True)
    strategy = make_strategy(cudnn_exhaustive_search=False, sync_nccl_allreduce=False)
    strategy.build_strategy.enable_inplace = True
    strategy.execution_strategy.num_iteration_per_run = 7
    handler = _Collect()
    logger.addHandler(handler)
    inert_fields._reported.clear()
    try:
        for _ in range(2):
            backend.manual_seed(0)
            model = model_with_batch_norm()
            fleet.distributed_optimizer(optimizer.SGD(parameters=model.parameters()), strategy)
    finally:
        logger.removeHandler(handler)
    reported = sorted(m.split(" ")[0] for m in handler.messages)
    assert reported == ["DistributedStrategy.build_strategy.enable_inplace",
                        "DistributedStrategy.cudnn_exhaustive_search",
                        "DistributedStrategy.execution_strategy.num_iteration_per_run",
                        "DistributedStrategy.sync_nccl_allreduce"], handler.messages
    assert all("has no effect in fleetmpi: " in m for m in handler.messages)


def test_fuse_grad_size_in_tflops_caps_the_layers_per_bucket():
    backend.manual_seed(0)
    model = model_with_batch_norm()
    opt = optimizer.SGD(parameters=model.parameters())
    layers = [[p.name.split(".")[0] for p in b.parameters]
              for b in plan_gradient_buckets(opt.runs, 1 << 30, max_layers=2)]
    assert layers == [["fc2", "fc2", "fc1", "fc1"], ["bn0", "bn0", "fc0", "fc0"]]
    single = plan_gradient_buckets(opt.runs, 1 << 30, max_layers=1)
    assert [len({p.name.split(".")[0] for p in b.parameters}) for b in single] == [1, 1, 1, 1]

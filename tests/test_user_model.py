"""A user's own model, written as Paddle dygraph users write one (attributes, a LayerList, a
residual branch, a weight used twice, a custom Function, a parameter from create_parameter),
trained with both idioms: N ranks match one process on the global batch, the two idioms match
each other bit for bit, every strategy of the seeds' table runs on it, a branch not taken (on
every rank or on some) neither hangs nor averages wrongly, and misuse gets a clear error."""
import contextlib

import numpy as np
import pytest

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from fleetmpi.core import backend
from fleetmpi import nn, optimizer
from comm_support import close, equal, ok
from strategy_support import (CLASSES, FEATURES, global_batch, make_strategy, shard, train_step,
                              world_gather)

STEPS = 3


class HalfScale(fleet.Function):
    """``x * 0.5`` with its own backward: a user's differentiable operation."""

    @staticmethod
    def forward(ctx, x):
        return x * 0.5

    @staticmethod
    def backward(ctx, dy):
        return dy * 0.5


class Block(nn.Layer):
    def __init__(self, width, dtype):
        super().__init__()
        self.fc = nn.Linear(width, width, dtype=dtype)

    def forward(self, x):
        return x + F.tanh(self.fc(x))


class UserNet(nn.Layer):
    """Every kind of registration and reuse a user model has; ``skip`` names a branch not
    taken: ``"all"`` on every rank, ``"odd"`` on odd ranks only."""

    def __init__(self, dtype="float64", skip=None):
        super().__init__()
        self.embed = nn.Linear(FEATURES, 16, dtype=dtype)
        self.blocks = nn.LayerList([Block(16, dtype) for _ in range(2)])
        self.shared = nn.Linear(16, 16, dtype=dtype)
        self.gain = self.create_parameter([16], dtype=dtype,
                                          default_initializer=nn.initializer.Constant(1.0))
        self.branch = nn.Linear(16, 16, dtype=dtype)
        self.head = nn.Linear(16, CLASSES, dtype=dtype)
        self.skip = skip

    def forward(self, x):
        h = F.relu(self.embed(x))
        for block in self.blocks:
            h = block(h)
        h = self.shared(F.tanh(self.shared(h)))
        if not self._skips_branch():
            h = h + F.relu(self.branch(h))
        h = HalfScale.apply(h) * self.gain
        return self.head(h)

    def _skips_branch(self):
        if self.skip == "all":
            return True
        return self.skip == "odd" and fleet.worker_index() % 2 == 1


def sgd_momentum(parameters):
    return optimizer.Momentum(learning_rate=0.1, momentum=0.9, parameters=parameters)


def train_user_model(strategy=None, idiom="dygraph", local=False, skip=None, steps=STEPS,
                     dtype="float64", make_optimizer=sgd_momentum, lazy=False):
    """Train ``UserNet`` from seed 0 (built under ``LazyGuard`` when ``lazy``): each rank on
    its shard of the global batch (the whole batch when ``local``). Returns ``(model,
    optimizer, losses)``."""
    fleet.init(is_collective=True)
    size, rank = (1, 0) if local else (fleet.worker_num(), fleet.worker_index())
    backend.manual_seed(0)
    with fleet.LazyGuard() if lazy else contextlib.nullcontext():
        net = UserNet(dtype, skip)
    model = fleet.distributed_model(net)
    opt = fleet.distributed_optimizer(make_optimizer(model.parameters()),
                                      strategy or fleet.DistributedStrategy(), local=local)
    losses = []
    for step in range(steps):
        x, y = global_batch(step)
        x, y = shard(x, rank, size).astype(dtype), shard(y, rank, size)
        losses.append(train_step(opt, model, x, y, idiom))
    return model, opt, losses


def assert_states_equal(a, b, check=equal, **tolerance):
    for name, value in a.state_dict().items():
        check(value, b.state_dict()[name], err_msg=name, **tolerance)


# -- registration --------------------------------------------------------------------------

def test_attributes_register_in_assignment_order_with_dotted_names():
    model = UserNet()
    names = [name for name, _ in model.named_parameters()]
    assert names == ["gain", "embed.weight", "embed.bias", "blocks.0.fc.weight",
                     "blocks.0.fc.bias", "blocks.1.fc.weight", "blocks.1.fc.bias",
                     "shared.weight", "shared.bias", "branch.weight", "branch.bias",
                     "head.weight", "head.bias"]
    assert [name for name, _ in model.named_sublayers()] == [
        "embed", "blocks", "blocks.0", "blocks.0.fc", "blocks.1", "blocks.1.fc", "shared",
        "branch", "head"]
    assert all(p.name == name for name, p in model.named_parameters())


def test_a_parameter_assigned_twice_is_one_parameter():
    model = UserNet()
    model.alias = model.shared
    assert len(model.parameters()) == 13
    assert [n for n, _ in model.named_sublayers()].count("alias") == 0


def test_assigning_before_super_init_is_a_clear_error():
    class Early(nn.Layer):
        def __init__(self):
            self.fc = nn.Linear(2, 2)
            super().__init__()

    with pytest.raises(RuntimeError, match="after calling super"):
        Early()


def test_a_model_without_parameters_is_refused_naming_it():
    class Empty(nn.Layer):
        def forward(self, x):
            return x

    fleet.init(is_collective=True)
    with pytest.raises(ValueError, match="Empty with no parameters"):
        fleet.distributed_model(Empty())
    with pytest.raises(ValueError, match="empty parameter list: the model has no parameters"):
        optimizer.SGD(parameters=Empty().parameters())


def test_state_dict_round_trips_and_set_value_writes_through():
    model = UserNet()
    state = model.state_dict()
    other = UserNet()
    other.gain.set_value(np.full(16, 3.0))
    assert np.all(other.gain.numpy() == 3.0)
    other.set_state_dict(state)
    assert_states_equal(model, other, np.testing.assert_array_equal)


# -- one process: the idioms agree, the strategies run ----------------------------------------

def test_the_two_idioms_train_identically_in_one_process():
    a, _, losses_a = train_user_model(idiom="minimize", local=True)
    b, _, losses_b = train_user_model(idiom="dygraph", local=True)
    np.testing.assert_array_equal(losses_a, losses_b)
    assert_states_equal(a, b, np.testing.assert_array_equal)


def test_a_branch_not_taken_leaves_its_parameters_untouched_in_one_process():
    backend.manual_seed(0)
    start = UserNet().state_dict()
    model, _, _ = train_user_model(skip="all", local=True)
    for name in ("branch.weight", "branch.bias"):
        np.testing.assert_array_equal(model.state_dict()[name], start[name])
        equal(model.branch.weight.grad, 0)
    assert not np.array_equal(model.state_dict()["head.weight"], start["head.weight"])


def test_misuse_of_the_dygraph_step_is_a_clear_error():
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = fleet.distributed_model(UserNet())
    opt = fleet.distributed_optimizer(sgd_momentum(model.parameters()))
    x, y = global_batch(0)
    loss = F.cross_entropy(model(x), y)
    doubled = loss * 2
    with pytest.raises(RuntimeError, match="before loss.backward"):
        opt.step()
    loss.backward()
    with pytest.raises(RuntimeError, match="called again after loss.backward"):
        model(x)
    with pytest.raises(RuntimeError, match="second backward"):
        doubled.backward()
    opt.step()
    opt.clear_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    with pytest.raises(RuntimeError, match="graph .* a second time"):
        loss.backward()


# -- N ranks --------------------------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("idiom", ["dygraph", "minimize"])
def test_data_parallel_user_model_equals_one_process_on_the_global_batch(idiom):
    model, _, _ = train_user_model(idiom=idiom)
    reference, _, _ = train_user_model(idiom=idiom, local=True)
    assert_states_equal(model, reference, close, rtol=1e-12, atol=1e-12)
    for name, value in model.state_dict().items():
        equal(world_gather(value)[0], value, err_msg=name)


@pytest.mark.mpi(min_size=2)
def test_the_two_idioms_are_bit_identical_at_n_ranks():
    a, _, losses_a = train_user_model(idiom="minimize")
    b, _, losses_b = train_user_model(idiom="dygraph")
    equal(np.array(losses_a), np.array(losses_b))
    assert_states_equal(a, b)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("skip", ["all", "odd"])
def test_a_branch_not_taken_neither_hangs_nor_averages_wrongly(skip):
    """With the branch skipped on odd ranks, its gradient is the average over all ranks of
    the gradients (zero where skipped): what one process computes from the mean of the
    per-rank losses."""
    strategy = make_strategy(fuse_all_reduce_ops=False)      # a bucket per parameter
    model, _, _ = train_user_model(strategy, skip=skip, steps=2,
                                   make_optimizer=lambda ps: optimizer.SGD(0.1, parameters=ps))
    fleet.init(is_collective=True)
    size, rank = fleet.worker_num(), fleet.worker_index()
    backend.manual_seed(0)
    replicas = [UserNet(skip=None) for _ in range(size)]
    reference = replicas[0]
    opt = optimizer.SGD(0.1, parameters=reference.parameters())
    for step in range(2):
        x, y = global_batch(step)
        grads = []
        for r, replica in enumerate(replicas):
            replica.set_state_dict(reference.state_dict())
            replica.skip = "all" if skip == "all" or (skip == "odd" and r % 2) else None
            for p in replica.parameters():
                p.clear_gradient()
            F.cross_entropy(replica(shard(x, r, size)), shard(y, r, size)).backward()
            grads.append([p.grad.numpy().copy() for p in replica.parameters()])
        for p, *per_rank in zip(reference.parameters(), *grads):
            p.grad[...] = backend.array_module().stack(per_rank).mean(axis=0)
        opt.step()
    assert_states_equal(model, reference, close, rtol=1e-12, atol=1e-12)
    ok(rank >= 0)


SEED_COMBINATIONS = {
    # strategies whose N-rank run is the single-process math on the global batch
    "amp": ({"amp": True, "amp_configs": {"init_loss_scaling": 1024.0}}, True),
    "recompute": ({"recompute": True,
                   "recompute_configs": {"checkpoints": ["blocks.0", "blocks.1"]}}, True),
    "gradient_merge": ({"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}},
                       True),
    "lars": ({"lars": True, "lars_configs": {"lars_coeff": 0.01}}, True),
    "fp16_allreduce": ({"fp16_allreduce": True}, True),
    "sharding": ({"sharding": True}, True),
    "amp+recompute+lars": ({"amp": True, "recompute": True, "lars": True,
                            "recompute_configs": {"checkpoints": ["blocks.1"]}}, True),
    # strategies whose ranks train apart between synchronisations
    "localsgd": ({"localsgd": True, "localsgd_configs": {"k_steps": 2, "begin_step": 1}},
                 False),
    "adaptive_localsgd": ({"adaptive_localsgd": True, "adaptive_localsgd_configs": {
        "init_k_steps": 2, "begin_step": 1}}, False),
    "dgc": ({"dgc": True, "dgc_configs": {"sparsity": [0.5]}}, False),
    "amp+localsgd": ({"amp": True, "localsgd": True,
                      "localsgd_configs": {"k_steps": 2, "begin_step": 1}}, False),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", sorted(SEED_COMBINATIONS))
def test_strategies_on_a_user_model(name):
    """Each strategy on the user model: the two idioms agree bit for bit at N ranks, the ranks
    agree where the strategy synchronises every step, and where its math is data parallel's,
    N ranks equal one process on the global batch."""
    fields, data_parallel_math = SEED_COMBINATIONS[name]
    dtype = "float32" if "amp" in fields else "float64"
    a, _, losses = train_user_model(make_strategy(**fields), idiom="dygraph", dtype=dtype,
                                    steps=4)
    b, _, _ = train_user_model(make_strategy(**fields), idiom="minimize", dtype=dtype, steps=4)
    ok(np.all(np.isfinite(losses)), f"{name}: losses {losses}")
    assert_states_equal(a, b)
    if data_parallel_math:
        reference, _, _ = train_user_model(make_strategy(**fields), local=True, dtype=dtype,
                                           steps=4)
        tolerance = {"rtol": 2e-3, "atol": 2e-3} if dtype == "float32" or "fp16" in name \
            else {"rtol": 1e-10, "atol": 1e-12}
        assert_states_equal(a, reference, close, **tolerance)
        for param_name, value in a.state_dict().items():
            equal(world_gather(value)[0], value, err_msg=param_name)


def test_fusion_fields_with_nothing_to_fuse_are_reported_not_applied():
    """Kernel fusion joins neighbouring layers of a Sequential; on a user model without one,
    applied_strategy says so (and keeps saying the Sequential's fusion applies)."""
    fleet.init(is_collective=True)
    strategy = make_strategy(fuse_elewise_add_act_ops=True)
    backend.manual_seed(0)
    model = fleet.distributed_model(UserNet())
    opt = fleet.distributed_optimizer(sgd_momentum(model.parameters()), strategy, local=True)
    assert "build_strategy.fuse_elewise_add_act_ops" not in fleet.applied_strategy().not_applied
    x, y = global_batch(0)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    reason = fleet.applied_strategy().not_applied["build_strategy.fuse_elewise_add_act_ops"]
    assert "no nn.Sequential" in reason
    sequential = nn.Sequential(nn.Linear(FEATURES, 8, dtype="float64"), nn.ReLU(),
                               nn.Linear(8, CLASSES, dtype="float64"))
    opt = fleet.distributed_optimizer(sgd_momentum(sequential.parameters()), strategy,
                                      local=True)
    opt.minimize(sequential, nn.CrossEntropyLoss(), x, y)
    assert sequential.fused_steps() == 1
    assert "build_strategy.fuse_elewise_add_act_ops" not in fleet.applied_strategy().not_applied


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("difference", ["width", "extra_layer", "dtype"])
def test_a_model_that_differs_between_ranks_is_named_on_every_rank(difference):
    """One error per rank naming the first parameter that differs and each rank's shape, where
    the broadcast's argument check named only counts."""
    from fleetmpi.training.model_agreement import ModelMismatchError

    fleet.init(is_collective=True)
    rank, size = fleet.worker_index(), fleet.worker_num()
    odd = rank % 2
    layers = [nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3 + (odd if difference == "width" else 0),
                                                    dtype="float64" if odd and difference == "dtype"
                                                    else None)]
    if difference == "extra_layer" and odd:
        layers.append(nn.Linear(3, 3))
    with pytest.raises(ModelMismatchError) as info:
        fleet.distributed_model(nn.Sequential(*layers))
    lines = str(info.value).splitlines()
    expected = {"width": ["2.weight of shape (8, 3) float32", "2.weight of shape (8, 4) float32"],
                "extra_layer": ["nothing: it has 4 entries", "3.weight of shape (3, 3) float32"],
                "dtype": ["2.weight of shape (8, 3) float32", "2.weight of shape (8, 3) float64"]}
    for other in range(size):
        assert f"  rank {other}: {expected[difference][other % 2]}" in lines, lines
    fleet.distributed_model(nn.Sequential(nn.Linear(4, 8)))   # the same model: no error

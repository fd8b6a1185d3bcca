"""pipeline: a stage per rank (x replicas) gives the gradients and parameters of the unpipelined
model with its gradients accumulated over the same micro-batches; 1F1B and F-then-B orders;
amp and recompute inside; stage assignment by device_guard and split points; refusals."""
import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi import backend, nn, optimizer
from fleetmpi.optimizer.clip import ClipGradByGlobalNorm
from fleetmpi.strategies.pipeline_schedule import (BACKWARD, FORWARD, SCHEDULE_MODES,
                                                   bubble_fraction, compute_order, in_flight)
from comm_support import close, equal, ok, raises
from strategy_support import global_batch, make_strategy, momentum, shard, world_gather

SIZES = (6, 16, 12, 10, 8, 4)
LINEARS = len(SIZES) - 1
STEPS = 3
MICRO_BATCH = 3


def staged_mlp(stages, dtype="float64"):
    """Linear ``fc0..fc4`` with Tanh between, spread over ``stages`` by device_guard."""
    layers = []
    for i in range(LINEARS):
        with fleet.device_guard(f"stage:{i * stages // LINEARS}"):
            layers.append((f"fc{i}", nn.Linear(SIZES[i], SIZES[i + 1], dtype=dtype)))
            if i < LINEARS - 1:
                layers.append((f"act{i}", nn.Tanh()))
    return nn.Sequential(*layers)


def layouts(size):
    """(stages, replicas) worth checking at ``size`` ranks: 2 stages at 2 ranks, 3 at 3,
    2 x 2 and 4 x 1 at 4."""
    return [(stages, size // stages) for stages in (2, 3, 4) if size % stages == 0]


def pipeline_strategy(micro_batch=MICRO_BATCH, mode="1F1B", **fields):
    return make_strategy(pipeline=True, pipeline_configs={"micro_batch": micro_batch,
                                                          "schedule_mode": mode}, **fields)


def train_pipeline(stages, strategy, replicas, local=False, dtype="float64", steps=STEPS):
    """Train ``staged_mlp(stages)``; each replica on its shard of the global batch (the
    whole batch when ``local``). Returns (model, optimizer, losses)."""
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = staged_mlp(stages, dtype)
    if not local:
        model = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(momentum(model.parameters()), strategy, local=local)
    replica = 0 if local else fleet.worker_index() // stages
    losses = []
    for step in range(steps):
        x, y = global_batch(step)
        n = 1 if local else replicas
        losses.append(float(opt.minimize(model, nn.CrossEntropyLoss(),
                                         shard(x, replica, n), shard(y, replica, n))))
    return model, opt, losses


def accumulated_reference(replicas, micro_batch, steps=STEPS):
    """One process, no pipeline: per step the gradients of every micro-batch of every
    replica's shard summed and divided by their number, then one Momentum step. Returns
    (parameters, last step's gradients, per-step loss of each replica)."""
    backend.manual_seed(0)
    model = staged_mlp(1)
    opt = momentum(model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    for step in range(steps):
        x, y = global_batch(step)
        total = {name: 0 for name, _ in model.named_parameters()}
        replica_losses = []
        for replica in range(replicas):
            xs, ys = shard(x, replica, replicas), shard(y, replica, replicas)
            size = len(xs) // micro_batch
            mean = 0
            for k in range(micro_batch):
                part = slice(k * size, (k + 1) * size)
                mean += float(loss_fn.forward(model.forward(xs[part]), ys[part])) / micro_batch
                model.backward(loss_fn.backward(), input_grad=False)
                for name, p in model.named_parameters():
                    total[name] = total[name] + p.grad
            replica_losses.append(mean)
        for name, p in model.named_parameters():
            p.grad[...] = total[name] / (replicas * micro_batch)
        grads = {name: p.grad.copy() for name, p in model.named_parameters()}
        opt.step()
        losses.append(replica_losses)
    return model.state_dict(), grads, losses


# -- the proof at N ranks --------------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", SCHEDULE_MODES)
def test_stages_x_replicas_equal_accumulated_gradients(mode):
    fleet.init(is_collective=True)
    rank = fleet.worker_index()
    for stages, replicas in layouts(fleet.worker_num()):
        stage, replica = rank % stages, rank // stages
        label = f"{stages} stages x {replicas} replicas, {mode}"
        model, opt, losses = train_pipeline(stages, pipeline_strategy(mode=mode), replicas)
        expected, grads, expected_losses = accumulated_reference(replicas, MICRO_BATCH)
        own = {p.name for p in opt.inner.parameters()}
        ok(own == {p.name for p in model.parameters() if p.pipeline_stage == stage} and own,
           f"{label}: rank {rank} holds {sorted(own)}")
        state = model.state_dict()
        backend.manual_seed(0)
        start = staged_mlp(stages).state_dict()
        wrong = [f"gradient {p.name}" for p in opt.inner.parameters()
                 if not np.allclose(p.grad, grads[p.name], rtol=1e-10, atol=1e-13)]
        wrong += [name for name in own
                  if not np.allclose(state[name], expected[name], rtol=1e-10, atol=1e-13)]
        # Parameters of the other stages are never updated on this rank.
        wrong += [f"{name} moved" for name in set(state) - own
                  if not np.array_equal(state[name], start[name])]
        ok(not wrong, f"{label}: rank {rank} differs in {sorted(wrong)}")
        close(np.array(losses), np.array([step[replica] for step in expected_losses]),
              rtol=1e-10, err_msg=f"{label}: losses")


@pytest.mark.mpi(min_size=2)
def test_both_schedules_give_identical_parameters():
    fleet.init(is_collective=True)
    stages = layouts(fleet.worker_num())[0][0]
    replicas = fleet.worker_num() // stages
    one, _, one_losses = train_pipeline(stages, pipeline_strategy(mode="1F1B"), replicas)
    other, _, other_losses = train_pipeline(stages, pipeline_strategy(mode="F-then-B"),
                                            replicas)
    equal(np.array(one_losses), np.array(other_losses))
    for name, value in one.state_dict().items():
        equal(value, other.state_dict()[name], err_msg=name)


@pytest.mark.mpi(min_size=2)
def test_recompute_inside_the_pipeline_changes_nothing():
    fleet.init(is_collective=True)
    recompute = {"recompute": True, "recompute_configs": {"checkpoints": ["act0", "act2"]}}
    for stages, replicas in layouts(fleet.worker_num()):
        with_it, _, losses = train_pipeline(stages, pipeline_strategy(**recompute), replicas)
        without, _, plain = train_pipeline(stages, pipeline_strategy(), replicas)
        equal(np.array(losses), np.array(plain))
        for name, value in with_it.state_dict().items():
            equal(value, without.state_dict()[name], err_msg=f"{stages} stages: {name}")


@pytest.mark.mpi(min_size=2)
def test_amp_inside_the_pipeline_matches_one_process():
    fleet.init(is_collective=True)
    amp = {"amp": True, "amp_configs": {"init_loss_scaling": 1024.0}}
    rank = fleet.worker_index()
    for stages, replicas in layouts(fleet.worker_num()):
        # One process on the whole batch split into replicas x micro_batch micro-batches:
        # the same micro-batches the replicas run.
        model, opt, losses = train_pipeline(stages, pipeline_strategy(**amp), replicas,
                                            dtype="float32")
        local, local_opt, local_losses = train_pipeline(
            stages, pipeline_strategy(micro_batch=MICRO_BATCH * replicas, **amp), 1,
            local=True, dtype="float32")
        ok(opt.strategies["amp"].loss_scaling == local_opt.strategies["amp"].loss_scaling)
        expected = local.state_dict()
        wrong = [p.name for p in opt.inner.parameters()
                 if not np.allclose(p.data, expected[p.name], rtol=1e-5, atol=1e-6)]
        ok(not wrong, f"{stages} stages: rank {rank} differs in {wrong}")
        ok(all(np.isfinite(losses)), f"losses {losses}")


@pytest.mark.mpi(min_size=2)
def test_loss_is_returned_on_every_rank_of_a_replica():
    fleet.init(is_collective=True)
    for stages, replicas in layouts(fleet.worker_num()):
        _, _, losses = train_pipeline(stages, pipeline_strategy(), replicas)
        gathered = world_gather(np.array(losses))
        for rank in range(fleet.worker_num()):
            equal(gathered[rank], gathered[(rank // stages) * stages + stages - 1],
                  err_msg=f"rank {rank}")


@pytest.mark.mpi(min_size=2)
def test_gradient_merge_over_pipeline_steps():
    fleet.init(is_collective=True)
    stages, replicas = layouts(fleet.worker_num())[0]
    merge = {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}}
    model, opt, _ = train_pipeline(stages, pipeline_strategy(**merge), replicas, steps=4)
    local, _, _ = train_pipeline(stages, pipeline_strategy(micro_batch=MICRO_BATCH * replicas,
                                                           **merge), 1, local=True, steps=4)
    expected = local.state_dict()
    wrong = [p.name for p in opt.inner.parameters()
             if not np.allclose(p.data, expected[p.name], rtol=1e-10, atol=1e-13)]
    ok(not wrong, f"rank {fleet.worker_index()} differs in {wrong}")


# -- refusals at N ranks ---------------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
def test_stage_count_that_does_not_fit_the_world_is_refused():
    fleet.init(is_collective=True)
    size = fleet.worker_num()
    stages = next(s for s in range(2, LINEARS + 1) if size % s)
    backend.manual_seed(0)
    model = staged_mlp(stages)
    with raises(ValueError, match=f"{stages} stages do not fit a world of {size} ranks"):
        fleet.distributed_optimizer(momentum(model.parameters()), pipeline_strategy())


@pytest.mark.mpi(min_size=2)
def test_batch_that_does_not_split_into_micro_batches_is_refused_on_every_rank():
    fleet.init(is_collective=True)
    stages = layouts(fleet.worker_num())[0][0]
    backend.manual_seed(0)
    model = fleet.distributed_model(staged_mlp(stages))
    opt = fleet.distributed_optimizer(momentum(model.parameters()), pipeline_strategy(4))
    x, y = global_batch(0, batch=6)
    with raises(ValueError, match="batch of 6 samples .* micro_batch=4"):
        opt.minimize(model, nn.CrossEntropyLoss(), x, y)


@pytest.mark.mpi(min_size=2)
def test_global_norm_clipping_across_stages_is_refused():
    fleet.init(is_collective=True)
    stages = layouts(fleet.worker_num())[0][0]
    backend.manual_seed(0)
    model = staged_mlp(stages)
    opt = optimizer.Momentum(learning_rate=0.1, parameters=model.parameters(),
                             grad_clip=ClipGradByGlobalNorm(1.0))
    with raises(ValueError, match="ClipGradByGlobalNorm"):
        fleet.distributed_optimizer(opt, pipeline_strategy())


# -- one process ----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", SCHEDULE_MODES)
def test_all_stages_in_one_process_equal_accumulated_gradients(mode):
    model, opt, losses = train_pipeline(3, pipeline_strategy(mode=mode), 1, local=True)
    expected, grads, expected_losses = accumulated_reference(1, MICRO_BATCH)
    for name, value in model.state_dict().items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-10, atol=1e-13, err_msg=name)
    for p in opt.inner.parameters():
        np.testing.assert_allclose(p.grad, grads[p.name], rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(losses, [step[0] for step in expected_losses], rtol=1e-10)


def test_one_micro_batch_without_stages_is_plain_training_bit_for_bit():
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    plain = staged_mlp(1)
    opt = momentum(plain.parameters())
    for step in range(STEPS):
        opt.minimize(plain, nn.CrossEntropyLoss(), *global_batch(step))
    model, _, _ = train_pipeline(1, pipeline_strategy(1), 1, local=True)
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value, plain.state_dict()[name], err_msg=name)


def test_device_guard_names_stages_and_refuses_other_devices():
    with fleet.device_guard("gpu:2"):
        layer = nn.Linear(2, 3)
        with fleet.device_guard("stage:1"):
            inner = nn.Tanh()
    outside = nn.ReLU()
    assert (layer.pipeline_stage, inner.pipeline_stage, outside.pipeline_stage) == (2, 1, None)
    assert {p.pipeline_stage for p in layer.parameters()} == {2}
    for device in ("cpu", "gpu", "stage:-1", "xpu:0", 1, None):
        with pytest.raises(ValueError, match="'stage:N' or 'gpu:N'"):
            with fleet.device_guard(device):
                pass


def test_split_points_assign_stages_and_refuse_too_few_layers():
    backend.manual_seed(0)
    model = staged_mlp(1)
    assert fleet.split_stages(model, ["fc2"]) == 2
    stages = {name: p.pipeline_stage for name, p in model.named_parameters()}
    assert [stages[f"fc{i}.weight"] for i in range(LINEARS)] == [0, 0, 1, 1, 1]
    assert fleet.split_stages(model, [1, 5, 8]) == 4
    small = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="3 top-level layers cannot be cut into 4 pipeline"):
        fleet.split_stages(small, [1, 2, 3])
    with pytest.raises(ValueError, match="strictly increasing"):
        fleet.split_stages(small, [2, 1])
    with pytest.raises(ValueError, match="neither a layer index"):
        fleet.split_stages(small, ["fc9"])


def test_untagged_parameters_and_empty_stages_are_refused():
    with fleet.device_guard("stage:0"):
        first = nn.Linear(2, 2)
    model = nn.Sequential(first, nn.Linear(2, 2))
    with pytest.raises(ValueError, match="belong to no stage"):
        fleet.distributed_optimizer(momentum(model.parameters()), pipeline_strategy(),
                                    local=True)
    with fleet.device_guard("stage:2"):
        last = nn.Linear(2, 2)
    model = nn.Sequential(first, last)
    with pytest.raises(ValueError, match=r"stages \[1\] hold no parameters"):
        fleet.distributed_optimizer(momentum(model.parameters()), pipeline_strategy(),
                                    local=True)


def test_layers_out_of_stage_order_are_refused():
    with fleet.device_guard("stage:1"):
        late = nn.Linear(6, 4)
    with fleet.device_guard("stage:0"):
        early = nn.Linear(6, 6)
    model = nn.Sequential(late, early)
    opt = fleet.distributed_optimizer(momentum(model.parameters()), pipeline_strategy(1),
                                      local=True)
    with pytest.raises(ValueError, match="must rise from 0 to 1"):
        opt.minimize(model, nn.CrossEntropyLoss(), *global_batch(0))


def test_unknown_schedule_mode_is_refused():
    strategy = fleet.DistributedStrategy()
    with pytest.raises(fleet.ConfigError, match="F-then-B"):
        strategy.pipeline_configs = {"schedule_mode": "interleaved"}


@pytest.mark.parametrize("stages, micro_batches", [(2, 1), (2, 4), (3, 8), (4, 2)])
def test_schedules_run_each_pass_once_in_dependency_order(stages, micro_batches):
    for stage in range(stages):
        for mode in SCHEDULE_MODES:
            order = compute_order(mode, stages, micro_batches, stage)
            assert sorted(order) == sorted([(kind, k) for kind in (FORWARD, BACKWARD)
                                            for k in range(micro_batches)])
            assert all(order.index((FORWARD, k)) < order.index((BACKWARD, k))
                       for k in range(micro_batches))
        # 1F1B holds at most as many micro-batches as there are stages from here to the end.
        assert in_flight(compute_order("1F1B", stages, micro_batches, stage)) == \
            min(stages - stage, micro_batches)
        assert in_flight(compute_order("F-then-B", stages, micro_batches, stage)) == \
            micro_batches
    assert bubble_fraction(stages, micro_batches) == \
        pytest.approx((stages - 1) / (micro_batches + stages - 1))

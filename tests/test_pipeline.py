"""pipeline: a stage per rank (x replicas) gives the gradients and parameters of the unpipelined
model with its gradients accumulated over the same micro-batches, for a Sequential marked with
device_guard, a user-defined Layer marked with device_guard and a Sequential of user-defined
stage Layers; 1F1B and F-then-B orders; amp and recompute inside; stage assignment by
device_guard and split points; refusals, of models that cannot be split among them."""
import numpy as np
import pytest

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from fleetmpi.core import backend
from fleetmpi import nn, optimizer
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


class Residual(nn.Layer):
    """``tanh(norm(fc(x))) + x``: a layer with a forward of its own and batch-norm buffers."""

    def __init__(self, width, dtype):
        super().__init__()
        self.fc = nn.Linear(width, width, dtype=dtype)
        self.norm = nn.BatchNorm1D(width, dtype=dtype)

    def forward(self, x):
        return F.tanh(self.norm(self.fc(x))) + x


class UserNet(nn.Layer):
    """A user's model: ``inp``, ``res0``, ``res1``, ``act`` and ``head``, each built inside the
    device_guard of its stage (``act``, without parameters, outside any) and called one after
    the other by ``forward``."""

    def __init__(self, stages, dtype="float64"):
        super().__init__()
        with fleet.device_guard("stage:0"):
            self.inp = nn.Linear(SIZES[0], 16, dtype=dtype)
        with fleet.device_guard(f"stage:{stages // 4}"):
            self.res0 = Residual(16, dtype)
        with fleet.device_guard(f"stage:{2 * stages // 4}"):
            self.res1 = Residual(16, dtype)
        self.act = nn.Tanh()
        with fleet.device_guard(f"stage:{3 * stages // 4}"):
            self.head = nn.Linear(16, SIZES[-1], dtype=dtype)

    def forward(self, x):
        x = self.inp(x)
        x = self.res0(x)
        x = self.res1(x)
        x = self.act(x)
        return self.head(x)


class Stage(nn.Layer):
    """One stage of a Sequential of stages: ``fc``, then (but in the last stage) tanh and a
    Residual."""

    def __init__(self, fan_in, fan_out, last, dtype):
        super().__init__()
        self.fc = nn.Linear(fan_in, fan_out, dtype=dtype)
        self.last = last
        if not last:
            self.res = Residual(fan_out, dtype)

    def forward(self, x):
        y = self.fc(x)
        return y if self.last else self.res(F.tanh(y))


def sequential_of_stages(stages, dtype="float64"):
    """``nn.Sequential(stage0, stage1, ...)`` of ``Stage`` layers, one per stage, put on their
    stages by ``split_stages`` without split points."""
    widths = [SIZES[0]] + [16] * (stages - 1) + [SIZES[-1]]
    model = nn.Sequential(*[(f"stage{i}", Stage(widths[i], widths[i + 1], i == stages - 1,
                                                dtype)) for i in range(stages)])
    assert fleet.split_stages(model) == stages
    return model


MODELS = {"sequential": staged_mlp, "user_layer": UserNet,
          "sequential_of_stages": sequential_of_stages}


def layouts(size):
    """(stages, replicas) worth checking at ``size`` ranks: 2 stages at 2 ranks, 3 at 3,
    2 x 2 and 4 x 1 at 4."""
    return [(stages, size // stages) for stages in (2, 3, 4) if size % stages == 0]


def pipeline_strategy(micro_batch=MICRO_BATCH, mode="1F1B", **fields):
    return make_strategy(pipeline=True, pipeline_configs={"micro_batch": micro_batch,
                                                          "schedule_mode": mode}, **fields)


def train_pipeline(stages, strategy, replicas, local=False, dtype="float64", steps=STEPS,
                   kind="sequential", watch=None):
    """Train ``MODELS[kind](stages)`` (after ``watch(model)``, when given); each replica on
    its shard of the global batch (the whole batch when ``local``). Returns (model, optimizer,
    losses)."""
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = MODELS[kind](stages, dtype)
    if watch is not None:
        watch(model)
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


def on_stage(model, stage):
    """The names of the parameters and buffers of ``model`` on ``stage``."""
    layers = dict(model.named_sublayers())
    names = {p.name for p in model.parameters() if p.pipeline_stage == stage}
    return names | {name for name, _ in model.named_buffers()
                    if layers[name.rsplit(".", 1)[0]].pipeline_stage == stage}


def accumulated_reference(make_model, replicas, micro_batch, steps=STEPS):
    """One process, no pipeline: per step the gradients of every micro-batch of every
    replica's shard summed and divided by their number, then one Momentum step. Returns
    (parameters and buffers, last step's gradients, per-step loss of each replica)."""
    backend.manual_seed(0)
    model = make_model()
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
                opt.clear_grad()
                loss = loss_fn(model(xs[part]), ys[part])
                mean += float(loss) / micro_batch
                loss.backward()
                for name, p in model.named_parameters():
                    total[name] = total[name] + p.grad
            replica_losses.append(mean)
        for name, p in model.named_parameters():
            p.grad[...] = total[name] / (replicas * micro_batch)
        grads = {name: p.grad.numpy().copy() for name, p in model.named_parameters()}
        opt.step()
        losses.append(replica_losses)
    return model.state_dict(), grads, losses


# -- the proof at N ranks --------------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("mode", SCHEDULE_MODES)
def test_stages_x_replicas_equal_accumulated_gradients(mode, kind):
    fleet.init(is_collective=True)
    rank = fleet.worker_index()
    for stages, replicas in layouts(fleet.worker_num()):
        stage, replica = rank % stages, rank // stages
        label = f"{kind}, {stages} stages x {replicas} replicas, {mode}"
        model, opt, losses = train_pipeline(stages, pipeline_strategy(mode=mode), replicas,
                                            kind=kind)
        expected, grads, expected_losses = accumulated_reference(
            lambda: MODELS[kind](stages), replicas, MICRO_BATCH)
        own = {p.name for p in opt.inner.parameters()}
        ok(own == {p.name for p in model.parameters() if p.pipeline_stage == stage} and own,
           f"{label}: rank {rank} holds {sorted(own)}")
        state = model.state_dict()
        backend.manual_seed(0)
        start = MODELS[kind](stages).state_dict()
        wrong = [f"gradient {p.name}" for p in opt.inner.parameters()
                 if not np.allclose(p.grad.numpy(), grads[p.name], rtol=1e-10,
                                    atol=1e-13)]
        wrong += [name for name in own
                  if not np.allclose(state[name], expected[name], rtol=1e-10, atol=1e-13)]
        # Parameters of the other stages are never updated on this rank, nor are the
        # buffers of their layers.
        wrong += [f"{name} moved" for name in set(state) - on_stage(model, stage)
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
@pytest.mark.parametrize("kind, checkpoints, watched, checks", [
    ("sequential", ["act0", "act2"], "fc0", 0),
    ("user_layer", ["res0", "res1"], "res0.fc", 1),
    ("sequential_of_stages", ["stage0.res"], "stage0.res.fc", 0)])
def test_recompute_inside_the_pipeline_changes_nothing(kind, checkpoints, watched, checks):
    """Bit for bit the run without recompute, and the ``watched`` layer (in a recomputed
    segment) runs twice per micro-batch on its stage, plus ``checks`` calls of the one check
    of a user-defined Layer's forward."""
    fleet.init(is_collective=True)
    recompute = {"recompute": True, "recompute_configs": {"checkpoints": checkpoints}}
    counted = {}
    for stages, replicas in layouts(fleet.worker_num()):
        calls = {}
        with_it, _, losses = train_pipeline(
            stages, pipeline_strategy(**recompute), replicas, kind=kind,
            watch=lambda model: count_calls(model, watched, calls, True))
        without, _, plain = train_pipeline(
            stages, pipeline_strategy(), replicas, kind=kind,
            watch=lambda model: count_calls(model, watched, calls, False))
        equal(np.array(losses), np.array(plain))
        for name, value in with_it.state_dict().items():
            equal(value, without.state_dict()[name], err_msg=f"{stages} stages: {name}")
        layer = dict(with_it.named_sublayers())[watched]
        if fleet.worker_index() % stages == layer.pipeline_stage:
            counted[stages] = (calls[True], calls[False])
    once = STEPS * MICRO_BATCH
    ok(all(counts == (2 * once + checks, once + checks) for counts in counted.values()),
       f"calls of {watched} with and without recompute: {counted}")


def count_calls(model, name, calls, key):
    """Count the calls of ``model``'s sublayer ``name`` in ``calls[key]``."""
    calls[key] = 0

    def hook(layer, inputs, output):
        calls[key] += 1
    dict(model.named_sublayers())[name].register_forward_post_hook(hook)


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

@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("mode", SCHEDULE_MODES)
def test_all_stages_in_one_process_equal_accumulated_gradients(mode, kind):
    """Parameters and buffers (the batch-norm statistics of every micro-batch, which the check
    of a user-defined Layer's forward must leave untouched) equal the reference."""
    model, opt, losses = train_pipeline(3, pipeline_strategy(mode=mode), 1, local=True,
                                        kind=kind)
    expected, grads, expected_losses = accumulated_reference(lambda: MODELS[kind](3), 1,
                                                             MICRO_BATCH)
    for name, value in model.state_dict().items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-10, atol=1e-13, err_msg=name)
    for p in opt.inner.parameters():
        np.testing.assert_allclose(p.grad.numpy(), grads[p.name], rtol=1e-10,
                                   atol=1e-13)
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


def test_split_stages_without_points_puts_each_top_level_layer_on_a_stage():
    backend.manual_seed(0)
    model = sequential_of_stages(3)
    assert [layer.pipeline_stage for layer in model.children()] == [0, 1, 2]
    assert {p.name: p.pipeline_stage for p in model.parameters()}["stage1.res.norm.weight"] == 1
    user = UserNet(1)
    assert fleet.split_stages(user, ["res1"]) == 2
    assert [(name, layer.pipeline_stage) for name, layer in user.named_children()] == \
        [("inp", 0), ("res0", 0), ("res1", 1), ("act", 1), ("head", 1)]
    with pytest.raises(TypeError, match="split_stages cuts a fleetmpi.nn.Layer, not list"):
        fleet.split_stages([nn.Linear(2, 2)])


class Between(UserNet):
    """Computes between its sublayers: ``head(relu(act(...)))``."""

    def forward(self, x):
        return self.head(F.relu(self.act(self.res1(self.res0(self.inp(x))))))


class After(UserNet):
    """Computes after its last sublayer."""

    def forward(self, x):
        return super().forward(x) * 2.0


class OutOfOrder(UserNet):
    """Calls ``res1`` before ``res0``."""

    def forward(self, x):
        return self.head(self.act(self.res0(self.res1(self.inp(x)))))


class Skips(UserNet):
    """Never calls ``act``."""

    def forward(self, x):
        return self.head(self.res1(self.res0(self.inp(x))))


class Spanning(nn.Layer):
    """``body`` holds a Linear of stage 0 and one of stage 1."""

    def __init__(self):
        super().__init__()
        self.body = nn.Layer()
        with fleet.device_guard("stage:0"):
            self.body.fc0 = nn.Linear(6, 6)
        with fleet.device_guard("stage:1"):
            self.body.fc1 = nn.Linear(6, 4)

    def forward(self, x):
        return self.body.fc1(self.body.fc0(x))


class OwnParameter(UserNet):
    """Holds a parameter of its own beside its sublayers."""

    def __init__(self, stages):
        super().__init__(stages)
        scale = self.create_parameter((1,), dtype="float64")
        scale.pipeline_stage = 1
        self.scale = scale

    def forward(self, x):
        return super().forward(x) * self.scale


class Reversed(nn.Layer):
    """Registers its stage-1 layer before its stage-0 layer."""

    def __init__(self):
        super().__init__()
        with fleet.device_guard("stage:1"):
            self.head = nn.Linear(6, 4)
        with fleet.device_guard("stage:0"):
            self.body = nn.Linear(6, 6)

    def forward(self, x):
        return self.head(self.body(x))


CHAIN = r"calls each of its top-level sublayers \['inp', 'res0', 'res1', 'act', 'head'\] once"


@pytest.mark.parametrize("make_model, message", [
    (lambda: Between(2), r"Between.forward the sublayer 'head' does not get the "
                                    r"output of 'act' as its one input .*" + CHAIN),
    (lambda: After(2), r"After.forward returns something other than the output "
                                  r"of 'head' .*" + CHAIN),
    (lambda: OutOfOrder(2), r"OutOfOrder.forward calls its top-level sublayers in "
                                       r"the order \['inp', 'res1', 'res0', 'act', 'head'\]; .*"
                                       + CHAIN),
    (lambda: Skips(2), r"Skips.forward calls its top-level sublayers in the order "
                                  r"\['inp', 'res0', 'res1', 'head'\]"),
    (Spanning, r"the top-level layer 'body' \(Layer\) of Spanning holds parameters of stages "
               r"\[0, 1\] \(stage 0: body.fc0.weight, body.fc0.bias; stage 1: body.fc1.weight, "
               r"body.fc1.bias\); a stage boundary must fall between top-level layers"),
    (lambda: OwnParameter(2), r"OwnParameter holds parameters \['scale'\] itself, outside "
                              r"its top-level sublayers"),
    (Reversed, r"the stages of the top-level layers \['head', 'body'\] of Reversed are "
               r"\[1, 0\]; they must rise from 0 to 1"),
], ids=["between", "after", "out_of_order", "skips", "spanning", "own_parameter", "reversed"])
def test_a_model_that_cannot_be_split_is_refused_naming_the_layer(make_model, message):
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = make_model()
    start = model.state_dict()
    opt = fleet.distributed_optimizer(momentum(model.parameters()), pipeline_strategy(),
                                      local=True)
    x, y = global_batch(0)
    with pytest.raises(ValueError, match=message):
        opt.minimize(model, nn.CrossEntropyLoss(), x, y)
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value, start[name], err_msg=name)


def test_a_model_of_one_stage_is_not_cut_whatever_its_forward():
    """Between's forward cannot be cut, but a model of one stage is not cut: it runs whole on
    each micro-batch."""
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = Between(1)
    opt = fleet.distributed_optimizer(momentum(model.parameters()), pipeline_strategy(),
                                      local=True)
    losses = [float(opt.minimize(model, nn.CrossEntropyLoss(), *global_batch(step)))
              for step in range(STEPS)]
    expected, _, expected_losses = accumulated_reference(lambda: Between(1), 1, MICRO_BATCH)
    for name, value in model.state_dict().items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-10, atol=1e-13, err_msg=name)
    np.testing.assert_allclose(losses, [step[0] for step in expected_losses], rtol=1e-10)


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


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", (1, 2))
def test_sharding_partitions_each_stage_over_its_replicas(stage):
    """Pipeline with sharding stage 1 or 2 trains as pipeline alone, and each rank holds the
    optimizer state (at stage 2 the gradient too) of its share of its own stage only."""
    fleet.init(is_collective=True)
    for stages, replicas in layouts(fleet.worker_num()):
        sharded = pipeline_strategy(sharding=True, sharding_configs={"stage": stage})
        model, opt, losses = train_pipeline(stages, sharded, replicas)
        plain, plain_opt, plain_losses = train_pipeline(stages, pipeline_strategy(), replicas)
        label = f"{stages} stages x {replicas} replicas"
        close(np.array(losses), np.array(plain_losses), rtol=1e-12, err_msg=label)
        expected = plain.state_dict()
        for name, value in model.state_dict().items():
            close(value, expected[name], rtol=1e-10, atol=1e-13, err_msg=f"{label}: {name}")
        hook = opt.strategies["sharding"]
        ok(hook.group_size == replicas, f"{label}: group of {hook.group_size}")
        whole = plain_opt.inner.state_nbytes()
        ok(abs(opt.inner.state_nbytes() * replicas - whole) <= replicas * 8,
           f"{label}: {opt.inner.state_nbytes()} state bytes of {whole}")
        if stage == 2:
            start, stop = hook.shard
            ok(opt.inner.shard_gradient.size == stop - start, f"{label}: gradient not a shard")
            ok(all(b.grad is None for b in model.flat_buffers()), f"{label}: a full gradient")


def test_sharding_stage_3_with_pipeline_is_refused():
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = MODELS["sequential"](2)
    with pytest.raises(ValueError, match="sharding stage 3 cannot be combined with pipeline: "
                                         "stages 1 and 2 only"):
        fleet.distributed_optimizer(
            momentum(model.parameters()),
            pipeline_strategy(sharding=True, sharding_configs={"stage": 3}), local=True)

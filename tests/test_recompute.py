"""recompute: gradients, parameters and buffers bit for bit those of the run without it (one
process and every rank of N), activations really dropped and the measured peak lower,
offload through host buffers, and clear refusals of bad checkpoints and shapes."""
import gc
import tracemalloc

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi import backend, nn, optimizer
from fleetmpi.optimizer import StepHook
from fleetmpi.strategies.recompute import (ActivationMeter, activation_arrays, cut_into_pieces,
                                           drop_activations, held_activation_bytes)
from comm_support import equal, ok, raises
from strategy_support import GLOBAL_BATCH, global_batch, make_strategy, train, world_gather

STEPS = 4


def model_with_dropout_and_batch_norm(dtype="float64"):
    return nn.Sequential(("fc0", nn.Linear(6, 16, dtype=dtype)), ("act0", nn.ReLU()),
                         ("drop0", nn.Dropout(0.3)), ("fc1", nn.Linear(16, 12, dtype=dtype)),
                         ("bn1", nn.BatchNorm1D(12, dtype=dtype)), ("act1", nn.ReLU()),
                         ("fc2", nn.Linear(12, 12, dtype=dtype)), ("act2", nn.Tanh()),
                         ("drop2", nn.Dropout(0.2)), ("fc3", nn.Linear(12, 4, dtype=dtype)))


def small_convnet():
    """Conv, batch norm, pooling and a residual block as top-level layers of a Sequential."""
    nn.set_default_dtype("float64")
    try:
        block = nn.basic_block(4, 4)
        return nn.Sequential(("conv0", nn.Conv2D(1, 4, 3, padding=1)), ("bn0", nn.BatchNorm2D(4)),
                             ("relu0", nn.ReLU()), ("block", block), ("drop", nn.Dropout(0.25)),
                             ("pool", nn.MaxPool2D(2)), ("gap", nn.GlobalAvgPool()),
                             ("fc", nn.Linear(4, 4)))
    finally:
        nn.set_default_dtype("float32")


def image_batch(step):
    rng = np.random.default_rng(200 + step)
    return rng.standard_normal((GLOBAL_BATCH, 1, 6, 6)), rng.integers(0, 4, GLOBAL_BATCH)


def recompute(checkpoints, **configs):
    return dict(recompute=True, recompute_configs=dict(configs, checkpoints=checkpoints))


def strategy(fuse=False, **fields):
    s = make_strategy(**fields)
    s.build_strategy.fuse_elewise_add_act_ops = fuse
    s.build_strategy.fuse_bn_act_ops = fuse
    return s


def run(fields, fuse=False, make_model=model_with_dropout_and_batch_norm, batch=global_batch,
        local=True):
    """Train; return the model's state, the last gradients, the losses, the rank generator's
    state afterwards and the optimizer."""
    model, opt, losses = train(strategy(fuse, **fields), steps=STEPS, make_model=make_model,
                               batch=batch, local=local)
    grads = {p.name: backend.to_numpy(p.grad).copy() for p in model.parameters()}
    return model.state_dict(), grads, losses, backend.rng_state(), opt


def assert_identical(reference, result):
    state, grads, losses, rng, _ = result
    assert losses == reference[2]
    for name, value in reference[0].items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)
    for name, value in reference[1].items():
        np.testing.assert_array_equal(grads[name], value, err_msg=name)
    assert rng == reference[3], "recompute changed the rank generator's draws after the step"


CHECKPOINT_SETS = [["act0"], ["drop0", "act1"], ["fc0", "bn1", "act2"], ["act1", "fc3"],
                   ["fc1"]]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("checkpoints", CHECKPOINT_SETS, ids="+".join)
def test_recompute_is_bit_for_bit_the_run_without_it(dtype, fuse, checkpoints):
    def make_model():
        return model_with_dropout_and_batch_norm(dtype)

    fleet.init(is_collective=True)
    reference = run({}, fuse, make_model)
    result = run(recompute(checkpoints), fuse, make_model)
    assert_identical(reference, result)
    assert any(not np.array_equal(a, b) for a, b in
               zip(reference[0].values(), make_model().state_dict().values()))


@pytest.mark.parametrize("checkpoints", [["relu0"], ["bn0", "block"], ["block", "pool"]],
                         ids="+".join)
def test_recompute_through_convolutions_and_residual_blocks(checkpoints):
    fleet.init(is_collective=True)
    reference = run({}, True, small_convnet, image_batch)
    assert_identical(reference, run(recompute(checkpoints), True, small_convnet, image_batch))


@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("partner, configs", [
    pytest.param("amp", {"init_loss_scaling": 1024.0}, id="amp"),
    pytest.param("gradient_merge", {"k_steps": 2}, id="gradient_merge"),
    pytest.param("lars", {"lars_coeff": 0.01}, id="lars"),
    pytest.param("localsgd", {"k_steps": 2, "begin_step": 1}, id="localsgd")])
def test_recompute_leaves_a_partner_strategy_bit_for_bit_unchanged(fuse, partner, configs):
    """Dropout, batch norm and fused kernels under another strategy (amp re-runs the layers in
    float16) give exactly what the partner gives alone."""
    def make_model():
        return model_with_dropout_and_batch_norm("float32")

    fleet.init(is_collective=True)
    fields = {partner: True, f"{partner}_configs": configs}
    reference = run(fields, fuse, make_model)
    assert_identical(reference, run(dict(fields, **recompute(["drop0", "act2"])), fuse,
                                    make_model))


def test_offload_is_bit_for_bit_and_keeps_checkpoints_on_the_host():
    fleet.init(is_collective=True)
    reference = run({})
    result = run(recompute(["act1", "act2"], enable_offload=True,
                           checkpoint_shape=[GLOBAL_BATCH, 12]))
    assert_identical(reference, result)
    hook = result[4].strategies["recompute"]
    # act1 feeds a dropped piece and goes to the host; act2 feeds the kept last piece.
    assert hook.offloaded_bytes == GLOBAL_BATCH * 12 * 8


class _FakeDeviceGenerator:
    """A generator shaped like CuPy's: its whole state is the device array
    ``bit_generator._state``, advanced in place by every draw."""

    def __init__(self):
        self.bit_generator = type("BitGenerator", (), {})()
        self.bit_generator._state = np.arange(4, dtype=np.uint64)

    def random(self, shape):
        values = np.random.default_rng(self.bit_generator._state).random(shape)
        self.bit_generator._state += np.uint64(1)
        return values


def test_dropout_draws_replay_through_a_device_generator_state(monkeypatch):
    """The GPU branch of the draw replay, checked on the host with a generator whose state is
    an array like CuPy's XORWOW."""
    from fleetmpi.strategies import recompute as module

    generator = _FakeDeviceGenerator()
    monkeypatch.setattr(backend, "on_gpu", lambda: True)
    monkeypatch.setattr(backend, "_rank_rng", generator)
    untouched, state = module._run_recording_draws(lambda: 1)
    assert untouched == 1 and state is None
    first, state = module._run_recording_draws(lambda: backend.rank_rng().random((2, 3)))
    assert backend.rank_rng() is generator
    after = generator.bit_generator._state.copy()
    again = module._run_replaying_draws(lambda: backend.rank_rng().random((2, 3)), state)
    np.testing.assert_array_equal(again, first)
    np.testing.assert_array_equal(generator.bit_generator._state, after)


def test_a_fused_away_activation_names_the_fused_step():
    backend.manual_seed(0)
    model = model_with_dropout_and_batch_norm()
    model.configure_fusion(True, True)
    pieces = cut_into_pieces(model, ["act0", "act1"])
    assert [[(type(layer).__name__, act) for layer, act in piece.steps] for piece in pieces] == \
        [[("Linear", "relu")], [("Dropout", None), ("Linear", None), ("BatchNorm1D", "relu")],
         [("Linear", "tanh"), ("Dropout", None), ("Linear", None)]]
    assert [piece.checkpoint for piece in pieces] == ["act0", "act1", None]
    model.configure_fusion(False, False)
    pieces = cut_into_pieces(model, ["act0", "act1"])
    assert [len(piece.steps) for piece in pieces] == [2, 4, 4]


class Inspect(StepHook):
    """Records which layers hold activation caches when backward starts, the parameters
    reported as their gradients became final, and the step's model after the step."""

    name = "inspect"

    def __init__(self, model):
        self.model = model
        self.cached = {}
        self.model_after_step = None
        self.reported = []

    def backward(self, ctx, proceed):
        self.cached = {name: [n for n, _ in activation_arrays(layer)]
                       for name, layer in self.model._children.items()}
        return proceed(ctx)

    def on_gradient(self, ctx, parameters):
        self.reported.append([p.name for p in parameters])

    def after_step(self, ctx, proceed):
        self.model_after_step = ctx.model
        return proceed(ctx)


def test_forward_drops_every_activation_but_the_last_piece():
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = model_with_dropout_and_batch_norm()
    opt = fleet.distributed_optimizer(
        optimizer.SGD(learning_rate=0.1, parameters=model.parameters()),
        strategy(**recompute(["act1"])), local=True)
    inspect = Inspect(model)
    opt.add_hook(inspect)
    x, y = global_batch(0)
    opt.minimize(model, nn.CrossEntropyLoss(), x, y)
    dropped = ["fc0", "act0", "drop0", "fc1", "bn1", "act1"]
    kept = ["fc2", "act2", "drop2", "fc3"]
    assert all(inspect.cached[name] == [] for name in dropped), inspect.cached
    assert all(inspect.cached[name] for name in kept), inspect.cached
    assert all(not activation_arrays(model[name]) for name in dropped)
    assert inspect.model_after_step is model
    assert opt.strategies["recompute"].peak_activation_bytes > 0


@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused"])
def test_gradients_are_reported_in_the_order_of_the_run_without_recompute(fuse):
    """The same groups in the same order as Sequential.backward, so the bucketed allreduce
    starts on the same buckets while backward goes on."""
    fleet.init(is_collective=True)
    reported = []
    for fields in ({}, recompute(["act0", "act1"])):
        backend.manual_seed(0)
        model = model_with_dropout_and_batch_norm()
        opt = fleet.distributed_optimizer(
            optimizer.SGD(learning_rate=0.1, parameters=model.parameters()),
            strategy(fuse, **fields), local=True)
        inspect = Inspect(model)
        opt.add_hook(inspect)
        opt.minimize(model, nn.CrossEntropyLoss(), *global_batch(0))
        reported.append(inspect.reported)
    assert reported[0] == reported[1]
    assert [group[0] for group in reported[0]] == ["fc3.weight", "fc2.weight", "bn1.weight",
                                                   "fc1.weight", "fc0.weight"]


def every_layer_kind():
    """One instance of every layer class of fleetmpi.nn, with an input and fusion to try."""
    x2 = np.random.default_rng(0).standard_normal((4, 3))
    x4 = np.random.default_rng(1).standard_normal((2, 3, 4, 4))
    return [(nn.Linear(3, 5), x2, "relu"), (nn.ReLU(), x2, None), (nn.Tanh(), x2, None),
            (nn.GELU(), x2, None), (nn.Dropout(0.5), x2, None), (nn.Flatten(), x4, None),
            (nn.Embedding(7, 3), np.array([[1, 2], [6, 0]]), None),
            (nn.BatchNorm1D(3), x2, "relu"), (nn.BatchNorm2D(3), x4, "relu"),
            (nn.Conv2D(3, 2, 3, padding=1), x4, "tanh"), (nn.MaxPool2D(2), x4, None),
            (nn.AvgPool2D(3, 1, 1), x4, None), (nn.GlobalAvgPool(), x4, None),
            (nn.basic_block(3, 3), x4, None),
            (nn.Sequential(nn.Linear(3, 3), nn.Tanh()), x2, None)]


def test_every_layer_keeps_backend_arrays_only_as_activation_caches(float64_layers):
    """What recompute drops: a layer holds no plain backend array attribute until forward
    assigns it, and after the caches are dropped another forward restores everything
    backward needs (parameters and buffers untouched)."""
    layers = every_layer_kind()
    assert {type(layer) for layer, _, _ in layers} >= {
        cls for cls in vars(nn).values() if isinstance(cls, type)
        and issubclass(cls, nn.Layer)
        and cls not in (nn.Layer, nn.Activation, nn.BatchNorm, nn.MLP)}
    for layer, x, act in layers:
        name = type(layer).__name__
        for fused in ([None, act] if act else [None]):
            members = [layer] + [child for _, child in layer.named_sublayers()]
            assert not any(activation_arrays(m) for m in members), name
            before = layer.state_dict()
            run_forward = (lambda: layer.forward_act(backend.asarray(x), fused)) if fused \
                else (lambda: layer.forward(backend.asarray(x)))
            y = run_forward()
            if isinstance(layer, nn.Dropout):
                backend.manual_seed(0)
                y = run_forward()
            dy = np.ones(y.shape)
            reference = layer.backward_act(dy, fused) if fused else layer.backward(dy)
            grads = [p.grad.copy() for p in layer.parameters()]
            drop_activations([layer])
            assert not any(activation_arrays(m) for m in members), name
            for key, value in layer.state_dict().items():
                if "running" not in key:
                    np.testing.assert_array_equal(value, before[key], err_msg=f"{name} {key}")
            if isinstance(layer, nn.Dropout):
                backend.manual_seed(0)
            run_forward()
            again = layer.backward_act(dy, fused) if fused else layer.backward(dy)
            if reference is not None:
                np.testing.assert_array_equal(again, reference, err_msg=name)
            for grad, p in zip(grads, layer.parameters()):
                np.testing.assert_array_equal(p.grad, grad, err_msg=name)
            drop_activations([layer])


def mlp16(width, classes=10):
    """16 Linear layers with ReLU between them: ``fc0..fc15``, ``act0..act14``."""
    return nn.MLP([width] * 16 + [classes], dtype="float32")


def traced_peak(opt, model, x, y):
    """Peak bytes NumPy allocated during one training step above what was live before it,
    starting from a model without cached activations."""
    drop_activations([model])
    gc.collect()
    tracemalloc.start()
    try:
        opt.minimize(model, nn.CrossEntropyLoss(), x, y)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.skipif(backend.on_gpu(), reason="tracemalloc sees host (NumPy) allocations only")
def test_measured_peak_activation_memory_falls_for_a_16_layer_mlp():
    fleet.init(is_collective=True)
    width, batch = 128, 256
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, width)).astype("float32")
    y = rng.integers(0, 10, batch)
    peaks, held, losses = {}, {}, {}
    configs = {"none": {}, "every 4": recompute(["act3", "act7", "act11"]),
               "offload": recompute(["act3", "act7", "act11"], enable_offload=True,
                                    checkpoint_shape=[batch, width])}
    for label, fields in configs.items():
        backend.manual_seed(0)
        model = mlp16(width)
        opt = fleet.distributed_optimizer(optimizer.Momentum(
            learning_rate=0.01, momentum=0.9, parameters=model.parameters()),
            strategy(**fields), local=True)
        opt.minimize(model, nn.CrossEntropyLoss(), x, y)
        peaks[label] = traced_peak(opt, model, x, y)
        losses[label] = float(opt.minimize(model, nn.CrossEntropyLoss(), x, y))
        if fields:
            held[label] = opt.strategies["recompute"].peak_activation_bytes
        else:
            drop_activations([model])
            model.forward(x)
            held[label] = held_activation_bytes(model)
    activation = batch * width * 4
    assert losses["every 4"] == losses["none"] == losses["offload"]
    # Without recompute all 15 ReLU outputs (and the input) stay for backward; with
    # checkpoints every 4 layers at most three checkpoints and one piece do.
    assert held["none"] >= 15 * activation
    assert held["every 4"] <= 8 * activation
    assert held["offload"] < held["every 4"]
    assert peaks["every 4"] < 0.7 * peaks["none"], peaks
    assert peaks["offload"] < peaks["every 4"], peaks


def test_activation_meter_counts_each_block_once_and_no_parameters(float64_layers):
    model = nn.Sequential(("fc", nn.Linear(3, 4)), ("flat", nn.Flatten()),
                          ("bn", nn.BatchNorm1D(4)))
    model.parameters()
    model.eval()
    x = backend.asarray(np.ones((5, 3)))
    model.forward(x)
    meter = ActivationMeter(model)
    # fc keeps its input x and the parameter view _w (not counted); Flatten keeps a shape;
    # BatchNorm in eval keeps its running mean (a buffer, not counted), invstd and xhat.
    assert meter.held() == x.nbytes + 4 * 8 + 5 * 4 * 8
    assert meter.held([x, x[1:], model.forward(x)]) == meter.held() + 5 * 4 * 8


def test_offload_needs_checkpoint_shape():
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = model_with_dropout_and_batch_norm()
    with pytest.raises(ValueError, match=r"enable_offload.+needs.+checkpoint_shape.+got \[\]"):
        fleet.distributed_optimizer(optimizer.SGD(parameters=model.parameters()),
                                    strategy(**recompute(["act1"], enable_offload=True)),
                                    local=True)


@pytest.mark.parametrize("checkpoints, shape, layer, found", [
    (["act0", "act1"], [GLOBAL_BATCH, 12], "act0", (GLOBAL_BATCH, 16)),
    (["act1", "fc3"], [GLOBAL_BATCH, 12], "fc3", (GLOBAL_BATCH, 4)),
    (["act1"], [12], "act1", (GLOBAL_BATCH, 12)),
    (["act1"], [GLOBAL_BATCH // 2, 12], "act1", (GLOBAL_BATCH, 12))],
    ids=["first", "last", "rank", "batch"])
def test_offload_refuses_a_checkpoint_of_another_shape(checkpoints, shape, layer, found):
    fleet.init(is_collective=True)
    fields = recompute(checkpoints, enable_offload=True, checkpoint_shape=shape)
    with pytest.raises(ValueError, match=rf"checkpoint '{layer}' has shape "
                                         rf"\({found[0]}, {found[1]}\), but checkpoint_shape is "
                                         rf"\[{', '.join(map(str, shape))}\]"):
        train(strategy(**fields), steps=1, make_model=model_with_dropout_and_batch_norm,
              local=True)


def test_a_step_that_fails_inside_a_piece_leaves_the_generator_and_model_usable():
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = model_with_dropout_and_batch_norm()
    opt = fleet.distributed_optimizer(optimizer.SGD(parameters=model.parameters()),
                                      strategy(**recompute(["act1"])), local=True)
    x, y = global_batch(0)
    with pytest.raises(ValueError, match="Linear expects 6 features"):
        opt.minimize(model, nn.CrossEntropyLoss(), x[:, :5], y)
    assert isinstance(backend.rank_rng(), np.random.Generator)
    assert np.isfinite(float(opt.minimize(model, nn.CrossEntropyLoss(), x, y)))


@pytest.mark.parametrize("checkpoints, match", [
    (["act1", "fc9"], r"checkpoints \['fc9'\] are not layers of the model; checkpoints name "
                      r"its top-level layers: \['fc0', 'act0', 'drop0', 'fc1', 'bn1', 'act1'"),
    (["fc1.weight"], r"\['fc1.weight'\] are not layers"),
], ids=["unknown", "parameter"])
def test_unknown_checkpoint_names_are_refused_listing_the_layers(checkpoints, match):
    fleet.init(is_collective=True)
    with pytest.raises(ValueError, match=match):
        train(strategy(**recompute(checkpoints)), steps=1,
              make_model=model_with_dropout_and_batch_norm, local=True)


@pytest.mark.parametrize("configs, match", [
    ({"checkpoints": []}, r"needs recompute_configs\['checkpoints'\], a non-empty list.+got \[\]"),
    ({}, r"needs recompute_configs\['checkpoints'\]"),
    ({"checkpoints": ["act1", "act1"]}, r"checkpoints \['act1'\] are listed more than once"),
], ids=["empty", "default", "repeated"])
def test_missing_or_repeated_checkpoints_are_refused(configs, match):
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = model_with_dropout_and_batch_norm()
    s = make_strategy(recompute=True)
    s.recompute_configs = configs
    with pytest.raises(ValueError, match=match):
        fleet.distributed_optimizer(optimizer.SGD(parameters=model.parameters()), s,
                                    local=True)


def test_a_model_that_is_not_a_sequential_is_refused():
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = nn.basic_block(1, 1)
    opt = fleet.distributed_optimizer(optimizer.SGD(parameters=model.parameters()),
                                      strategy(**recompute(["body"])), local=True)
    with pytest.raises(TypeError, match="recompute needs an nn.Sequential model .+ not "
                                        "ResidualBlock"):
        opt.minimize(model, nn.CrossEntropyLoss(), np.ones((2, 1, 3, 3)), np.zeros(2, int))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fields, checkpoints, fuse", [
    ({}, ["drop0", "act1"], False),
    ({}, ["fc0", "act2"], True),
    ({"fuse_all_reduce_ops": False}, ["act0", "act1"], True),
    ({"fp16_allreduce": True}, ["act1"], False),
], ids=["plain", "fused", "bucket-per-parameter", "fp16_allreduce"])
def test_every_rank_matches_the_run_without_recompute_bit_for_bit(fields, checkpoints, fuse):
    reference = run(fields, fuse, local=False)
    result = run(dict(fields, **recompute(checkpoints)), fuse, local=False)
    equal(np.array(result[2]), np.array(reference[2]))
    for name, value in reference[0].items():
        equal(result[0][name], value, err_msg=name)
        if "running" not in name:
            equal(world_gather(value)[0], value, err_msg=f"{name} differs between ranks")
    for name, value in reference[1].items():
        equal(result[1][name], value, err_msg=name)
    ok(result[3] == reference[3], "recompute changed the rank generator's draws")


@pytest.mark.mpi(min_size=2)
def test_every_rank_matches_with_offload():
    fleet.init(is_collective=True)
    local_batch = GLOBAL_BATCH // fleet.worker_num()
    reference = run({}, local=False)
    result = run(recompute(["act1", "act2"], enable_offload=True,
                           checkpoint_shape=[local_batch, 12]), local=False)
    for name, value in reference[0].items():
        equal(result[0][name], value, err_msg=name)
    ok(result[4].strategies["recompute"].offloaded_bytes == local_batch * 12 * 8,
       "act1 should be the one checkpoint in host memory")


@pytest.mark.mpi(min_size=2)
def test_offload_shape_error_is_raised_on_every_rank():
    fleet.init(is_collective=True)
    with raises(ValueError, match="checkpoint 'act1' has shape"):
        run(recompute(["act1"], enable_offload=True, checkpoint_shape=[GLOBAL_BATCH, 12]),
            local=False)

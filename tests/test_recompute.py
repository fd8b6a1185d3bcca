"""recompute: gradients, parameters and buffers bit for bit those of the run without it (one
process and every rank of N, both training idioms), for checkpoints naming sublayers of a
Sequential (boundaries) and of a user-defined Layer at any depth (whole calls), and for
``fleet.utils.recompute`` of a layer or a function inside a user's forward; dropout masks
replayed, amp's casts repeated, batch-norm statistics moved once; activations really dropped
and the measured peak lower; offload through host buffers; clear refusals."""
import functools
import gc
import tracemalloc

import numpy as np
import pytest

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from fleetmpi.core import backend
from fleetmpi import nn, optimizer
from fleetmpi.autograd import recompute as autograd_recompute
from fleetmpi.optimizer import StepHook
from fleetmpi.strategies.recompute import (ActivationMeter, checkpoint_forwards,
                                           cut_into_segments, held_activation_bytes)
from comm_support import equal, ok, raises
from strategy_support import (CLASSES, FEATURES, GLOBAL_BATCH, global_batch,
                              is_running_statistic, make_strategy, shard, train, world_gather)

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


# -- a user-defined model: attributes, a LayerList of blocks, a residual branch ----------------

class Block(nn.Layer):
    """``x + mlp(norm(x))``: batch norm, and a Sequential with dropout inside."""

    def __init__(self, width, dropout, dtype):
        super().__init__()
        self.norm = nn.BatchNorm1D(width, dtype=dtype)
        self.mlp = nn.Sequential(("fc1", nn.Linear(width, 2 * width, dtype=dtype)),
                                 ("act", nn.Tanh()), ("drop", nn.Dropout(dropout)),
                                 ("fc2", nn.Linear(2 * width, width, dtype=dtype)))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def custom_forward(layer):
    """Paddle's ``create_custom_forward`` idiom: a closure over the layer."""
    def run(*inputs):
        return layer(*inputs)
    return run


HELPERS = {
    "layer": lambda block, h: fleet.utils.recompute(block, h),
    "closure": lambda block, h: fleet.utils.recompute(custom_forward(block), h),
    "method": lambda block, h: fleet.utils.recompute(block.forward, h),
    "partial": lambda block, h: fleet.utils.recompute(functools.partial(block), h),
}


class UserModel(nn.Layer):
    """``helper``: how forward calls ``fleet.utils.recompute`` on its blocks (None: it does
    not)."""

    def __init__(self, dtype="float64", dropout=0.25, helper=None):
        super().__init__()
        self.embed = nn.Linear(FEATURES, 16, dtype=dtype)
        self.blocks = nn.LayerList([Block(16, dropout, dtype) for _ in range(3)])
        self.branch = nn.Sequential(("fc", nn.Linear(16, 16, dtype=dtype)), ("act", nn.ReLU()))
        self.head = nn.Linear(16, CLASSES, dtype=dtype)
        self.helper = helper

    def forward(self, x):
        h = F.relu(self.embed(x))
        for block in self.blocks:
            h = HELPERS[self.helper](block, h) if self.helper else block(h)
        h = h + self.branch(h)
        return self.head(h)


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
    grads = {p.name: p.grad.numpy().copy() for p in model.parameters()}
    return model.state_dict(), grads, losses, backend.rng_state(), opt


def run_user(fields, idiom="minimize", fuse=False, make_model=UserModel, local=True,
             steps=STEPS):
    """``run`` for a user model through either idiom (``"minimize"`` or ``"dygraph"``: model(x),
    loss.backward(), opt.step(), opt.clear_grad()); the gradients are read after the last
    ``step()``."""
    fleet.init(is_collective=True)
    size, rank = (1, 0) if local else (fleet.worker_num(), fleet.worker_index())
    backend.manual_seed(0)
    model = fleet.distributed_model(make_model())
    opt = fleet.distributed_optimizer(
        optimizer.Momentum(learning_rate=0.1, momentum=0.9, parameters=model.parameters()),
        strategy(fuse, **fields), local=local)
    losses = []
    for step in range(steps):
        x, y = global_batch(step)
        x, y = shard(x, rank, size), shard(y, rank, size)
        if idiom == "minimize":
            losses.append(float(opt.minimize(model, nn.CrossEntropyLoss(), x, y)))
        else:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        grads = {p.name: p.grad.numpy().copy() for p in model.parameters()}
        if idiom != "minimize":
            opt.clear_grad()
    return model.state_dict(), grads, losses, backend.rng_state(), opt


def assert_identical(reference, result):
    state, grads, losses, rng, _ = result
    assert losses == reference[2]
    for name, value in reference[0].items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)
    for name, value in reference[1].items():
        np.testing.assert_array_equal(grads[name], value, err_msg=name)
    assert rng == reference[3], "recompute changed the rank generator's draws after the step"


def recorded_nodes(tensor):
    """Every node of the recorded graph below ``tensor``."""
    nodes, stack, seen = [], [tensor._node], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        stack.extend(t._node for _, t in node._inputs)
    return nodes


def no_forward_left(model):
    """Every layer of ``model`` has its own forward again (none left by the strategy)."""
    return all(not isinstance(vars(layer).get("forward"), type(lambda: 0))
               for _, layer in model.named_sublayers(include_self=True))


# -- Sequential checkpoints: boundaries -----------------------------------------------------------

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


@pytest.mark.parametrize("checkpoints", [["relu0"], ["bn0", "block"], ["block", "pool"],
                                         ["block.body"], ["block.body.bn1", "pool"]],
                         ids="+".join)
def test_recompute_through_convolutions_and_residual_blocks(checkpoints):
    """Top-level boundaries, a residual block's body (its whole call), and a boundary inside
    that body (a Sequential nested in the block)."""
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
    # act1 feeds a dropped segment and goes to the host; act2 feeds the kept last segment.
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
    generator = _FakeDeviceGenerator()
    monkeypatch.setattr(backend, "on_gpu", lambda: True)
    monkeypatch.setattr(backend, "_rank_rng", generator)
    untouched, state = autograd_recompute.run_recording_draws(lambda: 1)
    assert untouched == 1 and not state
    first, state = autograd_recompute.run_recording_draws(
        lambda: backend.rank_rng().random((2, 3)))
    assert backend.rank_rng() is generator
    after = generator.bit_generator._state.copy()
    again = autograd_recompute.run_replaying_draws(lambda: backend.rank_rng().random((2, 3)),
                                                   state)
    np.testing.assert_array_equal(again, first)
    np.testing.assert_array_equal(generator.bit_generator._state, after)


def test_a_fused_away_activation_names_the_fused_step():
    backend.manual_seed(0)
    model = model_with_dropout_and_batch_norm()
    model.configure_fusion(True, True)
    segments = cut_into_segments(model, ["act0", "act1"])
    assert [[(type(layer).__name__, act) for layer, act in segment.steps]
            for segment in segments] == \
        [[("Linear", "relu")], [("Dropout", None), ("Linear", None), ("BatchNorm1D", "relu")],
         [("Linear", "tanh"), ("Dropout", None), ("Linear", None)]]
    assert [segment.checkpoint for segment in segments] == ["act0", "act1", None]
    model.configure_fusion(False, False)
    segments = cut_into_segments(model, ["act0", "act1"], prefix="model.")
    assert [len(segment.steps) for segment in segments] == [2, 4, 4]
    assert [segment.checkpoint for segment in segments] == ["model.act0", "model.act1", None]


class Inspect(StepHook):
    """Records the recorded nodes below the loss when backward starts, the parameters
    reported as their gradients became final, and the step's model after the step."""

    name = "inspect"

    def __init__(self):
        self.nodes = []
        self.model_after_step = None
        self.reported = []

    def backward(self, ctx, proceed):
        self.nodes = [type(node).__name__ for node in recorded_nodes(ctx.loss)]
        return proceed(ctx)

    def on_gradient(self, ctx, parameters):
        self.reported.append([p.name for p in parameters])

    def after_step(self, ctx, proceed):
        self.model_after_step = ctx.model
        return proceed(ctx)


def test_forward_records_only_the_last_segment_and_one_node_per_dropped_one():
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = model_with_dropout_and_batch_norm()
    opt = fleet.distributed_optimizer(
        optimizer.SGD(learning_rate=0.1, parameters=model.parameters()),
        strategy(**recompute(["act1"])), local=True)
    inspect = Inspect()
    opt.add_hook(inspect)
    x, y = global_batch(0)
    opt.minimize(model, nn.CrossEntropyLoss(), x, y)
    nodes = sorted(inspect.nodes)
    # fc0 ... act1 (Linear, ReLU, Dropout, Linear, BatchNorm, ReLU) are one Recomputation;
    # fc2, act2, drop2, fc3 and the loss are recorded as they ran.
    assert nodes.count("Recomputation") == 1
    assert "BatchNorm" not in nodes and "ReLU" not in nodes, nodes
    assert nodes.count("Linear") == 2 and {"Tanh", "Dropout"} <= set(nodes), nodes
    assert inspect.model_after_step is model
    assert no_forward_left(model)
    assert opt.strategies["recompute"].peak_activation_bytes > 0


@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused"])
def test_gradients_are_reported_in_the_order_of_the_run_without_recompute(fuse):
    """The same parameters in the same order as without recompute, each reported after the
    recomputation added to it, so the bucketed allreduce starts on the same buckets while
    backward goes on."""
    fleet.init(is_collective=True)
    reported = []
    for fields in ({}, recompute(["act0", "act1"])):
        backend.manual_seed(0)
        model = model_with_dropout_and_batch_norm()
        opt = fleet.distributed_optimizer(
            optimizer.SGD(learning_rate=0.1, parameters=model.parameters()),
            strategy(fuse, **fields), local=True)
        inspect = Inspect()
        opt.add_hook(inspect)
        opt.minimize(model, nn.CrossEntropyLoss(), *global_batch(0))
        reported.append(inspect.reported)
    assert reported[0] == reported[1]
    assert [group[0] for group in reported[0] if group[0].endswith("weight")] == \
        ["fc3.weight", "fc2.weight", "bn1.weight", "fc1.weight", "fc0.weight"]


def every_layer_kind():
    """One instance of every layer class of fleetmpi.nn with a forward, and its inputs."""
    x2 = np.random.default_rng(0).standard_normal((4, 3))
    x4 = np.random.default_rng(1).standard_normal((2, 3, 4, 4))
    labels = np.array([0, 2, 1, 2])
    x3 = x4[:, 0].copy()
    return [(nn.Linear(3, 5), (x2,)), (nn.ReLU(), (x2,)), (nn.Tanh(), (x2,)),
            (nn.GELU(), (x2,)), (nn.Sigmoid(), (x2,)), (nn.Softmax(), (x2,)),
            (nn.Dropout(0.5), (x2,)), (nn.Flatten(), (x4,)),
            (nn.Embedding(7, 3), (np.array([[1, 2], [6, 0]]),)),
            (nn.BatchNorm1D(3), (x2,)), (nn.BatchNorm2D(3), (x4,)), (nn.LayerNorm(3), (x2,)),
            (nn.Conv2D(3, 2, 3, padding=1), (x4,)), (nn.MaxPool2D(2), (x4,)),
            (nn.AvgPool2D(3, 1, 1), (x4,)), (nn.GlobalAvgPool(), (x4,)),
            (nn.AdaptiveAvgPool2D(2), (x4,)), (nn.basic_block(3, 3), (x4,)),
            (nn.Sequential(nn.Linear(3, 3), nn.Tanh()), (x2,)), (nn.MLP([3, 4, 2]), (x2,)),
            (nn.GPT(vocab_size=7, block_size=3, n_layer=1, n_head=1, n_embd=4),
             (np.array([[1, 2, 3], [6, 0, 5]]),)),
            (nn.CrossEntropyLoss(), (x2, labels)), (nn.MSELoss(), (x2, x2[::-1].copy())),
            (nn.ColumnParallelLinear(3, 5, has_bias=True), (x2,)), (nn.RowParallelLinear(3, 5), (x2,)),
            (nn.VocabParallelEmbedding(7, 3), (np.array([[1, 2], [6, 0]]),)),
            (nn.ParallelCrossEntropy(reduction="mean"), (x2, labels)),
            (nn.BatchNorm3D(3), (x4[:, :, None].copy(),)), (nn.L1Loss(), (x2, x2[::-1].copy())),
            (nn.SmoothL1Loss(), (x2, x2[::-1].copy())),
            (nn.BCEWithLogitsLoss(), (x2, (x2 > 0).astype(x2.dtype))),
            (nn.NLLLoss(), (x2, labels)),
            (nn.GRU(4, 2, direction="bidirect"), (x3,)),
            (nn.MultiHeadAttention(4, 2), (x3,)),
            (nn.TransformerEncoderLayer(4, 2, 6), (x3,)),
            (nn.TransformerEncoder(nn.TransformerEncoderLayer(4, 2, 6), 2), (x3,))]


def test_fleet_utils_recompute_of_every_layer_kind_is_the_plain_call(float64_layers):
    """For every layer: the output, the input's and the parameters' gradients and the buffers
    are those of the plain call bit for bit, and what the graph holds is the kept input and
    the output only."""
    layers = every_layer_kind()
    assert {type(layer) for layer, _ in layers} >= {
        cls for cls in vars(nn).values() if isinstance(cls, type)
        and issubclass(cls, nn.Layer)
        and cls not in (nn.Layer, nn.Activation, nn.BatchNorm, nn.LayerList, nn.LayerDict,
                        # its (outputs, (h, c)) is a nesting recompute does not take
                        nn.LSTM)}
    for layer, inputs in layers:
        name = type(layer).__name__
        start = layer.state_dict()
        results = []
        for call in (layer, functools.partial(fleet.utils.recompute, layer)):
            layer.set_state_dict(start)
            args = [fleet.to_tensor(a, stop_gradient=a.dtype.kind != "f" or i > 0)
                    for i, a in enumerate(inputs)]
            for p in layer.parameters():
                p.clear_gradient()
            backend.manual_seed(0)
            backend.rank_rng()
            y = call(*args)
            y = y[0] if isinstance(y, tuple) else y  # an RNN's outputs, not its final states
            held = held_activation_bytes(layer, y)
            y.backward(np.ones(y.shape))
            results.append((y.numpy(), [a.grad for a in args],
                            [p.grad.numpy().copy() for p in layer.parameters()], layer.state_dict(),
                            held, backend.rng_state()))
        (y0, dx0, dp0, state0, _, rng0), (y1, dx1, dp1, state1, held1, rng1) = results
        np.testing.assert_array_equal(y1, y0, err_msg=name)
        for a, b in zip(dx1 + dp1, dx0 + dp0):
            equal(a, b, err_msg=name)
        for key, value in state0.items():
            equal(state1[key], value, err_msg=f"{name} {key}")
        assert rng1 == rng0, name
        assert held1 <= sum(a.nbytes for a in inputs) + y1.nbytes, name


# -- checkpoints of a user-defined model, and fleet.utils.recompute ------------------------------

USER_CHECKPOINTS = [["blocks.0", "blocks.1", "blocks.2"], ["blocks.1"], ["embed", "branch"],
                    ["blocks.0.mlp.drop", "blocks.2.mlp.act"], ["blocks.1", "blocks.1.mlp.act"],
                    ["blocks.2.norm", "head"]]


@pytest.mark.parametrize("idiom", ["minimize", "dygraph"])
@pytest.mark.parametrize("checkpoints", USER_CHECKPOINTS, ids="+".join)
def test_checkpoints_of_a_user_model_are_bit_for_bit(idiom, checkpoints):
    """Whole blocks of a LayerList, attributes, a residual branch, boundaries in a Sequential
    inside a block, and a block recomputed with a boundary inside it as well."""
    reference = run_user({}, idiom)
    result = run_user(recompute(checkpoints), idiom)
    assert_identical(reference, result)
    assert result[4].strategies["recompute"].peak_activation_bytes > 0


@pytest.mark.parametrize("idiom", ["minimize", "dygraph"])
@pytest.mark.parametrize("make_model, checkpoints", [
    (UserModel, ["blocks.0", "blocks.1", "blocks.2"]),
    (model_with_dropout_and_batch_norm, ["act0", "drop0", "act1"])], ids=["user", "sequential"])
def test_both_idioms_recompute_and_give_back_the_layers_forwards(idiom, make_model,
                                                                   checkpoints):
    """The model's own forward too (a Sequential's checkpoints): the dygraph idiom's step
    runs the forward the strategy gave the model for its forward stage."""
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = fleet.distributed_model(make_model())
    opt = fleet.distributed_optimizer(
        optimizer.SGD(learning_rate=0.1, parameters=model.parameters()),
        strategy(**recompute(checkpoints)), local=True)
    inspect = Inspect()
    opt.add_hook(inspect)
    x, y = global_batch(0)
    if idiom == "minimize":
        opt.minimize(model, nn.CrossEntropyLoss(), x, y)
    else:
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert inspect.nodes.count("Recomputation") == 3, inspect.nodes
    assert "BatchNorm" not in inspect.nodes
    assert no_forward_left(model)


@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("helper", sorted(HELPERS))
def test_fleet_utils_recompute_inside_a_user_forward_is_bit_for_bit(helper, fuse):
    """A layer, a closure over it, its bound forward and a partial: parameters found, buffers
    kept, dropout replayed."""
    reference = run_user({}, "dygraph", fuse)
    result = run_user({}, "dygraph", fuse, make_model=lambda: UserModel(helper=helper))
    assert_identical(reference, result)


def test_fleet_utils_recompute_reports_gradients_in_the_order_of_the_plain_run():
    fleet.init(is_collective=True)
    reported = []
    for helper in (None, "closure"):
        backend.manual_seed(0)
        model = fleet.distributed_model(UserModel(helper=helper))
        opt = fleet.distributed_optimizer(
            optimizer.SGD(learning_rate=0.1, parameters=model.parameters()), local=True)
        inspect = Inspect()
        opt.add_hook(inspect)
        x, y = global_batch(0)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        reported.append(inspect.reported)
        assert ("Recomputation" in inspect.nodes) == (helper is not None)
    assert reported[0] == reported[1]
    assert len(reported[0]) == len(model.parameters())


def test_recompute_of_a_function_of_several_tensors_and_keywords():
    """Several positional inputs (one used twice), a keyword argument passed through, and
    several outputs: gradients of every input and parameter as the plain call gives them."""
    backend.manual_seed(0)
    layer = nn.Linear(4, 4, dtype="float64")
    layer.parameters()
    rng = np.random.default_rng(3)
    a0, b0 = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))

    def function(a, b, scale=1.0):
        h = layer(a) * b
        return F.tanh(h) * scale, h + a

    results = []
    for call in (function, functools.partial(fleet.utils.recompute, function)):
        a, b = fleet.to_tensor(a0, stop_gradient=False), fleet.to_tensor(b0, stop_gradient=False)
        layer.clear_gradients()
        first, second = call(a, b, scale=3.0)
        (first.sum() + (second * second).sum()).backward()
        results.append([a.grad, b.grad, layer.weight.grad.numpy().copy(),
                        layer.bias.grad.numpy().copy(),
                        first.numpy()])
    for got, expected in zip(results[1], results[0]):
        equal(got, expected)


def test_dropout_inside_a_recomputed_segment_replays_its_mask():
    """The recomputation draws the forward's dropout masks again (and leaves the generator as
    the plain run does); with preserve_rng_state=False it draws new ones."""
    backend.manual_seed(0)
    layer = nn.Sequential(nn.Linear(5, 32, dtype="float64"), nn.Dropout(0.5),
                          nn.Linear(32, 1, dtype="float64"))
    layer.parameters()
    x = np.random.default_rng(4).standard_normal((16, 5))
    results = []
    for call in (layer, functools.partial(fleet.utils.recompute, layer),
                 functools.partial(fleet.utils.recompute, layer, preserve_rng_state=False)):
        layer.clear_gradients()
        backend.manual_seed(7)
        call(x).sum().backward()
        results.append(([p.grad.numpy().copy() for p in layer.parameters()], backend.rng_state()))
    plain, replayed, redrawn = results
    for got, expected in zip(replayed[0], plain[0]):
        equal(got, expected)
    assert replayed[1] == plain[1]
    assert not all(np.array_equal(backend.to_numpy(g), backend.to_numpy(e))
                   for g, e in zip(redrawn[0], plain[0]))


def test_amp_casts_are_repeated_in_the_recomputation():
    """Checkpoints of a user model under amp: the recomputation runs under the autocast policy
    of the forward, so its float16 operations and gradients are those of amp alone."""
    amp = {"amp": True, "amp_configs": {"init_loss_scaling": 1024.0}}
    reference = run_user(amp, "dygraph", make_model=lambda: UserModel("float32"))
    result = run_user(dict(amp, **recompute(["blocks.0", "blocks.2.mlp.act", "branch"])),
                      "dygraph", make_model=lambda: UserModel("float32"))
    assert_identical(reference, result)


def test_a_sublayer_called_twice_is_recomputed_at_each_call():
    class Twice(nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(FEATURES, FEATURES, dtype="float64")
            self.block = nn.Sequential(("fc", nn.Linear(FEATURES, FEATURES, dtype="float64")),
                                       ("act", nn.Tanh()), ("drop", nn.Dropout(0.3)))
            self.head = nn.Linear(FEATURES, CLASSES, dtype="float64")

        def forward(self, x):
            return self.head(self.block(self.fc(self.block(x))))

    reference = run_user({}, make_model=Twice)
    result = run_user(recompute(["block"]), make_model=Twice)
    assert_identical(reference, result)


def test_offload_of_a_user_models_checkpoint_inputs():
    reference = run_user({})
    result = run_user(recompute(["blocks.1", "blocks.2"], enable_offload=True,
                                checkpoint_shape=[GLOBAL_BATCH, 16]))
    assert_identical(reference, result)
    assert result[4].strategies["recompute"].offloaded_bytes == 2 * GLOBAL_BATCH * 16 * 8
    with pytest.raises(ValueError, match=r"the input of checkpoint 'blocks.1' has shape "
                                         r"\(24, 16\), but checkpoint_shape is \[24, 12\]"):
        run_user(recompute(["blocks.1"], enable_offload=True,
                           checkpoint_shape=[GLOBAL_BATCH, 12]))


def test_a_tensor_needing_a_gradient_must_come_in_positionally():
    backend.manual_seed(0)
    layer = nn.Linear(3, 3, dtype="float64")
    x = fleet.to_tensor(np.ones((2, 3)), stop_gradient=False)
    h = x * 2.0
    out = fleet.utils.recompute(lambda a, other: layer(a) + other, x, other=h)
    with pytest.raises(RuntimeError, match="used a tensor computed outside it that needs a "
                                           "gradient .+ pass every such tensor as a positional"):
        out.sum().backward()
    with pytest.raises(TypeError, match="must return a Tensor or a non-empty tuple or list of "
                                        r"Tensors, got \['Tensor', 'int'\]"):
        fleet.utils.recompute(lambda a: (layer(a), 1), x)


def mlp16(width, classes=10):
    """16 Linear layers with ReLU between them: ``fc0..fc15``, ``act0..act14``."""
    return nn.MLP([width] * 16 + [classes], dtype="float32")


def traced_peak(opt, model, x, y):
    """Peak bytes NumPy allocated during one training step above what was live before it."""
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
            held[label] = held_activation_bytes(model, model(x))
    activation = batch * width * 4
    assert losses["every 4"] == losses["none"] == losses["offload"]
    # Without recompute every Linear's input (the output of the ReLU before it, which that
    # ReLU's backward needs too: one array) stays for backward, 16 in all; with checkpoints
    # every 4 layers the kept inputs and one segment's graph do.
    assert held["none"] >= 16 * activation, held
    assert held["every 4"] <= 8 * activation, held
    assert held["offload"] < held["every 4"], held
    assert peaks["every 4"] < 0.7 * peaks["none"], peaks
    assert peaks["offload"] < peaks["every 4"], peaks


def test_activation_meter_counts_each_block_once_and_no_parameters(float64_layers):
    model = nn.Sequential(("fc", nn.Linear(3, 4)), ("flat", nn.Flatten()),
                          ("bn", nn.BatchNorm1D(4)))
    model.parameters()
    model.eval()
    x = backend.asarray(np.ones((5, 3)))
    y = model(x)
    meter = ActivationMeter(model)
    # fc keeps x and its weight (a parameter, not counted); Flatten's reshape keeps only the
    # shape, and no call keeps the values of an input another call made (fc's output z is
    # freed); BatchNorm in eval keeps invstd and xhat; the output itself is held too. The
    # running statistics (buffers) are not counted.
    z = 5 * 4 * 8
    assert meter.held(y) == x.nbytes + 4 * 8 + z + z
    assert meter.held(y, y, y.reshape(-1)) == meter.held(y)
    assert held_activation_bytes(model, y) == meter.held(y)
    with fleet.no_grad():
        assert meter.held(model(x)) == z


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


def test_a_step_that_fails_inside_a_segment_leaves_the_generator_and_model_usable():
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = model_with_dropout_and_batch_norm()
    opt = fleet.distributed_optimizer(optimizer.SGD(parameters=model.parameters()),
                                      strategy(**recompute(["act1"])), local=True)
    x, y = global_batch(0)
    generator = backend.rank_rng()
    with pytest.raises(ValueError, match="Linear expects 6 features"):
        opt.minimize(model, nn.CrossEntropyLoss(), x[:, :5], y)
    assert backend.rank_rng() is generator
    assert no_forward_left(model)
    assert np.isfinite(float(opt.minimize(model, nn.CrossEntropyLoss(), x, y)))


@pytest.mark.parametrize("make_model, checkpoints, match", [
    (model_with_dropout_and_batch_norm, ["act1", "fc9"],
     r"checkpoints \['fc9'\] are not sublayers of the Sequential; checkpoints are dotted names "
     r"from its named_sublayers\(\): \['fc0', 'act0', 'drop0', 'fc1', 'bn1', 'act1'"),
    (model_with_dropout_and_batch_norm, ["fc1.weight"], r"\['fc1.weight'\] are not sublayers"),
    (UserModel, ["blocks.3"], r"\['blocks.3'\] are not sublayers of the UserModel; .+"
                              r"\['embed', 'blocks', 'blocks.0', 'blocks.0.norm'"),
], ids=["unknown", "parameter", "nested"])
def test_unknown_checkpoint_names_are_refused_listing_the_layers(make_model, checkpoints, match):
    fleet.init(is_collective=True)
    with pytest.raises(ValueError, match=match):
        train(strategy(**recompute(checkpoints)), steps=1, make_model=make_model, local=True)


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


def test_checkpoint_forwards_gives_every_layer_its_forward_back():
    """Inside the block the named layers run recomputed forwards; afterwards (also after an
    error inside) each has what it had, including a forward a user gave it."""
    model = UserModel()
    own = model.head.forward
    model.head.forward = own
    with checkpoint_forwards(model, ["blocks.1", "head", "branch.fc"]):
        assert "forward" in vars(model.blocks[1]) and vars(model.head)["forward"] is not own
        assert "forward" in vars(model.branch)
    with checkpoint_forwards(model, ["branch.act"]):
        # The checkpoint ends the Sequential: its one segment is the kept last one.
        assert "forward" not in vars(model.branch)
    assert vars(model.head)["forward"] is own
    assert "forward" not in vars(model.blocks[1]) and "forward" not in vars(model.branch)
    with pytest.raises(KeyError):
        with checkpoint_forwards(model, ["blocks.1"]):
            raise KeyError("inside")
    assert "forward" not in vars(model.blocks[1])


# -- N ranks ------------------------------------------------------------------------------------

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
        if not is_running_statistic(name):
            equal(world_gather(value)[0], value, err_msg=f"{name} differs between ranks")
    for name, value in reference[1].items():
        equal(result[1][name], value, err_msg=name)
    ok(result[3] == reference[3], "recompute changed the rank generator's draws")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("idiom", ["minimize", "dygraph"])
@pytest.mark.parametrize("checkpoints", [["blocks.0", "blocks.1", "blocks.2"],
                                         ["blocks.1.mlp.act", "branch"]], ids="+".join)
def test_every_rank_matches_for_a_user_model(idiom, checkpoints):
    fields = {"fuse_all_reduce_ops": False}
    reference = run_user(fields, idiom, local=False)
    result = run_user(dict(fields, **recompute(checkpoints)), idiom, local=False)
    equal(np.array(result[2]), np.array(reference[2]))
    for name, value in reference[0].items():
        equal(result[0][name], value, err_msg=name)
        if not is_running_statistic(name):
            equal(world_gather(value)[0], value, err_msg=f"{name} differs between ranks")
    for name, value in reference[1].items():
        equal(result[1][name], value, err_msg=name)
    ok(result[3] == reference[3], "recompute changed the rank generator's draws")


@pytest.mark.mpi(min_size=2)
def test_every_rank_matches_with_fleet_utils_recompute_in_the_forward():
    reference = run_user({}, "dygraph", local=False)
    result = run_user({}, "dygraph", local=False,
                      make_model=lambda: UserModel(helper="closure"))
    for name, value in reference[0].items():
        equal(result[0][name], value, err_msg=name)
    for name, value in reference[1].items():
        equal(result[1][name], value, err_msg=name)


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

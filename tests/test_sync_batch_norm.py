"""sync_batch_norm: BatchNorm statistics over the global batch. At N ranks a BatchNorm layer, and
training under the strategy, equal BatchNorm on the global batch in one process; alone it is
plain BatchNorm."""
import logging

import numpy as np
import pytest

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from fleetmpi.core import backend
from fleetmpi import nn, optimizer, to_tensor
from fleetmpi.comm import get_communicator
from fleetmpi.nn.functional.norm import batch_statistics
from strategy_support import CLASSES, FEATURES, GLOBAL_BATCH, global_batch, make_mlp, \
    make_strategy, shard, train, train_step, world_gather
from comm_support import close, equal, ok

RTOL, ATOL = 1e-10, 1e-12


# -- one BatchNorm layer ----------------------------------------------------------------------

def layer_data(tail, rows, seed=0):
    """A global input of ``sum(rows)`` rows with trailing shape ``tail``, an output gradient of
    the same shape, and per-channel weight and bias."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((sum(rows),) + tail) * 3.0 + 1.5
    dz = rng.standard_normal(x.shape)
    channels = tail[0]
    return x, dz, rng.standard_normal(channels) + 1.0, rng.standard_normal(channels)


def make_layer(tail, weight, bias, communicator=None):
    cls = nn.BatchNorm2D if len(tail) == 3 else nn.BatchNorm1D
    layer = cls(tail[0], dtype="float64")
    layer.weight.data[...] = backend.asarray(weight)
    layer.bias.data[...] = backend.asarray(bias)
    layer.sync_communicator = communicator
    return layer


def run_layer(layer, x, dz, fused):
    """Output, input gradient, weight and bias gradients of one step of ``layer``: its
    forward on ``x`` recorded, then the backward of ``dz`` (the parameters' gradients cleared
    first, since backward accumulates into them)."""
    layer.clear_gradients()
    x = to_tensor(x, stop_gradient=False)
    y = layer.forward_act(x, "relu") if fused else layer(x)
    y.backward(dz)
    return y.numpy(), x.grad, layer.weight.grad.numpy().copy(), layer.bias.grad.numpy().copy()


def rows_per_rank(layout, size):
    if layout == "equal":
        return [6] * size
    if layout == "unequal":
        return [1 + 2 * rank for rank in range(size)]
    return [rank + 2 for rank in range(size - 1)] + [0]


TAILS = {"1d": (5,), "1d_length": (4, 3), "2d": (3, 4, 4)}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused_relu"])
@pytest.mark.parametrize("layout", ["equal", "unequal", "empty_rank"])
@pytest.mark.parametrize("tail", sorted(TAILS))
def test_layer_at_n_ranks_equals_global_batch(tail, layout, fused):
    fleet.init(is_collective=True)
    size, rank = fleet.worker_num(), fleet.worker_index()
    tail = TAILS[tail]
    rows = rows_per_rank(layout, size)
    start, stop = sum(rows[:rank]), sum(rows[:rank + 1])
    mine = slice(start, stop)
    _, _, weight, bias = layer_data(tail, rows)
    synced_layer = make_layer(tail, weight, bias, get_communicator())
    reference_layer = make_layer(tail, weight, bias)
    for step in range(2):
        x, dz, _, _ = layer_data(tail, rows, seed=step)
        y, dx, dweight, dbias = run_layer(synced_layer, x[mine], dz[mine], fused)
        ry, rdx, rdweight, rdbias = run_layer(reference_layer, x, dz, fused)
        ok(y.shape == (stop - start,) + tail, f"output shape {y.shape}")
        close(y, ry[mine], rtol=RTOL, atol=ATOL)
        close(dx, rdx[mine], rtol=RTOL, atol=ATOL)
        # The parameter gradients are this rank's share; the shares add up to the global ones.
        close(world_gather(dweight).sum(axis=0), rdweight, rtol=RTOL, atol=ATOL)
        close(world_gather(dbias).sum(axis=0), rdbias, rtol=RTOL, atol=ATOL)
        for name in ("_mean", "_variance"):
            close(synced_layer.buffer(name), reference_layer.buffer(name), rtol=RTOL, atol=ATOL)
            equal(world_gather(synced_layer.buffer(name))[0], synced_layer.buffer(name))


@pytest.mark.mpi(min_size=2)
def test_eval_mode_does_not_communicate():
    fleet.init(is_collective=True)
    communicator = get_communicator()
    x, dz, weight, bias = layer_data((5,), [4])
    layer = make_layer((5,), weight, bias, communicator)
    layer(x * (1 + fleet.worker_index()))
    trained = communicator.payload_bytes
    layer.eval()
    y, dx, _, _ = run_layer(layer, x, dz, fused=False)
    ok(communicator.payload_bytes == trained, "eval mode sent something")
    local = make_layer((5,), weight, bias)
    for name in ("_mean", "_variance"):
        local.buffer(name)[...] = layer.buffer(name)
    local.eval()
    ly, ldx, _, _ = run_layer(local, x, dz, fused=False)
    equal(y, ly)
    equal(dx, ldx)


def test_local_statistics_are_numpys_mean_and_var():
    """The batch statistics, and what a training forward normalizes with (the recorded
    call's mean and inverse standard deviation, and the running statistics after one step
    at momentum 0), are the backend's ``mean`` and ``var``: bit for bit on NumPy; CuPy's own
    reductions sum in another order than batch norm's, so there to a rounding unit."""
    same = close if backend.on_gpu() else equal
    rounding = {"rtol": 2e-7} if backend.on_gpu() else {}
    for dtype in ("float32", "float64"):
        for tail in TAILS.values():
            x, _, weight, bias = layer_data(tail, [7])
            x = backend.asarray(x.astype(dtype))
            axes = (0,) + tuple(range(2, x.ndim))
            mean, var, count = batch_statistics(x, axes, None)
            same(mean, x.mean(axis=axes), **rounding)
            same(var, x.var(axis=axes), **rounding)
            assert count == x.size // tail[0]
            layer = make_layer(tail, weight, bias)
            layer.momentum = 0.0
            layer.weight.data[...] = 1.0
            layer.bias.data[...] = 0.0
            y = layer(to_tensor(x, stop_gradient=False))
            invstd = 1 / backend.array_module().sqrt(x.var(axis=axes) + 1e-5)
            same(y._node.invstd, invstd, **rounding)
            shape = (1, -1) + (1,) * (x.ndim - 2)
            tolerance = 1e-5 if dtype == "float32" else 1e-12
            close(y, (x - x.mean(axis=axes).reshape(shape)) * invstd.reshape(shape),
                  rtol=tolerance, atol=tolerance)
            same(layer.buffer("_mean"), x.mean(axis=axes), **rounding)
            same(layer.buffer("_variance"), x.var(axis=axes), **rounding)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused_relu"])
def test_size_one_communicator_equals_plain_batch_norm(fused):
    fleet.init(is_collective=True)
    communicator = get_communicator()
    assert communicator.size == 1
    x, dz, weight, bias = layer_data((3, 4, 4), [5])
    synced, plain = (make_layer((3, 4, 4), weight, bias, c) for c in (communicator, None))
    before = communicator.payload_bytes
    for a, b in zip(run_layer(synced, x, dz, fused), run_layer(plain, x, dz, fused)):
        equal(a, b)
    assert communicator.payload_bytes > before
    for name in ("_mean", "_variance"):
        equal(synced.buffer(name), plain.buffer(name))


def test_empty_batch_is_refused_in_training():
    x, _, weight, bias = layer_data((5,), [0])
    layer = make_layer((5,), weight, bias)
    with pytest.raises(ValueError, match=r"empty here \(input shape \(0, 5\)\)"):
        layer(x)
    layer.eval()
    assert layer(x).shape == [0, 5]


# -- training under the strategy --------------------------------------------------------------

def bn_mlp():
    """Linear, BatchNorm1D and ReLU twice, then a linear head (float64)."""
    return nn.Sequential(("fc0", nn.Linear(FEATURES, 16, dtype="float64")),
                         ("bn0", nn.BatchNorm1D(16, dtype="float64")), ("act0", nn.ReLU()),
                         ("fc1", nn.Linear(16, 12, dtype="float64")),
                         ("bn1", nn.BatchNorm1D(12, dtype="float64")), ("act1", nn.ReLU()),
                         ("fc2", nn.Linear(12, CLASSES, dtype="float64")))


def bn_convnet():
    """A convolution with BatchNorm2D and ReLU, a residual basic block, pooling, a linear head."""
    return nn.Sequential(
        ("conv", nn.Conv2D(2, 4, 3, padding=1, bias_attr=False, dtype="float64")),
        ("bn", nn.BatchNorm2D(4, dtype="float64")), ("relu", nn.ReLU()),
        ("block", nn.basic_block(4, 6, stride=2, dtype="float64")),
        ("pool", nn.GlobalAvgPool()), ("fc", nn.Linear(6, CLASSES, dtype="float64")))


def image_batch(step):
    rng = np.random.default_rng(200 + step)
    return (rng.standard_normal((GLOBAL_BATCH, 2, 6, 6)) * 2.0 + 0.5,
            rng.integers(0, CLASSES, GLOBAL_BATCH))


def resnet20():
    """``nn.resnet20`` itself: 19 convolutions with batch norm, residual additions (float64)."""
    return nn.resnet20(num_classes=CLASSES, dtype="float64")


def cifar_like_batch(step):
    """Three-channel images, small enough (8x8) that ResNet-20's two stride-2 stages leave 2x2."""
    rng = np.random.default_rng(300 + step)
    return (rng.standard_normal((GLOBAL_BATCH, 3, 8, 8)) + 0.2,
            rng.integers(0, CLASSES, GLOBAL_BATCH))


MODELS = {"mlp_bn1d": (bn_mlp, global_batch), "convnet_bn2d": (bn_convnet, image_batch),
          "resnet20": (resnet20, cifar_like_batch)}
STEPS = 4


def sync_strategy(fuse_bn_act_ops, enabled=True):
    return make_strategy(sync_batch_norm=enabled,
                         build_strategy={"fuse_bn_act_ops": fuse_bn_act_ops})


def gradients(model):
    return {name: p.grad.numpy().copy() for name, p in model.named_parameters()}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fuse_bn_act_ops", [False, True], ids=["unfused", "fuse_bn_act"])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_training_at_n_ranks_equals_one_process(model_name, fuse_bn_act_ops):
    make_model, batch = MODELS[model_name]
    model, opt, losses = train(sync_strategy(fuse_bn_act_ops), make_model=make_model,
                               batch=batch, steps=STEPS)
    expected, _, expected_losses = train(sync_strategy(fuse_bn_act_ops), make_model=make_model,
                                         batch=batch, steps=STEPS, local=True)
    if fuse_bn_act_ops:
        ok(model.fused_steps() > 0, "no batch norm ran fused with its ReLU")
    layers = opt.strategies["sync_batch_norm"].layers
    ok(len(layers) == sum(isinstance(layer, nn.BatchNorm) for _, layer in
                          model.named_sublayers()) > 0, f"synchronised {len(layers)} layers")
    ok(all(layer.sync_communicator is None for layer in layers), "communicator left behind")
    # Each rank's loss is the mean over its equal share, so their mean is the global loss.
    close(world_gather(np.array(losses)).mean(axis=0), expected_losses, rtol=RTOL, atol=ATOL)
    wanted_grads = gradients(expected)
    for name, grad in gradients(model).items():
        close(grad, wanted_grads[name], rtol=RTOL, atol=ATOL, err_msg=f"gradient of {name}")
    wanted = expected.state_dict()
    for name, value in model.state_dict().items():
        close(value, wanted[name], rtol=RTOL, atol=ATOL, err_msg=name)
        equal(world_gather(value)[0], value)


@pytest.mark.mpi(min_size=2)
def test_without_sync_batch_norm_statistics_are_per_rank():
    model, _, _ = train(sync_strategy(False, enabled=False), make_model=bn_mlp, steps=STEPS)
    expected, _, _ = train(sync_strategy(False, enabled=False), make_model=bn_mlp,
                           steps=STEPS, local=True)
    mean = model["bn0"].buffer("_mean")
    ok(not np.allclose(mean, expected["bn0"].buffer("_mean"), rtol=1e-6),
       "local batch norm matched the global batch")
    gathered = world_gather(mean)
    ok(any(not np.allclose(gathered[0], other) for other in gathered[1:]),
       "ranks computed the same local statistics")


def test_alone_it_is_plain_batch_norm():
    model, opt, losses = train(sync_strategy(True), make_model=bn_convnet, batch=image_batch,
                               local=True)
    plain, _, plain_losses = train(sync_strategy(True, enabled=False), make_model=bn_convnet,
                                   batch=image_batch, local=True)
    assert losses == plain_losses
    wanted = plain.state_dict()
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value, wanted[name], err_msg=name)
    assert len(opt.strategies["sync_batch_norm"].layers) == 4


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_model_without_batch_norm_warns_once():
    records = _Records()
    logger = logging.getLogger("fleetmpi")
    logger.addHandler(records)
    try:
        model, _, losses = train(make_strategy(sync_batch_norm=True), make_model=make_mlp,
                                 steps=3, local=True)
    finally:
        logger.removeHandler(records)
    _, _, plain_losses = train(make_strategy(), make_model=make_mlp, steps=3, local=True)
    assert losses == plain_losses
    warnings = [m for m in records.messages if "sync_batch_norm" in m]
    assert len(warnings) == 1 and "no BatchNorm layer" in warnings[0], records.messages


# -- a user-defined Layer with BatchNorm sublayers at depth, the dygraph idiom ----------------

class ConvUnit(nn.Layer):
    """Convolution, batch norm and ReLU: a user's building block."""

    def __init__(self, in_channels, out_channels):
        super().__init__(dtype="float64")
        self.conv = nn.Conv2D(in_channels, out_channels, 3, padding=1, bias_attr=False,
                              dtype="float64")
        self.norm = nn.BatchNorm2D(out_channels, dtype="float64")

    def forward(self, x):
        return F.relu(self.norm(self.conv(x)))


class DeepBatchNormNet(nn.Layer):
    """BatchNorm layers two and three levels down (in nested Layers, in a LayerList inside a
    LayerList), a residual branch, and a BatchNorm1D before the head."""

    def __init__(self):
        super().__init__(dtype="float64")
        self.stem = ConvUnit(2, 4)
        self.stages = nn.LayerList([ConvUnit(4, 4), nn.LayerList([ConvUnit(4, 6)])])
        self.head_norm = nn.BatchNorm1D(6, dtype="float64")
        self.head = nn.Linear(6, CLASSES, dtype="float64")

    def forward(self, x):
        h = self.stem(x)
        h = h + self.stages[0](h)
        h = self.stages[1][0](h)
        h = F.adaptive_avg_pool2d(h, 1).reshape(h.shape[0], -1)
        return self.head(F.relu(self.head_norm(h)))


DEEP_BATCH_NORMS = ["stem.norm", "stages.0.norm", "stages.1.0.norm", "head_norm"]


def train_deep_net(strategy, idiom, local=False, steps=STEPS):
    """``DeepBatchNormNet`` from seed 0, each rank on its share of ``image_batch`` (the whole
    batch when ``local``); returns ``(model, optimizer, losses)``."""
    fleet.init(is_collective=True)
    size, rank = (1, 0) if local else (fleet.worker_num(), fleet.worker_index())
    backend.manual_seed(0)
    # Through distributed_model also when local: calling it opens the optimizer's steps.
    model = fleet.distributed_model(DeepBatchNormNet())
    opt = fleet.distributed_optimizer(
        optimizer.Momentum(learning_rate=0.1, momentum=0.9, parameters=model.parameters()),
        strategy, local=local)
    losses = []
    for step in range(steps):
        x, y = (shard(a, rank, size) for a in image_batch(step))
        losses.append(train_step(opt, model, x, y, idiom))
    return model, opt, losses


@pytest.mark.mpi(min_size=2)
def test_user_layer_with_nested_batch_norms_in_the_dygraph_idiom_equals_one_process():
    """N ranks training a user Layer with ``loss.backward(); opt.step(); opt.clear_grad()``
    under sync_batch_norm equal one process on the global batch (losses, parameters, running
    statistics, and the eval-mode output from those), and ``opt.minimize`` bit for bit."""
    model, opt, losses = train_deep_net(sync_strategy(False), "dygraph")
    expected, _, expected_losses = train_deep_net(sync_strategy(False), "dygraph", local=True)
    layers = opt.strategies["sync_batch_norm"].layers
    named = dict(model.named_sublayers())
    ok([id(layer) for layer in layers] == [id(named[name]) for name in DEEP_BATCH_NORMS],
       f"synchronised {len(layers)} layers")
    ok(all(layer.sync_communicator is None for layer in layers), "communicator left behind")
    close(world_gather(np.array(losses)).mean(axis=0), expected_losses, rtol=RTOL, atol=ATOL)
    wanted = expected.state_dict()
    for name, value in model.state_dict().items():
        close(value, wanted[name], rtol=RTOL, atol=ATOL, err_msg=name)
        equal(world_gather(value)[0], value)
    x, _ = image_batch(STEPS)
    model.eval()
    expected.eval()
    close(model(x).numpy(), expected(x).numpy(), rtol=RTOL, atol=ATOL)
    minimized, _, minimized_losses = train_deep_net(sync_strategy(False), "minimize")
    equal(np.array(minimized_losses), np.array(losses))
    for name, value in minimized.state_dict().items():
        equal(value, model.state_dict()[name])


@pytest.mark.mpi(min_size=2)
def test_user_layer_without_sync_batch_norm_differs_from_one_process():
    """The same user Layer without the strategy normalizes per rank: its running statistics
    differ from one process's and between ranks (the test above is not vacuous)."""
    model, _, _ = train_deep_net(sync_strategy(False, enabled=False), "dygraph")
    expected, _, _ = train_deep_net(sync_strategy(False, enabled=False), "dygraph", local=True)
    mean = model.stages[1][0].norm.buffer("_mean")
    ok(not np.allclose(mean, expected.stages[1][0].norm.buffer("_mean"), rtol=1e-6),
       "local batch norm matched the global batch")
    gathered = world_gather(mean)
    ok(any(not np.allclose(gathered[0], other) for other in gathered[1:]),
       "ranks computed the same local statistics")


def test_backward_outside_a_step_of_the_model_is_refused_naming_sync_batch_norm():
    """A model not passed through ``distributed_model`` opens no step, so no forward stage
    gives its BatchNorms the communicator: ``opt.step()`` refuses that step."""
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = DeepBatchNormNet()
    opt = fleet.distributed_optimizer(
        optimizer.SGD(learning_rate=0.1, parameters=model.parameters()), sync_strategy(False))
    x, y = image_batch(0)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="sync_batch_norm acts while the model runs forward"):
        opt.step()

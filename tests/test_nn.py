"""Layers: finite-difference gradient checks in float64, flat buffers, names, state, errors."""
import importlib

import numpy as np
import pytest

from fleetmpi.core import backend
from fleetmpi import nn, to_tensor
from fleetmpi.autograd import run_backward
from fleetmpi.nn.gradcheck import check_gradients

TOLERANCE = 1e-6


pytestmark = pytest.mark.usefixtures("float64_layers")


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


LAYERS = {
    "linear": lambda: (nn.Linear(4, 3), rand(5, 4)),
    "linear_no_bias": lambda: (nn.Linear(4, 3, bias_attr=False), rand(5, 4)),
    "conv2d": lambda: (nn.Conv2D(2, 3, 3, stride=2, padding=1), rand(2, 2, 5, 5)),
    "conv2d_rect": lambda: (nn.Conv2D(2, 2, (1, 3), stride=(2, 1)), rand(2, 2, 4, 5)),
    "batchnorm1d": lambda: (nn.BatchNorm1D(3), rand(6, 3)),
    "batchnorm2d": lambda: (nn.BatchNorm2D(2), rand(3, 2, 3, 3)),
    "relu": lambda: (nn.ReLU(), rand(4, 5)),
    "gelu": lambda: (nn.GELU(), rand(4, 5)),
    "tanh": lambda: (nn.Tanh(), rand(4, 5)),
    "dropout": lambda: (nn.Dropout(0.4), rand(6, 5)),
    "maxpool": lambda: (nn.MaxPool2D(3, stride=2, padding=1), rand(2, 2, 5, 5)),
    "avgpool": lambda: (nn.AvgPool2D(2), rand(2, 2, 4, 4)),
    "avgpool_padded": lambda: (nn.AvgPool2D(3, stride=2, padding=1), rand(2, 2, 5, 5)),
    "global_avg_pool": lambda: (nn.GlobalAvgPool(), rand(2, 3, 2, 3)),
    "flatten": lambda: (nn.Flatten(), rand(2, 3, 2, 2)),
    "embedding": lambda: (nn.Embedding(6, 3), np.array([[0, 5, 2], [2, 2, 1]])),
    "mlp": lambda: (nn.MLP([4, 5, 3], activation="tanh"), rand(3, 4)),
    "residual_block": lambda: (nn.basic_block(2, 3, stride=2), rand(2, 2, 4, 4)),
    "bottleneck_block": lambda: (nn.bottleneck_block(4, 2), rand(2, 4, 3, 3)),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_gradients_match_finite_differences(name):
    layer, x = LAYERS[name]()
    errors = check_gradients(layer, x)
    expected = {n for n, _ in layer.named_parameters()} | ({"input0"} if x.dtype.kind == "f"
                                                            else set())
    assert set(errors) == expected
    assert max(errors.values()) < TOLERANCE, errors


def test_batchnorm_eval_mode_gradients():
    layer = nn.BatchNorm2D(2)
    layer(rand(4, 2, 3, 3, seed=3))
    layer.eval()
    errors = check_gradients(layer, rand(3, 2, 3, 3))
    assert max(errors.values()) < TOLERANCE, errors


def test_softmax_cross_entropy_gradient():
    logits = rand(4, 5)
    labels = np.array([0, 4, 2, 2])
    loss_fn = nn.CrossEntropyLoss()
    logits_tensor = to_tensor(logits, stop_gradient=False)
    loss = loss_fn(logits_tensor, labels)
    assert loss.shape == []
    loss.backward()
    grad = logits_tensor.grad.data
    numeric = np.zeros_like(logits)
    eps = 1e-6
    for index in np.ndindex(*logits.shape):
        bumped = logits.copy()
        bumped[index] += eps
        plus = float(loss_fn(bumped, labels))
        bumped[index] -= 2 * eps
        numeric[index] = (plus - float(loss_fn(bumped, labels))) / (2 * eps)
    np.testing.assert_allclose(backend.to_numpy(grad), numeric, rtol=1e-6, atol=1e-9)
    shifted = logits - logits.max(1, keepdims=True)
    expected = -np.mean(shifted[np.arange(4), labels] - np.log(np.exp(shifted).sum(1)))
    assert abs(float(loss) - expected) < 1e-12


def test_parameters_are_views_of_one_flat_buffer_in_backward_order():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    named = model.named_parameters()
    assert [n for n, _ in named] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    (buffer,) = model.flat_buffers()
    assert buffer.size == 4 * 8 + 8 + 8 * 2 + 2
    offsets = [p.offset for _, p in named]
    assert offsets == sorted(offsets, reverse=True)
    for _, p in named:
        assert np.shares_memory(p.data, buffer.data)
        assert np.shares_memory(p.grad, buffer.grad)
    buffer.data[:] = 7.0
    assert all((p.data == 7.0).all() for p in model.parameters())


def test_backward_reports_gradients_last_layer_first():
    model = nn.MLP([4, 6, 5, 3])
    model.parameters()
    y = model(rand(2, 4))
    seen = []
    run_backward([y], [np.ones((2, 3))], on_leaf_ready=lambda leaf: seen.append(leaf.name))
    assert seen == ["fc2.weight", "fc2.bias", "fc1.weight", "fc1.bias",
                    "fc0.weight", "fc0.bias"]
    flat_order = sorted(model.parameters(), key=lambda p: p.offset)
    assert [p.name for p in flat_order] == ["fc2.bias", "fc2.weight", "fc1.bias",
                                            "fc1.weight", "fc0.bias", "fc0.weight"]


def test_nested_container_is_repacked_into_one_buffer():
    inner = nn.Sequential(nn.Linear(3, 3))
    inner.parameters()
    outer = nn.Sequential(("block", inner), ("head", nn.Linear(3, 2)))
    assert len(outer.flat_buffers()) == 1
    assert [n for n, _ in outer.named_parameters()] == ["block.0.weight", "block.0.bias",
                                                        "head.weight", "head.bias"]


def test_sequential_names_and_lookup():
    model = nn.Sequential(("fc", nn.Linear(2, 2)), ("act", nn.ReLU()))
    assert model["fc"] is model[0]
    assert [n for n, _ in model.named_sublayers()] == ["fc", "act"]
    with pytest.raises(ValueError, match="unique"):
        nn.Sequential(("a", nn.ReLU()), ("a", nn.ReLU()))
    with pytest.raises(TypeError, match="must be a fleetmpi.nn.Layer"):
        nn.Sequential(("a", 3))


def test_state_dict_round_trip_includes_buffers():
    model = nn.Sequential(nn.Conv2D(1, 2, 3, padding=1), nn.BatchNorm2D(2), nn.ReLU())
    model(rand(2, 1, 4, 4))
    state = model.state_dict()
    assert set(state) == {"0.weight", "0.bias", "1.weight", "1.bias", "1._mean",
                          "1._variance"}
    backend.manual_seed(5)
    other = nn.Sequential(nn.Conv2D(1, 2, 3, padding=1), nn.BatchNorm2D(2), nn.ReLU())
    assert not np.array_equal(other.state_dict()["0.weight"], state["0.weight"])
    other.set_state_dict(state)
    for name, value in other.state_dict().items():
        np.testing.assert_array_equal(value, state[name])
    with pytest.raises(KeyError, match="missing"):
        other.set_state_dict({k: v for k, v in state.items() if k != "1.bias"})
    state["0.bias"] = np.zeros(3)
    with pytest.raises(ValueError, match="0.bias"):
        other.set_state_dict(state)


def test_initial_weights_follow_the_seed():
    backend.manual_seed(3)
    a = nn.MLP([5, 4, 2]).state_dict()
    backend.manual_seed(3)
    b = nn.MLP([5, 4, 2]).state_dict()
    backend.manual_seed(4)
    c = nn.MLP([5, 4, 2]).state_dict()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["fc0.weight"], c["fc0.weight"])


def test_dropout_is_identity_in_eval_and_scales_in_train():
    layer = nn.Dropout(0.5)
    x = to_tensor(np.ones((200, 50)))
    y = layer(x).numpy()
    assert set(np.unique(y)) == {0.0, 2.0}
    assert 0.4 < (y == 0).mean() < 0.6
    layer.eval()
    assert layer(x) is x


def test_resnet_shapes():
    model = nn.resnet20(num_classes=7)
    x = to_tensor(rand(2, 3, 16, 16), stop_gradient=False)
    y = model(x)
    assert y.shape == [2, 7]
    y.backward(np.ones(y.shape))
    assert x.grad.shape == x.shape
    # stem, stage 1, stage 2 and stage 3 (each with a 1x1 projection shortcut), head
    stem = 3 * 16 * 9 + 32
    stage1 = 3 * 2 * (16 * 16 * 9 + 32)
    stage2 = (16 * 32 * 9 + 64) + (32 * 32 * 9 + 64) + (16 * 32 + 64) + 2 * 2 * (32 * 32 * 9 + 64)
    stage3 = (32 * 64 * 9 + 128) + (64 * 64 * 9 + 128) + (32 * 64 + 128) + 2 * 2 * (
        64 * 64 * 9 + 128)
    assert sum(p.size for p in model.parameters()) == stem + stage1 + stage2 + stage3 + 64 * 7 + 7
    big = nn.resnet50(num_classes=5)
    # torchvision's resnet50 without its 1000-class head has 23,508,032 parameters
    assert sum(p.size for p in big.parameters()) == 23_508_032 + 2048 * 5 + 5
    x = to_tensor(rand(1, 3, 32, 32), stop_gradient=False)
    out = big(x)
    assert out.shape == [1, 5]
    out.backward(np.ones(out.shape))
    assert x.grad.shape == [1, 3, 32, 32]


@pytest.mark.parametrize("make, x, message", [
    (lambda: nn.Linear(4, 3), rand(2, 5), "expects 4 features"),
    (lambda: nn.Conv2D(3, 4, 3), rand(2, 3, 2, 2), "smaller than the kernel"),
    (lambda: nn.BatchNorm2D(3), rand(2, 3), "4-d input"),
    (lambda: nn.Embedding(4, 2), np.array([4]), r"\[0, 4\)"),
])
def test_bad_input_is_named(make, x, message):
    with pytest.raises(ValueError, match=message):
        make()(x)


@pytest.mark.parametrize("make, message", [
    (lambda: nn.Linear(0, 3), "in_features must be a positive integer, not 0"),
    (lambda: nn.Dropout(1.0), r"dropout p must be a number in \[0, 1\), not 1.0"),
    (lambda: nn.Conv2D(1, 1, 3, stride=0), "stride must be an integer >= 1"),
    (lambda: nn.MLP([3, 2], activation="swish"), "'swish' is not one of"),
    (lambda: nn.set_default_dtype("int32"), "dtype 'int32' is not allowed"),
])
def test_bad_configuration_is_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_loss_rejects_bad_labels():
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        nn.CrossEntropyLoss()(rand(2, 3), np.array([0, 3]))
    with pytest.raises(ValueError, match="integer class labels"):
        nn.CrossEntropyLoss()(rand(2, 3), np.array([0.0, 1.0]))


@pytest.mark.parametrize("act", ["relu", "tanh", "gelu"])
def test_every_activation_name_means_one_function_in_each_table(act):
    """The activation names are written in four places: the kernels' reference
    (``reference.ACTIVATIONS``), ``F.activation``'s Functions, the MLP's layers and the fused
    bias+activation kernel's codes. Each name is in all of them, each table holds no other,
    and the MLP's layer, ``F.activation`` and the kernels' reference compute the same values
    for it."""
    from fleetmpi import kernels
    from fleetmpi.kernels import reference
    from fleetmpi.nn import models
    activation = importlib.import_module("fleetmpi.nn.functional.activation")

    names = set(reference.ACTIVATIONS)
    assert act in names
    assert set(activation.ACTIVATION_FUNCTIONS) == names == set(models._ACTIVATIONS)
    assert set(kernels.ACT_CODES) == names
    x = np.linspace(-3.0, 3.0, 13).reshape(1, 13)
    mlp = nn.MLP([13, 13, 13], activation=act)
    [layer] = [sub for name, sub in mlp.named_children() if name == "act0"]
    want = reference.bias_act_forward(x, np.zeros(13), act, np)[0]
    np.testing.assert_allclose(layer(to_tensor(x)).numpy(), want, rtol=1e-12)
    np.testing.assert_allclose(activation.activation(to_tensor(x), act).numpy(), want,
                               rtol=1e-12)


def test_sublayers_are_every_descendant_as_paddle_gives_them():
    inner = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    model = nn.Sequential(("block", inner), ("head", nn.Linear(2, 1)))
    assert model.children() == [inner, model["head"]]
    assert model.sublayers() == [inner, inner[0], inner[1], model["head"]]
    assert model.sublayers(include_self=True)[0] is model

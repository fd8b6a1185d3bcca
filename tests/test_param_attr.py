"""Layer arguments as Paddle's: ``weight_attr``/``bias_attr`` (``False`` drops a bias) and
``name`` on every built-in layer, and ``fleetmpi.ParamAttr``: ``name``, ``initializer`` and
``trainable`` act; ``learning_rate``, ``regularizer`` and ``need_clip`` at other values than
their defaults are refused naming the field."""
import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi import ParamAttr, nn, optimizer, to_tensor
from fleetmpi.core import backend
from fleetmpi.nn import initializer
from comm_support import equal, host

# Each built-in layer with parameters: a builder taking the layer arguments, and an input.
LAYERS = {
    "Linear": (lambda **kw: nn.Linear(3, 4, **kw), lambda: np.ones((2, 3))),
    "Conv2D": (lambda **kw: nn.Conv2D(2, 3, 3, padding=1, **kw), lambda: np.ones((1, 2, 4, 4))),
    "BatchNorm": (lambda **kw: nn.BatchNorm(3, **kw), lambda: np.arange(6.0).reshape(2, 3)),
    "BatchNorm1D": (lambda **kw: nn.BatchNorm1D(3, **kw), lambda: np.arange(6.0).reshape(2, 3)),
    "BatchNorm2D": (lambda **kw: nn.BatchNorm2D(3, **kw),
                    lambda: np.arange(24.0).reshape(2, 3, 2, 2)),
    "LayerNorm": (lambda **kw: nn.LayerNorm(3, **kw), lambda: np.arange(6.0).reshape(2, 3)),
    "ColumnParallelLinear": (lambda **kw: nn.ColumnParallelLinear(3, 4, has_bias=True, **kw),
                             lambda: np.ones((2, 3))),
    "RowParallelLinear": (lambda **kw: nn.RowParallelLinear(3, 4, **kw), lambda: np.ones((2, 3))),
}
WITH_BIAS_ATTR = ("Linear", "Conv2D", "BatchNorm", "BatchNorm1D", "BatchNorm2D", "LayerNorm")
EMBEDDINGS = {"Embedding": nn.Embedding, "VocabParallelEmbedding": nn.VocabParallelEmbedding}


def test_paramattr_is_paddles_and_reachable_where_paddle_puts_it():
    assert fleet.ParamAttr is fleet.framework.ParamAttr
    attr = ParamAttr()
    assert (attr.name, attr.initializer, attr.learning_rate, attr.regularizer, attr.trainable,
            attr.need_clip) == (None, None, 1.0, None, True, True)


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_every_layer_takes_weight_attr_and_name_and_its_initializer_acts(kind):
    build, _ = LAYERS[kind]
    layer = build(weight_attr=ParamAttr(initializer=initializer.Constant(0.25)), name="mine")
    assert layer.full_name() == "mine"
    np.testing.assert_array_equal(layer.weight.numpy(), np.full(layer.weight.shape, 0.25))
    shorthand = build(weight_attr=initializer.Constant(0.5))   # Paddle takes an initializer too
    np.testing.assert_array_equal(shorthand.weight.numpy(), np.full(layer.weight.shape, 0.5))


@pytest.mark.parametrize("kind", sorted(EMBEDDINGS))
def test_embeddings_take_weight_attr_and_name(kind):
    layer = EMBEDDINGS[kind](6, 2, weight_attr=ParamAttr(initializer=initializer.Constant(2.0)),
                             name="table")
    assert layer.full_name() == "table"
    np.testing.assert_array_equal(layer.weight.numpy(), np.full((6, 2), 2.0))


@pytest.mark.parametrize("kind", WITH_BIAS_ATTR)
def test_bias_attr_initializes_the_bias(kind):
    build, _ = LAYERS[kind]
    layer = build(bias_attr=ParamAttr(initializer=initializer.Constant(-1.0)))
    np.testing.assert_array_equal(layer.bias.numpy(), np.full(layer.bias.shape, -1.0))


@pytest.mark.parametrize("kind", ["Linear", "Conv2D"])
def test_bias_attr_false_drops_the_bias(kind):
    build, make_input = LAYERS[kind]
    layer = build(bias_attr=False)
    assert layer.bias is None and len(layer.parameters()) == 1
    layer(to_tensor(make_input()))


@pytest.mark.parametrize("kind", ["BatchNorm1D", "LayerNorm"])
@pytest.mark.parametrize("which", ["weight_attr", "bias_attr"])
def test_a_norm_layers_false_attr_is_a_constant_left_untrained(kind, which):
    build, make_input = LAYERS[kind]
    layer = build(**{which: False})
    frozen = layer.weight if which == "weight_attr" else layer.bias
    before = frozen.numpy().copy()
    opt = optimizer.AdamW(learning_rate=0.1, parameters=layer.parameters(), weight_decay=0.1)
    layer(to_tensor(make_input())).sum().backward()
    opt.step()
    np.testing.assert_array_equal(frozen.numpy(), before)
    assert not opt.owns(frozen)


def test_trainable_false_gets_no_gradient_and_no_update_even_under_weight_decay():
    backend.manual_seed(0)
    model = nn.Sequential(("a", nn.Linear(3, 4, weight_attr=ParamAttr(trainable=False))),
                          ("b", nn.Linear(4, 2)))
    frozen = model.a.weight
    assert frozen.stop_gradient and not frozen.trainable
    before = {name: p.numpy().copy() for name, p in model.named_parameters()}
    opt = optimizer.AdamW(learning_rate=0.1, parameters=model.parameters(), weight_decay=0.5)
    model(to_tensor(np.ones((2, 3)))).sum().backward()
    opt.step()
    after = dict(model.named_parameters())
    np.testing.assert_array_equal(after["a.weight"].numpy(), before["a.weight"])
    assert np.all(host(frozen.grad) == 0)
    for name in ("a.bias", "b.weight", "b.bias"):
        assert not np.array_equal(after[name].numpy(), before[name]), name
    with pytest.raises(ValueError, match="none trainable"):
        optimizer.SGD(learning_rate=0.1, parameters=[frozen])


def test_paramattr_name_names_the_parameter():
    model = nn.Sequential(("fc", nn.Linear(3, 4, weight_attr=ParamAttr(name="fc_w"),
                                           bias_attr="fc_b")))
    names = [p.name for p in model.parameters()]
    assert names == ["fc_w", "fc_b"]
    assert list(model.state_dict()) == ["fc.weight", "fc.bias"]


@pytest.mark.parametrize("field, value, reason", [
    ("learning_rate", 0.5, "one learning rate"),
    ("regularizer", "L2Decay(1e-4)", "weight_decay"),
    ("need_clip", False, "grad_clip clips every gradient"),
    ("trainable", "no", "True or False"),
    ("initializer", 3, "an initializer"),
    ("name", 7, "a string or None"),
])
def test_paramattr_refuses_what_does_not_act_naming_the_field(field, value, reason):
    with pytest.raises(ValueError, match=f"ParamAttr {field}.*{reason}"):
        ParamAttr(**{field: value})


def test_bad_layer_arguments_are_refused_naming_them():
    with pytest.raises(ValueError, match="weight_attr=False: the layer cannot do without"):
        nn.Linear(3, 4, weight_attr=False)
    with pytest.raises(ValueError, match="bias_attr must be a fleetmpi.ParamAttr.*not 3"):
        nn.Conv2D(1, 1, 1, bias_attr=3)
    with pytest.raises(ValueError, match="weight_attr=False"):
        nn.ColumnParallelLinear(3, 4, weight_attr=False)
    with pytest.raises(ValueError, match="padding_idx=0: only None"):
        nn.Embedding(4, 2, padding_idx=0)
    with pytest.raises(ValueError, match="a layer's name must be a string or None, not 5"):
        nn.LayerNorm(3, name=5)


@pytest.mark.mpi(min_size=2)
def test_a_split_weight_is_the_slice_of_the_serial_layers_attr_initializer():
    """At every rank, a ColumnParallelLinear and a VocabParallelEmbedding with an initializer
    in their weight_attr hold their slice of the serial layer built with the same attr."""
    fleet.init(is_collective=True)
    size, rank = fleet.worker_num(), fleet.worker_index()
    from fleetmpi.comm import get_communicator

    comm = get_communicator()
    attr = ParamAttr(initializer=initializer.Normal(0.0, 3.0))
    backend.manual_seed(4)
    serial = nn.Linear(3, 2 * size, weight_attr=attr).weight.numpy()
    backend.manual_seed(4)
    part = nn.ColumnParallelLinear(3, 2 * size, weight_attr=attr, mp_group=comm).weight.numpy()
    equal(part, serial[:, 2 * rank:2 * (rank + 1)])
    backend.manual_seed(5)
    serial = nn.Embedding(2 * size, 3, weight_attr=attr).weight.numpy()
    backend.manual_seed(5)
    part = nn.VocabParallelEmbedding(2 * size, 3, weight_attr=attr, mp_group=comm).weight
    equal(part.numpy(), serial[2 * rank:2 * (rank + 1)])

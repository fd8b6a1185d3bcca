"""float64 data into a float32 model: cast to the parameters' dtype with a warning, not a
silent promotion of every operation to float64."""
import warnings

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi import nn


def model():
    fleet.seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_float64_array_is_cast_with_one_warning_per_call_site():
    net = model()
    x = np.random.default_rng(0).standard_normal((5, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        outputs = [net(x) for _ in range(3)]
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert "Sequential got float64 input while its parameters are float32" in messages[0]
    assert caught[0].filename == __file__, "the warning points at the caller's line"
    expected = net(x.astype(np.float32))
    for out in outputs:
        assert out.dtype == np.float32
        np.testing.assert_array_equal(out.numpy(), expected.numpy())
    outputs[0].sum().backward()
    assert all(p.grad.dtype == np.float32 for p in net.parameters())


def test_float64_tensor_keeps_its_gradient_path():
    net = model()
    x = fleet.to_tensor(np.random.default_rng(1).standard_normal((3, 4)), stop_gradient=False)
    with pytest.warns(UserWarning, match="cast to float32"):
        out = net(x)
    out.sum().backward()
    assert x.grad is not None and x.grad.dtype == np.float64
    reference = fleet.to_tensor(x.numpy().astype(np.float32), stop_gradient=False)
    net(reference).sum().backward()
    np.testing.assert_allclose(x.grad, reference.grad, rtol=1e-6)


@pytest.mark.usefixtures("float64_layers")
def test_float64_model_takes_float64_input_as_it_is():
    net = nn.Linear(4, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = net(np.ones((2, 4)))
    assert out.dtype == np.float64


def test_layers_without_parameters_and_integer_inputs_are_untouched():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert nn.ReLU()(np.ones((2, 2))).dtype == np.float64
        embedding = nn.Embedding(10, 3)
        assert embedding(np.array([[1, 2]], dtype=np.int64)).dtype == np.float32

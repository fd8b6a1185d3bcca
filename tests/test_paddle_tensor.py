"""Paddle's Tensor surface (grad as a Tensor, shape as a list, clone, register_hook, item
assignment) and ``paddle.autograd.PyLayer``, against NumPy and finite differences."""
import numpy as np
import pytest

import fleetmpi as paddle
from fleetmpi import nn
from fleetmpi.autograd import PyLayer
from fleetmpi.nn.gradcheck import check_gradients


def leaf(array):
    return paddle.to_tensor(np.asarray(array, dtype=np.float64), stop_gradient=False)


def test_grad_is_a_tensor_over_the_gradient_and_shape_a_list():
    x = leaf([[1.0, 2.0, 3.0]])
    assert x.shape == [1, 3] and isinstance(x.shape, list)
    assert x.grad is None
    (x * x).sum().backward()
    assert isinstance(x.grad, paddle.Tensor) and x.grad.shape == [1, 3]
    np.testing.assert_array_equal(x.grad.numpy(), [[2.0, 4.0, 6.0]])
    np.testing.assert_array_equal(np.asarray(x.grad * 2), [[4.0, 8.0, 12.0]])
    x.grad[...] = 0  # writes the gradient itself
    np.testing.assert_array_equal(x.gradient(), 0)
    assert x.numpy().tolist() == [[1.0, 2.0, 3.0]] and x[0, 1].item() == 2.0
    assert x.astype("float32").dtype == np.float32


def test_a_parameters_grad_is_a_view_of_the_flat_gradient_buffer():
    layer = nn.Linear(3, 2)
    model = nn.Sequential(layer)
    model(np.ones((4, 3), np.float32)).sum().backward()
    buffer = model.flat_buffers()[0]
    layer.weight.grad[...] = 7.0
    assert (buffer.grad[layer.weight.offset:layer.weight.offset + 6] == 7.0).all()
    layer.weight.grad += 1.0  # the sum is written back into the buffer
    layer.weight.grad *= 2.0
    assert (buffer.grad[layer.weight.offset:layer.weight.offset + 6] == 16.0).all()
    with pytest.raises(ValueError, match=r"grad = a value of shape \(2,\): the gradient "
                                         r"storage has shape \(3, 2\)"):
        layer.weight.grad = np.zeros(2)
    layer.weight.grad = None
    assert not layer.weight.grad.numpy().any()


def test_clone_copies_the_values_and_passes_the_gradient_back():
    x = leaf([1.0, -2.0])
    y = x.clone()
    y.data[0] = 5.0
    assert x.numpy()[0] == 1.0
    (y * 3).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [3.0, 3.0])
    z = x.detach()
    assert z.stop_gradient and z.data is x.data


def test_hooks_see_the_whole_gradient_and_may_replace_it():
    x = leaf([1.0, 2.0])
    seen = []
    x.register_hook(lambda g: seen.append(g.numpy().copy()))
    doubled = x.register_hook(lambda g: g * 2)
    (x * x + x * 3).sum().backward()  # two uses: the hooks see their sum, once
    assert len(seen) == 1
    np.testing.assert_array_equal(seen[0], [5.0, 7.0])
    np.testing.assert_array_equal(x.grad.numpy(), [10.0, 14.0])
    assert doubled.remove() and not doubled.remove()
    x.clear_gradient()
    (x * 3).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [3.0, 3.0])


def test_a_hook_on_an_intermediate_tensor_changes_what_flows_below():
    x = leaf([1.0, 2.0])
    h = x * x
    h.register_hook(lambda g: g * 10)
    (h * 1.5).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), 10 * 1.5 * 2 * np.array([1.0, 2.0]))
    with pytest.raises(RuntimeError, match="does not require a gradient"):
        paddle.to_tensor([1.0]).register_hook(print)


def test_item_assignment_writes_in_place_and_is_refused_on_a_recorded_leaf():
    x = paddle.to_tensor(np.zeros((2, 3)))
    x[0, paddle.to_tensor(np.array([0, 2]))] = 1.0
    x[1] = paddle.to_tensor(np.arange(3.0))
    np.testing.assert_array_equal(x.numpy(), [[1, 0, 1], [0, 1, 2]])
    with pytest.raises(RuntimeError, match=r"requires a gradient.*no_grad\(\)"):
        leaf([1.0])[0] = 2.0
    w = leaf([1.0])
    with paddle.no_grad():
        w[0] = 2.0
    assert w.item() == 2.0


class Cube(PyLayer):
    @staticmethod
    def forward(ctx, x, scale=1.0):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x * x * x * scale

    @staticmethod
    def backward(ctx, dy):
        x, = ctx.saved_tensor()
        return dy * 3 * x * x * ctx.scale


class SplitSum(PyLayer):
    """Two inputs, two outputs, the second one unused by the loss."""

    @staticmethod
    def forward(ctx, a, b):
        return a + b, a * b

    @staticmethod
    def backward(ctx, dsum, dprod):
        ctx.grads = (dsum.numpy(), dprod.numpy())
        return dsum, dsum * 2


def test_py_layer_forward_and_backward_against_numpy():
    values = np.array([0.5, -1.0, 2.0])
    x = leaf(values)
    y = Cube.apply(x, scale=2.0)
    assert isinstance(y, paddle.Tensor) and not y.stop_gradient
    np.testing.assert_allclose(y.numpy(), 2 * values ** 3)
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 6 * values ** 2)
    errors = check_gradients(lambda t: Cube.apply(t, scale=0.5), values)
    assert max(errors.values()) < 1e-7, errors


def test_py_layer_with_two_outputs_gets_zeros_for_the_unused_one():
    a, b = leaf([1.0, 2.0]), leaf([3.0, 4.0])
    total, product = SplitSum.apply(a, b)
    assert not product.stop_gradient
    (total * 2).sum().backward()
    np.testing.assert_array_equal(a.grad.numpy(), [2.0, 2.0])
    np.testing.assert_array_equal(b.grad.numpy(), [4.0, 4.0])
    with paddle.no_grad():
        assert Cube.apply(leaf([1.0])).stop_gradient


def test_py_layer_refusals_name_what_is_wrong():
    class Wrong(PyLayer):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, dy):
            return dy, dy

    with pytest.raises(ValueError, match="returned 2 gradient.*took 1 Tensor"):
        Wrong.apply(leaf([1.0])).sum().backward()

    class NotATensor(PyLayer):
        @staticmethod
        def forward(ctx, x):
            return x.numpy()

    with pytest.raises(TypeError, match="returned a ndarray as output 0"):
        NotATensor.apply(leaf([1.0]))

"""The operations of define-by-run autograd: every ``fleetmpi.nn.functional`` op and every Tensor
operation against central differences in float64, broadcasting, a tensor used twice, unused
branches, what carries no gradient (comparisons, ``no_grad``, ``detach``), the errors, the fused
kernels against the unfused composition, and a user's own ``Function`` in both styles."""
import numpy as np
import pytest

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from fleetmpi import autograd, to_tensor
from fleetmpi.core import backend
from fleetmpi.autograd import Function, autocast, enable_grad, no_grad, run_backward
from fleetmpi.nn.gradcheck import check_gradients

TOLERANCE = 1e-6


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def positive(*shape, seed=0):
    return np.abs(rand(*shape, seed=seed)) + 0.5


def assert_gradients(function, *inputs):
    """``function``'s gradients of every floating input match central differences."""
    errors = check_gradients(function, *inputs)
    floating = [i for i, x in enumerate(inputs) if np.asarray(x).dtype.kind == "f"]
    assert set(errors) == {f"input{i}" for i in floating}
    assert max(errors.values()) < TOLERANCE, errors


def leaf(array):
    return to_tensor(array, stop_gradient=False)


def host(array):
    """A backend array or a Tensor (a gradient) as a host NumPy array, for comparisons."""
    return backend.to_numpy(autograd.as_array(array))


def device(array):
    """A host array on the backend's device, as a layer's buffers are."""
    return backend.asarray(array)


def grads_of(function, *arrays, dy_seed=9):
    """``(output, [gradient of each input])`` of ``function`` on leaves made of ``arrays``,
    backward from a fixed random output gradient."""
    leaves = [leaf(a) for a in arrays]
    out = function(*leaves)
    out.backward(rand(*out.shape, seed=dy_seed) if out.size > 1 else None)
    return out.numpy(), [host(t.grad) for t in leaves]


# -- nn.functional against finite differences ------------------------------------------------

IDS = np.array([[0, 5, 2], [2, 2, 1]])
LABELS = np.array([0, 4, 2, 2])


def _bn_train(act=None):
    def function(x, weight, bias):
        channels = x.shape[1]
        return F.batch_norm(x, device(np.zeros(channels)), device(np.ones(channels)), weight,
                            bias, training=True, act=act)
    return function


def _bn_eval(act=None):
    mean, var = rand(3, seed=7), positive(3, seed=8)

    def function(x, weight, bias):
        return F.batch_norm(x, device(mean.astype(x.dtype)), device(var.astype(x.dtype)),
                            weight, bias, training=False, act=act)
    return function


FUNCTIONAL = {
    "linear": (F.linear, (rand(5, 4), rand(4, 3, seed=1), rand(3, seed=2))),
    "linear_no_bias": (F.linear, (rand(5, 4), rand(4, 3, seed=1))),
    "linear_3d_input": (F.linear, (rand(2, 5, 4), rand(4, 3, seed=1), rand(3, seed=2))),
    "linear_activation_relu": (lambda x, w, b: F.linear_activation(x, w, b, "relu"),
                               (rand(5, 4), rand(4, 3, seed=1), rand(3, seed=2))),
    "linear_activation_tanh": (lambda x, w, b: F.linear_activation(x, w, b, "tanh"),
                               (rand(5, 4), rand(4, 3, seed=1), rand(3, seed=2))),
    "linear_activation_gelu": (lambda x, w, b: F.linear_activation(x, w, b, "gelu"),
                               (rand(5, 4), rand(4, 3, seed=1), rand(3, seed=2))),
    "relu": (F.relu, (rand(4, 5),)),
    "gelu": (F.gelu, (rand(4, 5),)),
    "tanh": (F.tanh, (rand(4, 5),)),
    "sigmoid": (F.sigmoid, (rand(4, 5),)),
    "activation_by_name": (lambda x: F.activation(x, "gelu"), (rand(3, 4),)),
    "softmax": (F.softmax, (rand(4, 5),)),
    "softmax_axis0": (lambda x: F.softmax(x, axis=0), (rand(4, 5),)),
    "log_softmax": (F.log_softmax, (rand(4, 5),)),
    "log_softmax_3d_axis1": (lambda x: F.log_softmax(x, axis=1), (rand(2, 4, 3),)),
    "cross_entropy_labels_n": (lambda x: F.cross_entropy(x, LABELS), (rand(4, 5),)),
    "cross_entropy_labels_n1": (lambda x: F.cross_entropy(x, LABELS[:, None]), (rand(4, 5),)),
    "cross_entropy_sum": (lambda x: F.cross_entropy(x, LABELS, reduction="sum"),
                          (rand(4, 5),)),
    "cross_entropy_none": (lambda x: F.cross_entropy(x, LABELS, reduction="none"),
                           (rand(4, 5),)),
    "cross_entropy_3d": (lambda x: F.cross_entropy(x, LABELS.reshape(2, 2)), (rand(2, 2, 5),)),
    "cross_entropy_3d_labels_1": (lambda x: F.cross_entropy(x, LABELS.reshape(2, 2, 1)),
                                  (rand(2, 2, 5),)),
    "mse_loss": (F.mse_loss, (rand(3, 4), rand(3, 4, seed=1))),
    "mse_loss_sum": (lambda x, y: F.mse_loss(x, y, reduction="sum"),
                     (rand(3, 4), rand(3, 4, seed=1))),
    "mse_loss_none": (lambda x, y: F.mse_loss(x, y, reduction="none"),
                      (rand(3, 4), rand(3, 4, seed=1))),
    "dropout": (lambda x: F.dropout(x, 0.4), (rand(6, 5),)),
    "dropout_add": (lambda x, r: F.dropout_add(x, r, 0.4), (rand(6, 5), rand(6, 5, seed=1))),
    "embedding": (lambda w: F.embedding(IDS, w), (rand(6, 3),)),
    "embedding_ids_as_input": (F.embedding, (IDS, rand(6, 3))),
    "conv2d": (lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1),
               (rand(2, 2, 5, 5), rand(3, 2, 3, 3, seed=1), rand(3, seed=2))),
    "conv2d_no_bias_rect": (lambda x, w: F.conv2d(x, w, stride=(2, 1)),
                            (rand(2, 2, 4, 5), rand(2, 2, 1, 3, seed=1))),
    "conv2d_relu": (lambda x, w, b: F.conv2d(x, w, b, padding=1, act="relu"),
                    (rand(2, 2, 4, 4), rand(3, 2, 3, 3, seed=1), rand(3, seed=2))),
    "conv2d_gelu": (lambda x, w, b: F.conv2d(x, w, b, act="gelu"),
                    (rand(2, 2, 4, 4), rand(3, 2, 3, 3, seed=1), rand(3, seed=2))),
    "max_pool2d": (lambda x: F.max_pool2d(x, 3, stride=2, padding=1), (rand(2, 2, 5, 5),)),
    "avg_pool2d": (lambda x: F.avg_pool2d(x, 2), (rand(2, 2, 4, 4),)),
    "avg_pool2d_padded": (lambda x: F.avg_pool2d(x, 3, stride=2, padding=1),
                          (rand(2, 2, 5, 5),)),
    "adaptive_avg_pool2d_global": (lambda x: F.adaptive_avg_pool2d(x, 1), (rand(2, 3, 3, 4),)),
    "adaptive_avg_pool2d_2x2": (lambda x: F.adaptive_avg_pool2d(x, (2, 2)),
                                (rand(2, 3, 4, 6),)),
    "global_avg_pool": (F.global_avg_pool, (rand(2, 3, 2, 3),)),
    "batch_norm_train_2d": (_bn_train(), (rand(6, 3), rand(3, seed=1), rand(3, seed=2))),
    "batch_norm_train_4d": (_bn_train(), (rand(3, 3, 2, 2), rand(3, seed=1), rand(3, seed=2))),
    "batch_norm_train_relu": (_bn_train("relu"), (rand(3, 3, 2, 2), rand(3, seed=1),
                                                  rand(3, seed=2))),
    "batch_norm_eval": (_bn_eval(), (rand(3, 3, 2, 2), rand(3, seed=1), rand(3, seed=2))),
    "batch_norm_eval_relu": (_bn_eval("relu"), (rand(4, 3), rand(3, seed=1), rand(3, seed=2))),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, 4, w, b),
                   (rand(3, 4), rand(4, seed=1), rand(4, seed=2))),
    "layer_norm_two_axes": (lambda x, w, b: F.layer_norm(x, (3, 4), w, b),
                            (rand(2, 3, 4), rand(3, 4, seed=1), rand(3, 4, seed=2))),
}


@pytest.mark.parametrize("name", sorted(FUNCTIONAL))
def test_functional_gradients_match_finite_differences(name):
    function, inputs = FUNCTIONAL[name]
    assert_gradients(function, *inputs)


def test_functional_ops_take_plain_arrays_and_return_tensors():
    x = rand(2, 2, 4, 4)
    for out in (F.relu(x), F.softmax(x), F.max_pool2d(x, 2), F.conv2d(x, rand(1, 2, 1, 1)),
                F.linear(x, rand(4, 3)), F.cross_entropy(rand(3, 2), np.array([0, 1, 1]))):
        assert isinstance(out, fleet.Tensor) and out.stop_gradient and out.is_leaf
    np.testing.assert_array_equal(F.relu(x).numpy(), np.maximum(x, 0))


def test_cross_entropy_values_and_label_shapes_agree():
    logits = rand(4, 5)
    shifted = logits - logits.max(axis=1, keepdims=True)
    picked = shifted[np.arange(4), LABELS] - np.log(np.exp(shifted).sum(axis=1))
    assert abs(F.cross_entropy(logits, LABELS).item() + picked.mean()) < 1e-14
    assert F.cross_entropy(logits, LABELS[:, None]).item() == F.cross_entropy(logits,
                                                                             LABELS).item()
    np.testing.assert_allclose(F.cross_entropy(logits, LABELS, reduction="none").numpy(),
                               -picked, rtol=1e-14)
    three_d = logits.reshape(2, 2, 5)
    assert F.cross_entropy(three_d, LABELS.reshape(2, 2)).item() == \
        F.cross_entropy(logits, LABELS).item()
    with pytest.raises(ValueError, match=r"labels of shape \(4,\) or \(4, 1\)"):
        F.cross_entropy(logits, LABELS[:3])
    with pytest.raises(ValueError, match="reduction 'avg' is not allowed"):
        F.cross_entropy(logits, LABELS, reduction="avg")


def test_dropout_masks_follow_the_seed_and_scale_what_they_keep():
    x = np.ones((100, 40))
    backend.manual_seed(3)
    first = F.dropout(x, 0.25).numpy()
    backend.manual_seed(3)
    second = F.dropout(x, 0.25).numpy()
    np.testing.assert_array_equal(first, second)
    assert set(np.unique(first)) == {0.0, 1 / 0.75}
    assert 0.2 < (first == 0).mean() < 0.3
    backend.manual_seed(4)
    assert not np.array_equal(F.dropout(x, 0.25).numpy(), first)
    tensor = leaf(x)
    assert F.dropout(tensor, 0.25, training=False) is tensor
    assert F.dropout(tensor, 0.0) is tensor
    out = F.dropout(tensor, 0.5)
    out.backward(np.ones(x.shape))
    np.testing.assert_array_equal(host(tensor.grad), out.numpy())


def test_batch_norm_moves_running_statistics_only_in_training():
    x = rand(8, 3) * 2 + 1
    mean, var = device(np.zeros(3)), device(np.ones(3))
    F.batch_norm(x, mean, var, np.ones(3), np.zeros(3), training=True, momentum=0.75)
    np.testing.assert_allclose(host(mean), 0.25 * x.mean(axis=0), rtol=1e-14)
    np.testing.assert_allclose(host(var), 0.75 + 0.25 * x.var(axis=0), rtol=1e-14)
    before = host(mean).copy(), host(var).copy()
    y = F.batch_norm(x, mean, var, np.ones(3), np.zeros(3), training=False)
    np.testing.assert_array_equal(host(mean), before[0])
    np.testing.assert_array_equal(host(var), before[1])
    np.testing.assert_allclose(y.numpy(), (x - before[0]) / np.sqrt(before[1] + 1e-5),
                               rtol=1e-14)


def test_layer_norm_and_pools_name_bad_arguments():
    with pytest.raises(ValueError, match=r"layer_norm over \(5,\) got an input of shape"):
        F.layer_norm(rand(3, 4), 5, rand(5), rand(5))
    with pytest.raises(ValueError, match="needs weight and bias"):
        F.layer_norm(rand(3, 4), 4)
    with pytest.raises(ValueError, match="adaptive_avg_pool2d to \\(3, 3\\) needs it to divide"):
        F.adaptive_avg_pool2d(rand(1, 1, 4, 4), 3)
    with pytest.raises(ValueError, match="max_pool2d expects a 4-d"):
        F.max_pool2d(rand(2, 3), 2)
    with pytest.raises(ValueError, match="gelu\\(approximate=False\\)"):
        F.gelu(rand(2), approximate=False)


# -- Tensor operations against finite differences --------------------------------------------

OPERATIONS = {
    "add": (lambda a, b: a + b, (rand(3, 4), rand(3, 4, seed=1))),
    "sub": (lambda a, b: a - b, (rand(3, 4), rand(3, 4, seed=1))),
    "mul": (lambda a, b: a * b, (rand(3, 4), rand(3, 4, seed=1))),
    "div": (lambda a, b: a / b, (rand(3, 4), positive(3, 4, seed=1))),
    "pow_integer": (lambda a: a ** 3, (rand(3, 4),)),
    "pow_fraction": (lambda a: a ** 1.5, (positive(3, 4),)),
    "pow_negative": (lambda a: a ** -2, (positive(3, 4),)),
    "matmul": (lambda a, b: a @ b, (rand(3, 4), rand(4, 2, seed=1))),
    "matmul_batched": (lambda a, b: a @ b, (rand(2, 3, 4), rand(2, 4, 2, seed=1))),
    "matmul_batched_by_matrix": (lambda a, b: a @ b, (rand(2, 3, 4), rand(4, 2, seed=1))),
    "matmul_function_transposed": (
        lambda a, b: fleet.matmul(a, b, transpose_x=True, transpose_y=True),
        (rand(4, 3), rand(2, 4, seed=1))),
    "neg": (lambda a: -a, (rand(3, 4),)),
    "scalar_arithmetic": (lambda a: (2.0 - a) * 3.0 / 4.0 + 1.0 - (1.0 / (a * a + 1.0)),
                          (rand(3, 4),)),
    "array_on_the_left": (lambda a: rand(3, 4, seed=5) * a + rand(4, seed=6) - a,
                          (rand(3, 4),)),
    "sum_all": (lambda a: a.sum(), (rand(3, 4),)),
    "sum_axis": (lambda a: a.sum(axis=1), (rand(3, 4, 2),)),
    "sum_axes_keepdim": (lambda a: a.sum(axis=(0, 2), keepdim=True), (rand(3, 4, 2),)),
    "sum_negative_axis_keepdims": (lambda a: autograd.sum(a, axis=-1, keepdims=True),
                                   (rand(3, 4),)),
    "mean_all": (lambda a: a.mean(), (rand(3, 4),)),
    "mean_axis": (lambda a: a.mean(axis=0), (rand(3, 4),)),
    "mean_dim_keepdim": (lambda a: a.mean(dim=(1, 2), keepdim=True), (rand(2, 3, 4),)),
    "max_all": (lambda a: a.max(), (rand(3, 4),)),
    "max_axis": (lambda a: a.max(axis=1), (rand(3, 4),)),
    "max_axis_keepdim": (lambda a: a.max(axis=-2, keepdim=True), (rand(2, 3, 4),)),
    "exp": (lambda a: a.exp(), (rand(3, 4),)),
    "log": (lambda a: a.log(), (positive(3, 4),)),
    "sqrt": (lambda a: a.sqrt(), (positive(3, 4),)),
    "tanh": (lambda a: a.tanh(), (rand(3, 4),)),
    "sigmoid": (lambda a: a.sigmoid(), (rand(3, 4),)),
    "module_functions": (lambda a: fleet.concat([a.exp() * 0.1, a]).sum(axis=0),
                         (rand(3, 4),)),
    "reshape_varargs": (lambda a: a.reshape(4, -1) * rand(4, 6, seed=3), (rand(2, 3, 4),)),
    "reshape_list": (lambda a: a.reshape([6, 4]) * rand(6, 4, seed=3), (rand(2, 3, 4),)),
    "reshape_function": (lambda a: fleet.reshape(a, (3, 8)) * rand(3, 8, seed=3),
                         (rand(2, 3, 4),)),
    "transpose_permutation": (lambda a: a.transpose([2, 0, 1]) * rand(4, 2, 3, seed=3),
                              (rand(2, 3, 4),)),
    "transpose_swap_two_axes": (lambda a: a.transpose(0, 2) * rand(4, 3, 2, seed=3),
                                (rand(2, 3, 4),)),
    "transpose_function": (lambda a: fleet.transpose(a, [1, 0, 2]) * rand(3, 2, 4, seed=3),
                           (rand(2, 3, 4),)),
    "transpose_T": (lambda a: a.T * rand(4, 3, seed=3), (rand(3, 4),)),
    "index_integer": (lambda a: a[1], (rand(3, 4),)),
    "slice": (lambda a: a[1:, ::2], (rand(3, 5),)),
    "slice_negative_step_and_none": (lambda a: a[::-1, None, 1:3], (rand(3, 4),)),
    "index_repeated_rows": (lambda a: a[np.array([0, 2, 0, 0])], (rand(3, 4),)),
    "index_repeated_pairs": (lambda a: a[[1, 1, 2], [0, 0, 3]], (rand(3, 4),)),
    "index_mixed_advanced_and_slice": (lambda a: a[:, [3, 0, 3]], (rand(2, 4),)),
    "index_boolean_mask": (lambda a: a[rand(3, 4, seed=4) > 0], (rand(3, 4),)),
    "index_with_a_tensor": (lambda a: a[to_tensor(np.array([2, 2, 1]))], (rand(3, 4),)),
    "concat": (lambda a, b: fleet.concat([a, b, a], axis=1), (rand(2, 3), rand(2, 1, seed=1))),
    "stack": (lambda a, b: fleet.stack([a, b], axis=1), (rand(2, 3), rand(2, 3, seed=1))),
    "split_equal": (lambda a: fleet.split(a, 2, axis=1)[1] * 3.0, (rand(3, 4),)),
    "split_sections_all_used": (
        lambda a: sum(piece.sum(axis=0) * (i + 1.0)
                      for i, piece in enumerate(fleet.split(a, [1, 3], axis=0))),
        (rand(4, 3),)),
    "split_method_middle_piece": (lambda a: a.split([1, 2, 1], axis=0)[1], (rand(4, 3),)),
    "cast_round_trip": (lambda a: (a.astype("float32") * 2.0).astype("float64"),
                        (rand(3, 4),)),
}


@pytest.mark.parametrize("name", sorted(OPERATIONS))
def test_tensor_operation_gradients_match_finite_differences(name):
    function, inputs = OPERATIONS[name]
    if name == "cast_round_trip":
        # through float32 the central differences are exact only to float32's precision
        errors = check_gradients(function, *inputs, eps=1e-2)
        assert max(errors.values()) < 1e-5, errors
        return
    assert_gradients(function, *inputs)


def test_max_shares_the_gradient_between_tied_elements():
    x = leaf(np.array([[1.0, 3.0, 3.0], [2.0, 0.0, -1.0]]))
    x.max(axis=1).sum().backward()
    np.testing.assert_array_equal(host(x.grad), [[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])


BROADCASTS = {
    "row_plus_column": (lambda a, b: a + b, (3, 1), (1, 4)),
    "matrix_times_vector": (lambda a, b: a * b, (2, 3, 4), (4,)),
    "divide_by_leading_ones": (lambda a, b: a / b, (2, 3, 4), (1, 3, 1)),
    "subtract_scalar_tensor": (lambda a, b: a - b, (3, 4), ()),
    "matmul_leading_axes": (lambda a, b: a @ b, (2, 1, 3, 4), (5, 4, 2)),
}


@pytest.mark.parametrize("name", sorted(BROADCASTS))
def test_broadcasting_sums_each_gradient_back_to_its_input(name):
    function, shape_a, shape_b = BROADCASTS[name]
    a = rand(*shape_a)
    b = positive(*shape_b, seed=1) if name.startswith("divide") else rand(*shape_b, seed=1)
    out, (grad_a, grad_b) = grads_of(function, a, b)
    assert grad_a.shape == a.shape and grad_b.shape == b.shape
    assert_gradients(function, a, b)
    if name == "row_plus_column":
        dy = rand(*out.shape, seed=9)
        np.testing.assert_allclose(grad_a, dy.sum(axis=1, keepdims=True), rtol=1e-14)
        np.testing.assert_allclose(grad_b, dy.sum(axis=0, keepdims=True), rtol=1e-14)


# -- how gradients flow through the graph ----------------------------------------------------

def test_a_tensor_used_twice_gets_both_contributions():
    x, w = rand(5, 3), rand(3, 3, seed=1)

    def twice(x, w):
        return F.tanh(x @ w) @ w

    assert_gradients(twice, x, w)
    _, (_, both) = grads_of(twice, x, w)
    # each use alone, the other held fixed (a constant copy)
    _, (_, inner) = grads_of(lambda x, w: F.tanh(x @ w) @ to_tensor(w.data), x, w)
    _, (_, outer) = grads_of(lambda x, w: F.tanh(x @ to_tensor(w.data)) @ w, x, w)
    np.testing.assert_allclose(both, inner + outer, rtol=1e-13, atol=1e-15)


def test_gradients_accumulate_over_backwards_until_cleared():
    w = leaf(rand(3))
    (w * 2.0).sum().backward()
    (w * w).sum().backward()
    np.testing.assert_allclose(host(w.grad), 2.0 + 2 * w.numpy(), rtol=1e-15)
    w.clear_grad()
    np.testing.assert_array_equal(host(w.grad), 0)
    layer = fleet.nn.Linear(3, 2, dtype="float64")
    for _ in range(2):
        layer(rand(4, 3)).sum().backward()
    np.testing.assert_allclose(host(layer.bias.grad), [8.0, 8.0], rtol=1e-15)
    layer.clear_gradients()
    np.testing.assert_array_equal(host(layer.bias.grad), 0)


def test_an_unused_branch_gets_no_gradient_and_is_not_visited():
    x, used, unused = leaf(rand(3)), leaf(rand(3, seed=1)), leaf(rand(3, seed=2))
    visited = []

    class Spy(Function):
        def forward(self, a):
            return a * 1.0

        def backward(self, dy):
            visited.append("spy")
            return dy

    branch = Spy.apply(x * unused)
    loss = (x * used).sum()
    seen = []
    run_backward([loss], [None], on_leaf_ready=seen.append)
    assert visited == [] and unused.grad is None
    np.testing.assert_array_equal(host(used.grad), x.numpy())
    assert [id(t) for t in seen] == [id(x), id(used)]
    branch.sum().backward()
    assert visited == ["spy"]
    np.testing.assert_array_equal(host(unused.grad), x.numpy())


class Gated(fleet.nn.Layer):
    """``main(x)``, plus ``extra`` applied to it when ``use_extra``."""

    def __init__(self):
        super().__init__(dtype="float64")
        self.main = fleet.nn.Linear(3, 3, dtype="float64")
        self.extra = fleet.nn.Linear(3, 3, dtype="float64")

    def forward(self, x, use_extra):
        h = self.main(x)
        return h + self.extra(h) if use_extra else h


def test_parameters_of_a_branch_not_taken_keep_a_zero_gradient():
    model = Gated()
    model(rand(2, 3), use_extra=False).sum().backward()
    assert model.main.weight.grad.numpy().any()
    np.testing.assert_array_equal(host(model.extra.weight.grad), 0)
    np.testing.assert_array_equal(host(model.extra.bias.grad), 0)
    model.clear_gradients()
    model(rand(2, 3), use_extra=True).sum().backward()
    assert model.extra.weight.grad.numpy().any()


def test_comparisons_carry_no_gradient():
    x = leaf(rand(3, 4))
    for mask in (x > 0, x >= 0.1, x < 0, x <= 0.1, x == x, x != 0):
        assert mask.stop_gradient and mask.is_leaf and mask.dtype == np.bool_
    mask = x > 0
    np.testing.assert_array_equal(mask.numpy(), x.numpy() > 0)
    (x * mask).sum().backward()
    np.testing.assert_array_equal(host(x.grad), (x.numpy() > 0).astype(float))
    assert {x: 1}[x] == 1    # tensors stay hashable by identity


def test_a_mean_loss_over_an_empty_batch_is_an_error_that_names_it():
    from fleetmpi import nn, optimizer

    model = nn.MLP([4, 3], dtype="float64")
    empty_x, empty_y = np.zeros((0, 4)), np.zeros(0, dtype=np.int64)
    for loss in (lambda: F.cross_entropy(model(empty_x), empty_y),
                 lambda: F.mse_loss(model(empty_x), np.zeros((0, 3))),
                 lambda: optimizer.SGD(parameters=model.parameters()).minimize(
                     model, nn.CrossEntropyLoss(), empty_x, empty_y)):
        with pytest.raises(ValueError, match=r"reduction='mean' got an empty batch "
                                             r"\(input shape \(0, 3\)\)"):
            loss()
    F.cross_entropy(model(empty_x), empty_y, reduction="sum").backward()
    assert not host(model.parameters()[0].grad).any()


def test_numpy_scalars_act_as_python_numbers_and_keep_float32():
    """``x * np.float64(2)`` and ``x / np.sqrt(d)`` stay float32, as in PyTorch and Paddle
    (NumPy itself would promote to float64); a float64 array still promotes."""
    x = leaf(rand(3, 4).astype(np.float32))
    scaled = x * np.float64(2.0) / np.sqrt(4.0) + np.float32(1) - np.int64(1)
    flipped = np.float64(3.0) * x - np.float64(1.0)
    for y in (scaled, flipped):
        assert y.dtype == np.float32
    (scaled.sum() + flipped.sum()).backward()
    assert x.grad.dtype == np.float32
    np.testing.assert_allclose(host(x.grad), 4.0)
    assert (x + np.ones((3, 4))).dtype == np.float64


def test_no_grad_records_nothing_and_enable_grad_records_inside_it():
    x = leaf(rand(3))
    with no_grad():
        y = x * 2.0 + 1.0
        with enable_grad():
            z = x * 3.0
        inner = F.relu(x)
    assert y.stop_gradient and y.is_leaf and inner.stop_gradient
    assert not z.stop_gradient and not z.is_leaf
    np.testing.assert_array_equal(y.numpy(), x.numpy() * 2 + 1)

    @no_grad()
    def evaluate(t):
        return (t * t).sum()

    assert evaluate(x).stop_gradient and fleet.is_grad_enabled()
    z.sum().backward()
    np.testing.assert_array_equal(host(x.grad), np.full(3, 3.0))


def test_detach_cuts_the_graph_and_shares_the_values():
    x = leaf(rand(3))
    y = x * 2.0
    d = y.detach()
    assert d.stop_gradient and d.is_leaf and d.data is y.data
    (d * x).sum().backward()
    np.testing.assert_array_equal(host(x.grad), d.numpy())   # no path through d


def test_a_leaf_backward_and_an_explicit_root_gradient():
    x = leaf(rand(2, 3))
    x.backward(np.full((2, 3), 2.0))
    np.testing.assert_array_equal(host(x.grad), 2.0)
    y = leaf(rand(2, 3))
    (y * 3.0).backward(to_tensor(np.ones((2, 3))))
    np.testing.assert_array_equal(host(y.grad), 3.0)
    z = leaf(np.array([2.0]))
    (z * z).backward()     # a one-element tensor has the implied gradient 1
    np.testing.assert_array_equal(host(z.grad), [4.0])


# -- errors ---------------------------------------------------------------------------------

def test_backward_twice_through_a_freed_graph_is_an_error():
    x = leaf(rand(3))
    loss = (x * x).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match=r"backward through the graph of a Sum a second "
                                           r"time: a graph is freed by the backward"):
        loss.backward()
    with pytest.raises(NotImplementedError, match="retain_graph=True is not supported"):
        (x * 2.0).sum().backward(retain_graph=True)


def test_backward_of_a_non_scalar_needs_its_gradient():
    y = leaf(rand(2, 3)) * 2.0
    with pytest.raises(RuntimeError, match=r"backward\(\) of a tensor of shape \(2, 3\) needs "
                                           r"grad, the gradient of what it feeds"):
        y.backward()
    with pytest.raises(ValueError, match=r"backward grad has shape \(3, 2\), the tensor "
                                         r"\(2, 3\)"):
        y.backward(np.ones((3, 2)))


def test_backward_of_a_tensor_that_does_not_require_a_gradient():
    message = r"backward\(\) of a tensor that does not require a gradient \(stop_gradient=True\)"
    with pytest.raises(RuntimeError, match=message):
        (to_tensor(rand(3)) * 2.0).sum().backward()
    with no_grad():
        recorded_nothing = (leaf(rand(3)) * 2.0).sum()
    with pytest.raises(RuntimeError, match=message):
        recorded_nothing.backward()


def test_bad_operands_are_named():
    with pytest.raises(ValueError, match=r"matmul needs operands of at least 2 dimensions, got "
                                         r"shapes \(3,\) and \(3, 2\)"):
        leaf(rand(3)) @ rand(3, 2)
    with pytest.raises(ValueError, match="axis 1 of size 5 does not divide into 2 equal parts"):
        fleet.split(leaf(rand(2, 5)), 2, axis=1)
    with pytest.raises(ValueError, match=r"sections \[1, 1\] do not add up to the size 3"):
        fleet.split(leaf(rand(3, 2)), [1, 1])
    with pytest.raises(TypeError, match="takes a number as exponent, not Tensor"):
        leaf(rand(3)) ** leaf(rand(3))
    with pytest.raises(ValueError, match="set_value got shape \\(2,\\) for a tensor of shape "
                                         "\\(3,\\)"):
        leaf(rand(3)).set_value(np.zeros(2))


# -- fused kernels equal the unfused composition ---------------------------------------------

FUSED = {
    "linear_bias_relu": (lambda x, w, b: F.linear_activation(x, w, b, "relu"),
                         lambda x, w, b: F.relu(F.linear(x, w, b)), ((6, 5), (5, 4), (4,))),
    "linear_bias_tanh": (lambda x, w, b: F.linear_activation(x, w, b, "tanh"),
                         lambda x, w, b: F.tanh(F.linear(x, w, b)), ((6, 5), (5, 4), (4,))),
    "linear_bias_gelu": (lambda x, w, b: F.linear_activation(x, w, b, "gelu"),
                         lambda x, w, b: F.gelu(F.linear(x, w, b)), ((6, 5), (5, 4), (4,))),
    "conv_bias_relu": (lambda x, w, b: F.conv2d(x, w, b, padding=1, act="relu"),
                       lambda x, w, b: F.relu(F.conv2d(x, w, b, padding=1)),
                       ((2, 3, 5, 5), (4, 3, 3, 3), (4,))),
    "conv_bias_gelu": (lambda x, w, b: F.conv2d(x, w, b, stride=2, act="gelu"),
                       lambda x, w, b: F.gelu(F.conv2d(x, w, b, stride=2)),
                       ((2, 3, 5, 5), (4, 3, 3, 3), (4,))),
    "batch_norm_relu_train": (_bn_train("relu"), lambda x, w, b: F.relu(_bn_train()(x, w, b)),
                              ((5, 3, 2, 2), (3,), (3,))),
    "batch_norm_relu_eval": (_bn_eval("relu"), lambda x, w, b: F.relu(_bn_eval()(x, w, b)),
                             ((5, 3, 2, 2), (3,), (3,))),
}


@pytest.mark.parametrize("dtype, tolerance", [("float64", 1e-13), ("float32", 1e-5)])
@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_operation_equals_the_unfused_composition(name, dtype, tolerance):
    fused, unfused, shapes = FUSED[name]
    arrays = [rand(*shape, seed=i).astype(dtype) for i, shape in enumerate(shapes)]
    y_fused, grads_fused = grads_of(fused, *arrays)
    y_plain, grads_plain = grads_of(unfused, *arrays)
    assert y_fused.dtype == np.dtype(dtype)
    np.testing.assert_allclose(y_fused, y_plain, rtol=tolerance, atol=tolerance)
    for got, want in zip(grads_fused, grads_plain):
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)


def test_fused_batch_norm_moves_the_running_statistics_as_unfused():
    x = rand(6, 3, 2, 2)
    stats = [(device(np.zeros(3)), device(np.ones(3))) for _ in range(2)]
    for (mean, var), act in zip(stats, ("relu", None)):
        F.batch_norm(x, mean, var, np.ones(3), np.zeros(3), training=True, act=act)
    np.testing.assert_array_equal(host(stats[0][0]), host(stats[1][0]))
    np.testing.assert_array_equal(host(stats[0][1]), host(stats[1][1]))
    with pytest.raises(ValueError, match="fuses batch norm with relu only, not 'tanh'"):
        F.batch_norm(x, *stats[0], np.ones(3), np.zeros(3), training=True, act="tanh")


# -- a user's own Function -------------------------------------------------------------------

class Cube(Function):
    """``x ** 3`` in the static-method style of ``torch.autograd.Function``/``PyLayer``."""

    op_type = "user_cube"

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x * x

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensor()
        return 3 * x * x * dy


class ScaledProduct(Function):
    """``a * b * scale`` in the plain-method style (``self`` is the recorded call), with a
    number argument and a keyword argument; records which inputs asked for a gradient."""

    needs_seen = []

    def forward(self, a, b, scale, shift=0.0):
        self.a, self.b, self.scale = a, b, scale
        return a * b * scale + shift

    def backward(self, dy):
        ScaledProduct.needs_seen.append(self.needs_input_grad)
        da = dy * self.b * self.scale if self.needs_input_grad[0] else None
        db = dy * self.a * self.scale if self.needs_input_grad[1] else None
        return da, db, None


class SumAndDifference(Function):
    """Two outputs, ``a + b`` and ``a - b``."""

    def forward(self, a, b):
        return a + b, a - b

    def backward(self, d_sum, d_difference):
        d_sum = 0 if d_sum is None else d_sum
        d_difference = 0 if d_difference is None else d_difference
        return d_sum + d_difference, d_sum - d_difference


def test_user_function_in_the_static_method_style():
    assert_gradients(Cube.apply, rand(3, 4))
    x = leaf(rand(3))
    Cube.apply(x).sum().backward()
    np.testing.assert_allclose(host(x.grad), 3 * x.numpy() ** 2, rtol=1e-15)
    assert "user_cube" in Function.op_types()


def test_user_function_in_the_plain_method_style():
    assert_gradients(lambda a, b: ScaledProduct.apply(a, b, 0.5, shift=2.0),
                     rand(3, 4), rand(3, 4, seed=1))
    ScaledProduct.needs_seen.clear()
    a, b = leaf(rand(3)), to_tensor(rand(3, seed=1))
    out = ScaledProduct.apply(a, b, 2.0, shift=1.0)
    np.testing.assert_allclose(out.numpy(), a.numpy() * b.numpy() * 2 + 1, rtol=1e-15)
    out.sum().backward()
    assert ScaledProduct.needs_seen == [(True, False, False)]
    np.testing.assert_allclose(host(a.grad), 2 * b.numpy(), rtol=1e-15)
    assert b.grad is None


def test_user_function_with_two_outputs_one_unused():
    assert_gradients(lambda a, b: SumAndDifference.apply(a, b)[0] * SumAndDifference.apply(
        a, b)[1], rand(3), rand(3, seed=1))
    a, b = leaf(rand(3)), leaf(rand(3, seed=1))
    _, difference = SumAndDifference.apply(a, b)
    difference.sum().backward()
    np.testing.assert_array_equal(host(a.grad), 1.0)
    np.testing.assert_array_equal(host(b.grad), -1.0)


def test_user_function_without_backward_says_so():
    class ForwardOnly(Function):
        def forward(self, x):
            return x * 2

    y = ForwardOnly.apply(leaf(rand(2))).sum()
    with pytest.raises(NotImplementedError, match="ForwardOnly does not define backward"):
        y.backward()


class _Float32Policy:
    """Casts the inputs of ``user_cube`` to float32."""

    @staticmethod
    def dtype_for(op_type):
        return np.dtype("float32") if op_type == "user_cube" else None


def test_autocast_casts_a_user_function_by_its_op_type():
    x = leaf(rand(4))
    with autocast(_Float32Policy()):
        y = Cube.apply(x)
        untouched = ScaledProduct.apply(x, x, 1.0)
    assert y.dtype == np.float32 and untouched.dtype == np.float64
    y.sum().backward()
    assert x.grad.dtype == np.float64
    np.testing.assert_allclose(host(x.grad), 3 * x.numpy().astype(np.float32) ** 2, rtol=1e-6)


def test_paddles_reshape_zero_and_dropout_mode():
    x = to_tensor(np.arange(24.0).reshape(2, 3, 4))
    assert fleet.reshape(x, [0, 0, 2, 2]).shape == [2, 3, 2, 2]
    assert x.reshape([0, -1]).shape == [2, 12]
    with pytest.raises(ValueError, match=r"a 0 keeps the input's size on its axis, but the "
                                         r"input \(2, 3, 4\) has no axis 3"):
        fleet.reshape(x, [4, 3, 2, 0])
    assert F.dropout(x, 0.5, training=False, mode="upscale_in_train") is x
    for make in (lambda: F.dropout(x, 0.5, mode="downscale_in_infer"),
                 lambda: fleet.nn.Dropout(0.5, mode="downscale_in_infer")):
        with pytest.raises(ValueError, match="mode='downscale_in_infer'; allowed: "
                                             "'upscale_in_train'"):
            make()

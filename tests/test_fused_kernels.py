"""The transformer step's fused kernels (``layer_norm.cu``, ``softmax_cross_entropy.cu``,
``dropout_add.cu``): run on the host through their GPU branch against their references
(``kernel_harness``), the operations built on them against the unfused operations they replace
and against finite differences through the kernels, and a ``nn.GPT`` step through the kernels
against the CPU. (The files' signatures and device compilation: ``test_kernels_host.py``.)"""
import configparser
import fnmatch
import os
import re

import numpy as np
import pytest

import fleetmpi.nn.functional as F
from fleetmpi.core import backend
from fleetmpi import kernels, nn, to_tensor
from fleetmpi.autograd import autocast
from fleetmpi.kernels import transformer_reference as reference
from fleetmpi.nn.functional import cudnn
from fleetmpi.nn.gradcheck import check_gradients
from fleetmpi.strategies.amp import CastPolicy, DEFAULT_BLACK_LIST, DEFAULT_WHITE_LIST

from kernel_harness import close, gpu_geometries, gpu_path, random  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Kernel against reference. float32 and float64: the kernels sum a row in order, NumPy
# pairwise. float16: both compute in float32 and round the result to float16 once, so they
# differ by at most a float16 rounding unit where the float32 values straddle a rounding point.
DTYPES = [("float64", 1e-12), ("float32", 2e-5), ("float16", 2e-3)]
# The first shapes have more rows than every geometry of kernel_harness has threads.
LAYER_NORM_SHAPES = [((2, 70, 9), 1), ((37, 13), 1), ((3, 5, 19), 1), ((4, 3, 2, 6), 2),
                     ((1, 1), 1)]
CROSS_ENTROPY_SHAPES = [(140, 9), (37, 13), (5, 300), (3, 1), (1, 1)]
DROPOUT_SHAPES = [(37, 13), (3, 5, 19), (1, 1)]
DROPOUT_DTYPES = [("float64", "float64"), ("float32", "float32"), ("float16", "float16"),
                  ("float16", "float32")]


def _layer_norm_inputs(rng, shape, axes, dtype):
    compute = reference.compute_dtype(dtype)
    x = random(rng, shape, dtype, 3.0) + np.asarray(1.5, dtype)
    weight = random(rng, shape[-axes:], compute)
    bias = random(rng, shape[-axes:], compute)
    return x, weight, bias


@gpu_geometries
@pytest.mark.parametrize("dtype, tolerance", DTYPES)
@pytest.mark.parametrize("shape, axes", LAYER_NORM_SHAPES, ids=str)
def test_layer_norm_matches_the_reference(gpu_path, shape, axes, dtype, tolerance):
    rng = np.random.default_rng([len(shape), shape[-1], axes])
    x, weight, bias = _layer_norm_inputs(rng, shape, axes, dtype)
    y, mean, rstd, xhat = kernels.layer_norm_forward(x, weight, bias, 1e-5)
    want_y, want_mean, want_rstd, _ = reference.layer_norm_forward(x, weight, bias, 1e-5, np)
    assert xhat is None
    close(y, want_y, tolerance)
    close(mean, want_mean, tolerance)
    close(rstd, want_rstd, tolerance)

    dy = random(rng, shape, dtype)
    dx, dweight, dbias = kernels.layer_norm_backward(dy, x, want_mean, want_rstd, None, weight)
    want = reference.layer_norm_backward(dy, reference.layer_norm_xhat(x, want_mean, want_rstd),
                                         want_rstd, weight)
    rows = x.size // weight.size  # the parameters' gradients are sums over the rows
    for got, expected, scale in zip((dx, dweight, dbias), want, (1, rows, rows)):
        close(got, expected, tolerance * scale)
    assert gpu_path == ["layer_norm_forward", "layer_norm_backward"]


@pytest.mark.parametrize("gpu_path", [None], indirect=True)
def test_layer_norm_without_an_instance_for_its_dtypes_runs_the_reference(gpu_path):
    """float16 weights (the instances take float16 values with float32 weights), float64
    weights on float32 values."""
    rng = np.random.default_rng(3)
    for dtype, weights in (("float16", "float16"), ("float32", "float64")):
        x = random(rng, (4, 5), dtype)
        weight, bias = random(rng, 5, weights), random(rng, 5, weights)
        y, _, _, xhat = kernels.layer_norm_forward(x, weight, bias, 1e-5)
        np.testing.assert_array_equal(
            y, reference.layer_norm_forward(x, weight, bias, 1e-5, np)[0])
        assert xhat is not None
    assert gpu_path == []


@gpu_geometries
@pytest.mark.parametrize("dtype, tolerance", DTYPES)
@pytest.mark.parametrize("shape", CROSS_ENTROPY_SHAPES, ids=str)
@pytest.mark.parametrize("per_row", [False, True], ids=["one_scale", "per_row"])
def test_softmax_cross_entropy_matches_the_reference(gpu_path, shape, per_row, dtype,
                                                     tolerance):
    rng = np.random.default_rng([shape[0], shape[1], per_row])
    rows, classes = shape
    logits = random(rng, shape, dtype, 4.0)
    logits[0, :] += np.asarray(60, dtype)  # exp overflows float32 unless the maximum goes first
    labels = rng.integers(0, classes, rows)
    loss, log_probs, row_max, row_logsum = kernels.softmax_cross_entropy_forward(logits, labels)
    want = reference.softmax_cross_entropy_forward(logits, labels, np)
    assert log_probs is None
    np.testing.assert_array_equal(row_max, want[2])
    close(row_logsum, want[3], tolerance)
    close(loss, want[0], tolerance * 10)  # a difference of terms of the logits' size

    compute = want[2].dtype
    scale = (rng.uniform(0.5, 2, (rows, 1)) if per_row else rng.uniform(0.5, 2, ())).astype(
        compute)
    grad = kernels.softmax_cross_entropy_backward(logits, labels, None, want[2], want[3], scale,
                                                  logits.dtype)
    want_grad = reference.softmax_cross_entropy_backward(
        reference.log_probs(logits, want[2], want[3]), labels, scale, logits.dtype, np)
    close(grad, want_grad, tolerance)
    assert gpu_path == ["softmax_cross_entropy_forward", "softmax_cross_entropy_backward"]


@pytest.mark.parametrize("gpu_path", [None], indirect=True)
@pytest.mark.parametrize("dtype, tolerance", DTYPES)
def test_a_label_outside_the_classes_gives_its_row_nan_on_the_device(gpu_path, dtype,
                                                                    tolerance):
    """Labels on a device are not checked on the host (``loss._labels_2d``): the kernels give
    the row of a label outside the classes a NaN loss and NaN gradients, and compute the
    other rows as the reference does."""
    rng = np.random.default_rng(11)
    logits = random(rng, (4, 5), dtype, 2.0)
    labels, good, bad = np.array([1, -1, 5, 4]), [0, 3], [1, 2]
    loss, _, row_max, row_logsum = kernels.softmax_cross_entropy_forward(logits, labels)
    want = reference.softmax_cross_entropy_forward(logits[good], labels[good], np)
    assert np.isnan(loss[bad]).all()
    close(loss[good], want[0], tolerance * 10)
    scale = np.ones((), row_max.dtype)
    grad = kernels.softmax_cross_entropy_backward(logits, labels, None, row_max, row_logsum,
                                                  scale, logits.dtype)
    want_grad = reference.softmax_cross_entropy_backward(
        reference.log_probs(logits[good], want[2], want[3]), labels[good], scale, logits.dtype,
        np)
    assert np.isnan(grad[bad]).all()
    close(grad[good], want_grad, tolerance)


@gpu_geometries
@pytest.mark.parametrize("x_dtype, residual_dtype", DROPOUT_DTYPES)
@pytest.mark.parametrize("shape", DROPOUT_SHAPES, ids=str)
@pytest.mark.parametrize("p", [0.3, 0.5])
def test_dropout_add_equals_the_reference_bit_for_bit(gpu_path, shape, p, x_dtype,
                                                      residual_dtype):
    rng = np.random.default_rng([len(shape), shape[-1], int(10 * p)])
    x = random(rng, shape, x_dtype, 3.0)
    x.flat[::4] = -x.flat[::4] * 0  # negative zeros, kept and dropped
    residual = random(rng, shape, residual_dtype)
    draws = rng.random(shape)
    draws.flat[::3] = p  # the boundary: kept
    y, keep = kernels.dropout_add_forward(x, residual, draws, p)
    want_y, want_keep = reference.dropout_add_forward(x, residual, draws, p)
    assert y.dtype == want_y.dtype and keep.dtype == np.bool_
    np.testing.assert_array_equal(keep, want_keep)
    np.testing.assert_array_equal(y, want_y)
    assert np.array_equal(np.signbit(y), np.signbit(want_y))

    dy = random(rng, shape, residual_dtype, 5.0)
    dx = kernels.dropout_add_backward(dy, want_keep, p, x.dtype)
    want_dx = reference.dropout_add_backward(dy, want_keep, p, x.dtype)
    assert dx.dtype == np.dtype(x_dtype)
    np.testing.assert_array_equal(dx, want_dx)
    assert gpu_path == ["dropout_add_forward", "dropout_add_backward"]


# -- the operations against the unfused ones they replace -----------------------------------

def _step(function, arrays, dy, seed=3):
    """Output and input gradients of ``function`` on Tensors of ``arrays``."""
    tensors = [to_tensor(a, stop_gradient=False) for a in arrays]
    backend.manual_seed(seed)
    y = function(*tensors)
    y.backward(to_tensor(dy.astype(y.dtype)))
    return [y.numpy()] + [t.grad.numpy() for t in tensors]


@pytest.mark.parametrize("x_dtype, residual_dtype", DROPOUT_DTYPES)
def test_dropout_add_equals_dropout_then_add_bit_for_bit(x_dtype, residual_dtype):
    rng = np.random.default_rng(4)
    x, residual = random(rng, (6, 7), x_dtype), random(rng, (6, 7), residual_dtype)
    dy = random(rng, (6, 7), "float64")
    fused = _step(lambda a, r: F.dropout_add(a, r, 0.4), (x, residual), dy)
    unfused = _step(lambda a, r: r + F.dropout(a, 0.4), (x, residual), dy)
    for got, want in zip(fused, unfused):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    assert 0 < (fused[1] == 0).mean() < 1  # some dropped, some kept
    np.testing.assert_array_equal(F.dropout_add(x, residual, 0.4, training=False).numpy(),
                                  residual + x)
    with pytest.raises(ValueError, match=r"of one shape, got \(6, 7\) and \(7,\)"):
        F.dropout_add(x, residual[0], 0.4)


def _layer_norm_composed(x, weight, bias, axes, epsilon=1e-5):
    """LayerNorm of Tensor operations."""
    reduce = tuple(range(x.ndim - axes, x.ndim))
    mean = x.mean(axis=reduce, keepdim=True)
    centered = x - mean
    var = (centered * centered).mean(axis=reduce, keepdim=True)
    return centered / (var + epsilon).sqrt() * weight + bias


@pytest.mark.parametrize("shape, axes", [((5, 6), 1), ((2, 3, 4), 2)])
def test_layer_norm_equals_its_composition_from_tensor_operations(shape, axes):
    rng = np.random.default_rng(5)
    x, weight, bias = _layer_norm_inputs(rng, shape, axes, "float64")
    dy = random(rng, shape, "float64")
    fused = _step(lambda a, w, b: F.layer_norm(a, shape[-axes:], w, b), (x, weight, bias), dy)
    composed = _step(lambda a, w, b: _layer_norm_composed(a, w, b, axes), (x, weight, bias), dy)
    for got, want in zip(fused, composed):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_values_equal_the_picked_log_softmax(reduction):
    """The loss is ``-log_softmax`` at the labels, bit for bit (the same operations); its
    gradient is the softmax less the one-hot labels, scaled."""
    rng = np.random.default_rng(6)
    logits, labels = random(rng, (7, 5), "float64", 3.0), rng.integers(0, 5, 7)
    picked = -F.log_softmax(logits).numpy()[np.arange(7), labels]
    want = {"mean": picked.mean(), "sum": picked.sum(), "none": picked}[reduction]
    logits_tensor = to_tensor(logits, stop_gradient=False)
    loss = F.cross_entropy(logits_tensor, labels, reduction=reduction)
    np.testing.assert_array_equal(loss.numpy(), want)
    loss.backward(to_tensor(np.ones(loss.shape)))
    softmax = np.exp(logits - logits.max(axis=1, keepdims=True))
    softmax /= softmax.sum(axis=1, keepdims=True)
    softmax[np.arange(7), labels] -= 1
    np.testing.assert_allclose(logits_tensor.grad.numpy(),
                               softmax / (7 if reduction == "mean" else 1),
                               rtol=1e-13, atol=1e-15)


def test_cross_entropy_of_float16_logits_under_amp_takes_them_without_a_cast():
    """amp's black list computes the loss in float32: float16 logits go in as they are, with
    the loss and the logits' gradient of a float32 cast first, bit for bit."""
    rng = np.random.default_rng(7)
    logits, labels = random(rng, (6, 9), "float16", 3.0), rng.integers(0, 9, 6)
    policy = CastPolicy(DEFAULT_WHITE_LIST, DEFAULT_BLACK_LIST)
    results = []
    for cast in (False, True):
        tensor = to_tensor(logits, stop_gradient=False)
        with autocast(policy):
            loss = F.cross_entropy(tensor.astype("float32") if cast else tensor, labels)
            if not cast:
                assert loss._node._inputs[0][1] is tensor  # no Cast recorded in between
            loss.backward()
        results.append((loss.numpy(), tensor.grad.numpy()))
    (loss, grad), (cast_loss, cast_grad) = results
    assert loss.dtype == np.float32 and grad.dtype == np.float16
    np.testing.assert_array_equal(loss, cast_loss)
    np.testing.assert_array_equal(grad, cast_grad)


# -- finite differences through the kernels (on the CPU: test_functional.py) ----------------

LABELS = np.array([3, 0, 4, 4, 1, 2])
OPERATIONS = {
    "layer_norm": (lambda x, w, b: F.layer_norm(x, 5, w, b), ((6, 5), (5,), (5,))),
    "layer_norm_two_axes": (lambda x, w, b: F.layer_norm(x, (2, 5), w, b),
                            ((3, 2, 5), (2, 5), (2, 5))),
    "cross_entropy_mean": (lambda x: F.cross_entropy(x, LABELS), ((6, 5),)),
    "cross_entropy_none": (lambda x: F.cross_entropy(x, LABELS, reduction="none"), ((6, 5),)),
    "cross_entropy_3d": (lambda x: F.cross_entropy(x, LABELS.reshape(2, 3)), ((2, 3, 5),)),
    "dropout_add": (lambda x, r: F.dropout_add(x, r, 0.4), ((6, 5), (6, 5))),
}


@pytest.mark.parametrize("gpu_path", [(2, 3)], indirect=True)
@pytest.mark.parametrize("name", sorted(OPERATIONS))
def test_kernel_gradients_match_finite_differences(gpu_path, name):
    function, shapes = OPERATIONS[name]
    rng = np.random.default_rng(len(name))
    errors = check_gradients(function, *(rng.standard_normal(s) for s in shapes))
    assert max(errors.values()) < 1e-7, errors
    assert {kernel.rsplit("_", 1)[1] for kernel in gpu_path} == {"forward", "backward"}


# -- nn.GPT through the kernels -----------------------------------------------------------------

def _gpt_step(fuse, dropout=0.1):
    """Loss and parameter gradients of one tiny float64 GPT step, dropout masks from one fixed
    generator on either branch."""
    backend.manual_seed(0)
    model = nn.GPT(vocab_size=23, block_size=5, n_layer=2, n_head=2, n_embd=8, dropout=dropout,
                   dtype="float64")
    model.configure_fusion(fuse_elewise_add_act_ops=fuse)
    tokens = np.random.default_rng(8).integers(0, 23, (2, 6))
    generator = np.random.default_rng(9)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend, "rank_rng", lambda: generator)
        loss = F.cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
    return [loss.numpy()] + [p.grad.numpy() for p in model.parameters()]


@pytest.mark.parametrize("gpu_path", [None], indirect=True)
@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fuse_elewise_add_act_ops"])
def test_gpt_step_through_the_kernels_equals_the_cpu(gpu_path, fuse, monkeypatch):
    monkeypatch.setattr(cudnn, "_unusable", "the kernels run on the host in this test")
    on_device = _gpt_step(fuse)
    kinds = ["layer_norm", "softmax_cross_entropy", "dropout_add"] + ["bias_act"] * fuse
    assert {f"{kind}_{way}" for kind in kinds for way in ("forward", "backward")} == \
        set(gpu_path)
    gpu_path.clear()
    with pytest.MonkeyPatch.context() as host:
        host.setattr(backend, "on_gpu", lambda: False)
        host.setattr(backend, "array_module", lambda: np)
        on_host = _gpt_step(fuse)
    assert gpu_path == []
    for got, want in zip(on_device, on_host):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-13)


@pytest.mark.skipif(not backend.on_gpu(),
                    reason="needs a CUDA GPU through CuPy (FLEETMPI_DEVICE=gpu)")
@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fuse_elewise_add_act_ops"])
def test_gpt_step_on_the_gpu_equals_the_host(fuse, monkeypatch):
    """The real kernels on a GPU (LayerNorm, cross-entropy, dropout + add with p = 0, bias +
    GELU when fused, and attention.cu's attention, which takes attention without dropout when
    cuDNN is off) against the NumPy references on the host, float64."""
    monkeypatch.setattr(cudnn, "_unusable", "fleetmpi's own attention in this test")
    on_device = _gpt_step(fuse, dropout=0.0)
    with pytest.MonkeyPatch.context() as host:
        host.setattr(backend, "on_gpu", lambda: False)
        host.setattr(backend, "array_module", lambda: np)
        on_host = _gpt_step(fuse, dropout=0.0)
    for got, want in zip(on_device, on_host):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_every_kernel_source_and_what_it_includes_is_installed_with_the_package():
    """A wheel carries only the files setup.cfg's package_data names: a header a kernel
    includes but the wheel lacks would fail to compile on a GPU only."""
    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    patterns = [p.strip() for p in config["options.package_data"]["fleetmpi.kernels"].split(",")]
    folder = os.path.dirname(kernels.__file__)
    sources = [name for name in os.listdir(folder) if name.endswith(".cu")]
    included = set()
    for name in sources:
        with open(os.path.join(folder, name)) as f:
            included.update(re.findall(r'^#include "([^"]+)"', f.read(), re.M))
    assert included, "no kernel includes a local header any more: drop this test"
    for name in sources + sorted(included):
        assert any(fnmatch.fnmatch(name, p) for p in patterns), (name, patterns)

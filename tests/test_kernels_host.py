"""Every fused kernel file's signatures and device compilation; the kernels of batch norm and
bias + activation (``fleetmpi/kernels/*.cu``) run on the host against their NumPy references,
through their GPU branch (``kernel_harness``; the transformer step's: ``test_fused_kernels.py``;
attention's: ``test_attention_kernels.py``; the multi-tensor optimizer kernels, whose arrays come
as a table of addresses: ``test_multi_tensor.py``)."""
import numpy as np
import pytest

import fleetmpi.nn.functional as F
from fleetmpi import Tensor, kernels
from fleetmpi.core import backend
from fleetmpi.kernels import loader, reference

from cuda_host import compile_for_device
from kernel_harness import close, gpu_geometries, gpu_path, random, signatures  # noqa: F401

FILES = {
    "bias_act.cu": ("bias_act_forward", "bias_act_backward"),
    "bn_act.cu": ("bn_act_forward", "bn_act_backward_mask", "bn_input_grad"),
    "layer_norm.cu": ("layer_norm_forward", "layer_norm_backward"),
    "softmax_cross_entropy.cu": ("softmax_cross_entropy_forward",
                                 "softmax_cross_entropy_backward"),
    "dropout_add.cu": ("dropout_add_forward", "dropout_add_backward"),
    "attention.cu": ("attention_forward", "attention_backward"),
}
DTYPES = [("float64", 1e-12), ("float32", 1e-5)]
# bias_act computes float16 in float32 and rounds once; NumPy rounds every operation of GELU
# to float16: the two stay within a few float16 rounding units (2**-11 relative).
FLOAT16 = ("float16", 4e-3)
SHAPES = [(37, 13), (3, 5, 19), (5, 7, 3, 11), (1, 1)]
EMPTY = (0, 4)  # bias_act only: batch norm of no values has no statistics


def test_signatures_cover_every_kernel_and_instance():
    for filename, names in FILES.items():
        want = {f"{k}_{s}" for k in names for s in loader.instances(filename)}
        assert set(signatures(filename)) == want
        assert {"float32", "float64"} <= loader.instances(filename)
    assert all(any(s.startswith("float16") for s in loader.instances(filename))
               for filename in FILES if filename != "bn_act.cu")


@pytest.mark.parametrize("filename", sorted(FILES))
def test_kernels_compile_for_the_device(filename):
    ptx = open(compile_for_device(loader.source_path(filename))).read()
    for name in signatures(filename):
        assert f".entry {name}(" in ptx


@gpu_geometries
@pytest.mark.parametrize("dtype, tolerance", DTYPES + [FLOAT16])
@pytest.mark.parametrize("shape", SHAPES + [EMPTY], ids=str)
@pytest.mark.parametrize("act", reference.ACTIVATIONS)
def test_bias_act_matches_the_reference(gpu_path, act, shape, dtype, tolerance):
    rng = np.random.default_rng([len(shape), shape[-1], len(act)])
    z = random(rng, shape, dtype, 2.0)
    bias = random(rng, shape[1], dtype)
    if z.size:
        z.flat[::5] = -bias[(np.arange(0, z.size, 5) // (z.size // shape[0] // shape[1]))
                            % shape[1]]  # pre-activation exactly 0: the ReLU boundary
    y, pre = kernels.bias_act_forward(z, bias, act)
    want_y, want_pre = reference.bias_act_forward(z, bias, act, np)
    close(y, want_y, tolerance)
    if act in reference.INPUT_ACTIVATIONS:
        close(pre, want_pre, tolerance)
    else:
        assert pre is None and want_pre is None

    dy = random(rng, shape, dtype)
    dz = kernels.bias_act_backward(dy, want_y, want_pre, act)
    close(dz, reference.bias_act_backward(dy, want_y, want_pre, act, np), tolerance)
    assert gpu_path == ["bias_act_forward", "bias_act_backward"]


def _bn_inputs(rng, shape, dtype):
    channels = shape[1]
    x = random(rng, shape, dtype, 3.0) + 0.5
    mean = random(rng, channels, dtype)
    invstd = (rng.uniform(0.2, 3.0, channels)).astype(dtype)
    gamma = random(rng, channels, dtype)
    beta = random(rng, channels, dtype)
    return x, mean, invstd, gamma, beta


@gpu_geometries
@pytest.mark.parametrize("dtype, tolerance", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bn_act_matches_the_reference(gpu_path, shape, dtype, tolerance):
    rng = np.random.default_rng([len(shape), shape[-1], 7])
    x, mean, invstd, gamma, beta = _bn_inputs(rng, shape, dtype)
    y, kernel_xhat = kernels.bn_act_forward(x, mean, invstd, gamma, beta)
    want_y, want_xhat = reference.bn_act_forward(x, mean, invstd, gamma, beta, np)
    close(y, want_y, tolerance)
    assert kernel_xhat is None
    np.testing.assert_array_equal(want_xhat, reference.bn_xhat(x, mean, invstd))
    assert 0 < (want_y > 0).mean() < 1 or want_y.size <= 1

    dy = random(rng, shape, dtype)
    dz = kernels.bn_act_backward_mask(dy, want_y)
    want_dz = reference.bn_act_backward_mask(dy, want_y)
    close(dz, want_dz, tolerance)

    axes = (0,) + tuple(range(2, len(shape)))
    count = x.size // shape[1]
    xhat = reference.bn_xhat(x, mean, invstd)
    sum_dz, sum_dz_xhat = want_dz.sum(axis=axes), (want_dz * xhat).sum(axis=axes)
    dx = kernels.bn_input_grad(want_dz, xhat, invstd, gamma, sum_dz, sum_dz_xhat, count)
    want_dx = reference.bn_input_grad(want_dz, xhat, invstd, gamma, sum_dz, sum_dz_xhat, count)
    # every term is scaled by gamma * invstd / count; compare relative to that size
    scale = max(1.0, float(np.abs(want_dx).max(initial=0)))
    close(dx, want_dx, tolerance * scale)
    assert gpu_path == ["bn_act_forward", "bn_act_backward_mask", "bn_input_grad"]


def _fused_batch_norm_step(x, dy):
    """Output and gradients of a training batch norm + ReLU (``fuse_bn_act_ops``)."""
    channels = x.shape[1]
    xt = Tensor(x, stop_gradient=False)
    weight = Tensor(np.linspace(0.5, 1.5, channels).astype(x.dtype), stop_gradient=False)
    bias = Tensor(np.linspace(-0.2, 0.2, channels).astype(x.dtype), stop_gradient=False)
    y = F.batch_norm(xt, None, None, weight, bias, training=True, act="relu")
    y.backward(Tensor(dy))
    return [np.array(a) for a in (y.numpy(), xt.grad, weight.grad, bias.grad)]


@pytest.mark.parametrize("gpu_path", [None], indirect=True)
def test_fused_batch_norm_on_the_device_branch_equals_the_host(gpu_path):
    """The host keeps the normalized input from forward; the device kernel does not, and
    backward forms it again from the input: both give the same step."""
    rng = np.random.default_rng(11)
    x, dy = random(rng, (4, 3, 5, 6), "float64"), random(rng, (4, 3, 5, 6), "float64")
    on_device = _fused_batch_norm_step(x, dy)
    assert gpu_path[0] == "bn_act_forward" and "bn_input_grad" in gpu_path
    gpu_path.clear()
    with pytest.MonkeyPatch.context() as host:
        host.setattr(backend, "on_gpu", lambda: False)
        host.setattr(backend, "array_module", lambda: np)
        on_host = _fused_batch_norm_step(x, dy)
    assert gpu_path == []
    for got, want in zip(on_device, on_host):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)

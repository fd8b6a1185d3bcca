"""Fused kernels (``BuildStrategy`` fusion switches) against the unfused layers, forward and
backward through the recorded graph, and the kernel sources themselves."""
import shutil
import subprocess

import numpy as np
import pytest

from fleetmpi.core import backend
from fleetmpi import kernels, nn, to_tensor
from fleetmpi.kernels import loader, reference
from fleetmpi.nn.gradcheck import check_gradients


def rand(*shape, seed=0, dtype="float64"):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


MODELS = {
    "linear_relu": lambda: nn.MLP([6, 7, 5, 3], activation="relu"),
    "linear_tanh": lambda: nn.MLP([6, 7, 3], activation="tanh"),
    "linear_gelu": lambda: nn.MLP([6, 7, 3], activation="gelu"),
    "conv_bias_relu": lambda: nn.Sequential(nn.Conv2D(2, 3, 3, padding=1), nn.ReLU(),
                                            nn.GlobalAvgPool(), nn.Linear(3, 3)),
    "bn_relu": lambda: nn.Sequential(nn.Linear(6, 5, bias_attr=False), nn.BatchNorm1D(5), nn.ReLU(),
                                     nn.Linear(5, 3)),
    "resnet_block": lambda: nn.Sequential(nn.basic_block(2, 4, stride=2), nn.GlobalAvgPool()),
}
INPUTS = {"conv_bias_relu": (4, 2, 5, 5), "resnet_block": (3, 2, 4, 4)}
FUSION = {"fuse_elewise_add_act_ops": True, "fuse_bn_act_ops": True}


def run(name, fused, dtype):
    nn.set_default_dtype(dtype)
    backend.manual_seed(0)
    try:
        model = MODELS[name]()
    finally:
        nn.set_default_dtype("float32")
    if fused:
        model.configure_fusion(**FUSION)
    x = to_tensor(rand(*INPUTS.get(name, (4, 6)), dtype=dtype), stop_gradient=False)
    y = model(x)
    y.backward(rand(*y.shape, seed=1, dtype=dtype))
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
    return model, y.numpy(), x.grad.numpy(), grads


def fused_step_count(model):
    counts = [model.fused_steps()] + [layer.fused_steps() for _, layer in
                                      model.named_sublayers() if isinstance(layer, nn.Sequential)]
    return sum(counts)


@pytest.mark.parametrize("dtype, tolerance", [("float64", 1e-13), ("float32", 1e-5)])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_fused_equals_unfused(name, dtype, tolerance):
    _, y0, dx0, grads0 = run(name, False, dtype)
    fused, y1, dx1, grads1 = run(name, True, dtype)
    assert fused_step_count(fused) > 0
    assert y1.dtype == np.dtype(dtype)
    np.testing.assert_allclose(y1, y0, rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(dx1, dx0, rtol=tolerance, atol=tolerance)
    assert set(grads1) == set(grads0)
    for key in grads0:
        np.testing.assert_allclose(grads1[key], grads0[key], rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("name", ["linear_gelu", "bn_relu", "conv_bias_relu"])
def test_fused_gradients_match_finite_differences(name):
    nn.set_default_dtype("float64")
    backend.manual_seed(0)
    try:
        model = MODELS[name]()
    finally:
        nn.set_default_dtype("float32")
    model.configure_fusion(**FUSION)
    errors = check_gradients(model, rand(*INPUTS.get(name, (4, 6))))
    assert max(errors.values()) < 1e-6, errors


def test_fusion_switches_off_again():
    model = nn.MLP([3, 4, 2])
    model.configure_fusion(fuse_elewise_add_act_ops=True)
    assert model.fused_steps() == 1
    model.configure_fusion()
    assert model.fused_steps() == 0


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("filename", ["bias_act.cu", "bn_act.cu", "optimizer.cu"])
def test_kernel_sources_compile(filename, tmp_path):
    result = subprocess.run(["nvcc", "--std=c++17", "-ptx", "-o", str(tmp_path / "k.ptx"),
                             loader.source_path(filename)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    ptx = (tmp_path / "k.ptx").read_text()
    kernels = {"bias_act.cu": ["bias_act_forward", "bias_act_backward"],
               "bn_act.cu": ["bn_act_forward", "bn_act_backward_mask", "bn_input_grad"],
               "optimizer.cu": ["multi_tensor_sgd", "multi_tensor_momentum", "multi_tensor_adam",
                                "multi_tensor_unscale"]}[filename]
    for kernel in kernels:
        for suffix in loader.instances(filename):
            assert f".entry {kernel}_{suffix}(" in ptx


UPDATES = {
    "sgd_update": (1, (0.1, 0.05)),
    "momentum_update": (2, (0.1, 0.9, 0.05, True)),
    "adam_update": (3, (0.01, 0.9, 0.999, 1e-8, 3, 0.05, True)),
}


@pytest.mark.skipif(backend.on_gpu(), reason="the host path; a GPU runs the kernels")
@pytest.mark.parametrize("name", UPDATES)
@pytest.mark.parametrize("shape", [(2 * kernels.HOST_BLOCK + 7,), (3, kernels.HOST_BLOCK + 1)])
def test_host_updates_over_blocks_equal_the_reference_bit_for_bit(name, shape):
    """On the host the fused updates run their reference block by block (``HOST_BLOCK``);
    elementwise arithmetic gives the same bits as one pass over the whole arrays."""
    states, args = UPDATES[name]
    extra = (np,) if name == "adam_update" else ()
    arrays = [np.abs(rand(*shape, seed=i, dtype="float32")) for i in range(states + 1)]
    want = [a.copy() for a in arrays]
    getattr(reference, name)(*want, *args, *extra)
    getattr(kernels, "multi_tensor_" + name)([arrays[0]], [arrays[1]],
                                             *([a] for a in arrays[2:]), *args)
    for got, expected in zip(arrays, want):
        np.testing.assert_array_equal(got, expected)
    assert not np.array_equal(arrays[0], np.abs(rand(*shape, seed=0, dtype="float32")))

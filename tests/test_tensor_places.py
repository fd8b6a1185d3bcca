"""Paddle's ``Tensor.cpu()``, ``cuda()`` and ``to(device, dtype)``."""
import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.core import backend


def test_cpu_gives_the_values_on_the_host_outside_the_graph():
    x = fleet.to_tensor(np.arange(4.0), stop_gradient=False)
    host = x.cpu()
    assert isinstance(host.data, np.ndarray) and host.stop_gradient
    np.testing.assert_array_equal(host.data, np.arange(4.0))


def test_to_casts_in_the_graph():
    x = fleet.to_tensor(np.arange(4.0), stop_gradient=False)
    y = x.to(dtype="float32")
    assert y.dtype == np.float32
    y.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.ones(4))
    assert x.to("cpu", "float16").dtype == np.float16


@pytest.mark.skipif(backend.on_gpu(), reason="the CPU backend's refusal")
def test_the_gpu_is_refused_on_the_cpu_backend_by_name():
    x = fleet.to_tensor(np.ones(2))
    for move in (lambda: x.cuda(), lambda: x.to("gpu:0")):
        with pytest.raises(ValueError, match="this process runs on the CPU backend"):
            move()
    with pytest.raises(ValueError, match="device='tpu' is not known; allowed: 'cpu', 'gpu'"):
        x.to("tpu")


@pytest.mark.skipif(not backend.on_gpu(), reason="needs the GPU backend")
def test_a_host_tensor_moves_to_the_gpu():
    host = fleet.to_tensor(np.ones(3)).cpu()
    moved = host.to("gpu")
    assert not isinstance(moved.data, np.ndarray)
    assert moved.to("gpu") is moved

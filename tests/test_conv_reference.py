"""Convolution and pooling, forward and backward, against direct loops over output positions
and kernel offsets in float64: strides 1 and 2, padding 0 to 3, kernels 1, 3 and 7, odd and
rectangular images, batch 1, and float16/float32/float64 inputs."""
import numpy as np
import pytest

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from comm_support import host

# (batch, channels in, channels out, height, width, kernel, stride, padding)
CONV_CASES = [
    (2, 3, 4, 5, 5, 3, 1, 1), (2, 3, 4, 5, 5, 3, 2, 1), (1, 2, 3, 7, 6, 3, 2, 0),
    (2, 3, 2, 6, 5, 1, 1, 0), (2, 3, 2, 7, 7, 1, 2, 0), (1, 2, 2, 9, 8, 7, 1, 3),
    (2, 2, 3, 9, 9, 7, 2, 3), (1, 1, 2, 4, 5, 3, 1, 2), (2, 2, 2, 3, 3, 3, 2, 2),
]
TOLERANCE = {np.float64: 1e-12, np.float32: 1e-5, np.float16: 3e-2}


def direct_conv(x, w, b, stride, padding):
    """``y``, and a function from ``dy`` to ``(dx, dw, db)``, by loops over outputs and
    offsets."""
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    oh, ow = (h + 2 * padding - kh) // stride + 1, (wd + 2 * padding - kw) // stride + 1
    y = np.zeros((n, o, oh, ow)) + b.reshape(1, -1, 1, 1)
    for oy in range(oh):
        for ox in range(ow):
            for i in range(kh):
                for j in range(kw):
                    y[:, :, oy, ox] += xp[:, :, oy * stride + i, ox * stride + j] @ w[:, :, i, j].T

    def backward(dy):
        dxp, dw = np.zeros_like(xp), np.zeros_like(w)
        for oy in range(oh):
            for ox in range(ow):
                for i in range(kh):
                    for j in range(kw):
                        at = (slice(None), slice(None), oy * stride + i, ox * stride + j)
                        dxp[at] += dy[:, :, oy, ox] @ w[:, :, i, j]
                        dw[:, :, i, j] += dy[:, :, oy, ox].T @ xp[at]
        return dxp[:, :, padding:padding + h, padding:padding + wd], dw, dy.sum(axis=(0, 2, 3))
    return y, backward


def direct_pool(x, kernel, stride, padding, kind):
    """Max (padding as minus infinity) or exclusive average pooling, and its backward."""
    n, c, h, w = x.shape
    oh, ow = (h + 2 * padding - kernel) // stride + 1, (w + 2 * padding - kernel) // stride + 1
    y = np.zeros((n, c, oh, ow))
    windows = {}
    for oy in range(oh):
        for ox in range(ow):
            rows = range(max(0, oy * stride - padding), min(h, oy * stride - padding + kernel))
            cols = range(max(0, ox * stride - padding), min(w, ox * stride - padding + kernel))
            window = x[:, :, rows.start:rows.stop, cols.start:cols.stop]
            windows[oy, ox] = (rows, cols)
            reduce = window.max if kind == "max" else window.mean
            y[:, :, oy, ox] = reduce(axis=(2, 3))

    def backward(dy):
        dx = np.zeros_like(x)
        for (oy, ox), (rows, cols) in windows.items():
            window = x[:, :, rows.start:rows.stop, cols.start:cols.stop]
            if kind == "max":
                flat = window.reshape(n, c, -1)
                share = (np.arange(flat.shape[-1]) == flat.argmax(axis=-1)[..., None])
                share = share.reshape(window.shape) * dy[:, :, oy, ox][..., None, None]
            else:
                share = np.broadcast_to(dy[:, :, oy, ox][..., None, None] / window[0, 0].size,
                                        window.shape)
            dx[:, :, rows.start:rows.stop, cols.start:cols.stop] += share
        return dx
    return y, backward


def run(function, dtype, *arrays):
    """``function`` on tensors of ``arrays`` cast to ``dtype``; output and input gradients
    (float64, on the host) for a fixed random output gradient, and that gradient."""
    tensors = [fleet.to_tensor(a.astype(dtype), stop_gradient=False) for a in arrays]
    y = function(*tensors)
    dy = np.random.default_rng(9).standard_normal(y.shape)
    y.backward(dy.astype(dtype))
    return (host(y).astype(np.float64), [host(t.grad).astype(np.float64) for t in tensors],
            dy.astype(dtype).astype(np.float64))


def assert_close(got, want, dtype, what):
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * scale,
                               err_msg=what)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: "n{}c{}o{}_{}x{}_k{}s{}p{}".format(*c))
def test_conv2d_equals_direct_loops(case, dtype):
    n, c, o, h, w, k, stride, padding = case
    rng = np.random.default_rng(sum(case))
    x, weight, bias = (rng.standard_normal(s) for s in ((n, c, h, w), (o, c, k, k), (o,)))
    y, (dx, dw, db), dy = run(lambda a, b_, c_: F.conv2d(a, b_, c_, stride=stride,
                                                         padding=padding), dtype, x, weight, bias)
    rounded = [a.astype(dtype).astype(np.float64) for a in (x, weight, bias)]
    want_y, backward = direct_conv(*rounded, stride, padding)
    assert y.shape == want_y.shape
    assert_close(y, want_y, dtype, "output")
    for got, want, what in zip((dx, dw, db), backward(dy), ("input", "weight", "bias")):
        assert_close(got, want, dtype, f"{what} gradient")


POOL_CASES = [(3, 2, 1), (2, 2, 0), (3, 1, 1), (1, 2, 0), (7, 3, 3), (5, 2, 2)]


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("case", POOL_CASES, ids=lambda c: "k{}s{}p{}".format(*c))
@pytest.mark.parametrize("shape", [(2, 3, 7, 7), (1, 2, 9, 8)], ids=["7x7", "batch1_9x8"])
def test_pooling_equals_direct_loops(shape, case, kind):
    kernel, stride, padding = case
    x = np.random.default_rng(sum(shape) + kernel).standard_normal(shape)
    pool = F.max_pool2d if kind == "max" else F.avg_pool2d
    y, (dx,), dy = run(lambda a: pool(a, kernel, stride=stride, padding=padding), np.float64, x)
    want_y, backward = direct_pool(x, kernel, stride, padding, kind)
    assert_close(y, want_y, np.float64, "output")
    assert_close(dx, backward(dy), np.float64, "input gradient")

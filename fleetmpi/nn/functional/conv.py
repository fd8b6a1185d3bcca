"""Convolution and pooling over NCHW images, by im2col: the windows of the (padded) input are a
strided view, one matrix product does the convolution, and backward adds each kernel offset's
slice of the column gradient back into the input gradient."""
import numpy as np

from ... import backend, kernels
from ...autograd import Function
from ...autograd.operations import matmul_arrays
def _as_strided(x, shape, strides):
    if backend.on_gpu():
        import cupy

        return cupy.lib.stride_tricks.as_strided(x, shape=shape, strides=strides)
    return np.lib.stride_tricks.as_strided(x, shape=shape, strides=strides, writeable=False)


def _pad(x, padding, value=0.0):
    ph, pw = padding
    if ph == 0 and pw == 0:
        return x
    return backend.array_module().pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)),
                                      constant_values=value)


def _windows(x, kernel, stride):
    """``(N, C, OH, OW, KH, KW)`` view of the windows of ``x``."""
    n, c, h, w = x.shape
    (kh, kw), (sh, sw) = kernel, stride
    oh, ow = (h - kh) // sh + 1, (w - kw) // sw + 1
    s = x.strides
    return _as_strided(x, (n, c, oh, ow, kh, kw), (s[0], s[1], s[2] * sh, s[3] * sw, s[2], s[3]))


def output_size(what, x, kernel, stride, padding):
    """``(OH, OW)`` of a window operation on ``x``; a ValueError naming ``what`` when the
    padded input is smaller than the kernel."""
    h, w = x.shape[2] + 2 * padding[0], x.shape[3] + 2 * padding[1]
    if h < kernel[0] or w < kernel[1]:
        raise ValueError(f"{what}: input of spatial size {tuple(x.shape[2:])} "
                         f"with padding {padding} is smaller than the kernel {kernel}")
    return (h - kernel[0]) // stride[0] + 1, (w - kernel[1]) // stride[1] + 1


def _scatter_windows(dwin, padded_shape, kernel, stride, xp, dtype):
    """Sum the window gradient ``(N, C, OH, OW, KH, KW)`` back into the padded input."""
    dxp = xp.zeros(padded_shape, dtype=dtype)
    oh, ow = dwin.shape[2:4]
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            dxp[:, :, i:i + stride[0] * (oh - 1) + 1:stride[0],
                j:j + stride[1] * (ow - 1) + 1:stride[1]] += dwin[:, :, :, :, i, j]
    return dxp


def _crop(dxp, padding, shape):
    ph, pw = padding
    return dxp[:, :, ph:ph + shape[2], pw:pw + shape[3]]




def _padded_shape(x_shape, padding):
    n, c, h, w = x_shape
    return (n, c, h + 2 * padding[0], w + 2 * padding[1])


class Conv2D(Function):
    """2-d convolution of ``x`` ``(N, C, H, W)`` with ``weight`` ``(O, C, KH, KW)``, plus a
    per-channel ``bias``; with ``act``, the bias and activation run as one fused kernel
    (``fuse_elewise_add_act_ops``)."""

    op_type = "conv2d"

    def forward(self, x, weight, bias, stride, padding, act=None):
        kernel = weight.shape[2:]
        oh, ow = output_size("conv2d", x, kernel, stride, padding)
        n, out_channels = x.shape[0], weight.shape[0]
        self.x_shape, self.kernel, self.stride, self.padding = x.shape, kernel, stride, padding
        self.w = weight.reshape(out_channels, -1)
        windows = _windows(_pad(x, padding), kernel, stride)
        self.cols = windows.transpose(0, 2, 3, 1, 4, 5).reshape(n * oh * ow, -1)
        y = matmul_arrays(self.cols, self.w.T).reshape(n, oh, ow, out_channels)
        y = y.transpose(0, 3, 1, 2)
        self.act = act
        if act is not None:
            self.y, self.pre = kernels.bias_act_forward(y, bias, act)
            return self.y
        if bias is not None:
            y = y + bias.reshape(1, -1, 1, 1)
        return y

    def backward(self, dy):
        xp = backend.array_module()
        if self.act is not None:
            dy = kernels.bias_act_backward(dy, self.y, self.pre, self.act)
        n, c, h, w = self.x_shape
        oh, ow = dy.shape[2:]
        out_channels = self.w.shape[0]
        dym = dy.transpose(0, 2, 3, 1).reshape(-1, out_channels)
        needs = self.needs_input_grad
        dweight = matmul_arrays(dym.T, self.cols).reshape((out_channels, c) + self.kernel) \
            if needs[1] else None
        dbias = dym.sum(axis=0) if needs[2] else None
        dx = None
        if needs[0]:
            dcols = matmul_arrays(dym, self.w)
            dwin = dcols.reshape(n, oh, ow, c, *self.kernel).transpose(0, 3, 1, 2, 4, 5)
            dxp = _scatter_windows(dwin, _padded_shape(self.x_shape, self.padding),
                                   self.kernel, self.stride, xp, dy.dtype)
            dx = _crop(dxp, self.padding, self.x_shape)
        return dx, dweight, dbias, None, None, None


class MaxPool2D(Function):
    """Maximum over each window; padding counts as minus infinity."""

    op_type = "pool2d"

    def forward(self, x, kernel, stride, padding):
        oh, ow = output_size("max_pool2d", x, kernel, stride, padding)
        xp = backend.array_module()
        windows = _windows(_pad(x, padding, -np.inf), kernel, stride)
        flat = windows.reshape(x.shape[0], x.shape[1], oh, ow, -1)
        self.argmax = flat.argmax(axis=-1)
        self.x_shape, self.kernel, self.stride, self.padding = x.shape, kernel, stride, padding
        return xp.take_along_axis(flat, self.argmax[..., None], axis=-1)[..., 0]

    def backward(self, dy):
        xp = backend.array_module()
        kh, kw = self.kernel
        onehot = self.argmax[..., None] == xp.arange(kh * kw)
        dwin = (dy[..., None] * onehot).reshape(dy.shape + (kh, kw))
        dxp = _scatter_windows(dwin, _padded_shape(self.x_shape, self.padding), self.kernel,
                               self.stride, xp, dy.dtype)
        return _crop(dxp, self.padding, self.x_shape), None, None, None


class AvgPool2D(Function):
    """Mean over each window; with padding, the mean is over the window's real inputs only
    (Paddle's ``exclusive=True``)."""

    op_type = "pool2d"

    def forward(self, x, kernel, stride, padding):
        output_size("avg_pool2d", x, kernel, stride, padding)
        xp = backend.array_module()
        windows = _windows(_pad(x, padding), kernel, stride)
        ones = xp.ones((1, 1) + x.shape[2:], dtype=x.dtype)
        self.count = _windows(_pad(ones, padding), kernel, stride).sum(axis=(-2, -1))
        self.x_shape, self.kernel, self.stride, self.padding = x.shape, kernel, stride, padding
        return windows.sum(axis=(-2, -1)) / self.count

    def backward(self, dy):
        xp = backend.array_module()
        share = dy / self.count
        dwin = xp.broadcast_to(share[..., None, None], share.shape + self.kernel)
        dxp = _scatter_windows(dwin, _padded_shape(self.x_shape, self.padding), self.kernel,
                               self.stride, xp, dy.dtype)
        return _crop(dxp, self.padding, self.x_shape), None, None, None


class GlobalAvgPool(Function):
    """Mean over the spatial axes: ``(N, C, H, W)`` to ``(N, C)``."""

    op_type = "pool2d"

    def forward(self, x):
        self.x_shape = x.shape
        return x.mean(axis=(2, 3))

    def backward(self, dy):
        n, c, h, w = self.x_shape
        xp = backend.array_module()
        return xp.broadcast_to((dy / (h * w))[:, :, None, None], self.x_shape)


def pair(name, value, minimum=1):
    """``value`` as a pair of integers ``>= minimum`` (an integer means the same twice)."""
    values = (value, value) if isinstance(value, (int, np.integer)) else tuple(value)
    if (len(values) != 2 or any(not isinstance(v, (int, np.integer)) or isinstance(v, bool)
                                or v < minimum for v in values)):
        raise ValueError(f"{name} must be an integer >= {minimum} or a pair of them, "
                         f"not {value!r}")
    return tuple(int(v) for v in values)


def _check_4d(what, x):
    if x.ndim != 4:
        raise ValueError(f"{what} expects a 4-d (N, C, H, W) input, got shape {tuple(x.shape)}")


def conv2d(x, weight, bias=None, stride=1, padding=0, act=None):
    """2-d convolution (NCHW); ``act`` fuses a bias and an activation into the output."""
    _check_4d("conv2d", x)
    return Conv2D.apply(x, weight, bias, pair("stride", stride),
                        pair("padding", padding, minimum=0), act)


def _pool_args(kernel_size, stride, padding):
    kernel = pair("kernel_size", kernel_size)
    stride = kernel if stride is None else pair("stride", stride)
    padding = pair("padding", padding, minimum=0)
    if any(p > k // 2 for p, k in zip(padding, kernel)):
        raise ValueError(f"pooling padding {padding} must be at most half the kernel size "
                         f"{kernel}")
    return kernel, stride, padding


def max_pool2d(x, kernel_size, stride=None, padding=0):
    _check_4d("max_pool2d", x)
    return MaxPool2D.apply(x, *_pool_args(kernel_size, stride, padding))


def avg_pool2d(x, kernel_size, stride=None, padding=0):
    _check_4d("avg_pool2d", x)
    return AvgPool2D.apply(x, *_pool_args(kernel_size, stride, padding))


def adaptive_avg_pool2d(x, output_size):
    """Mean pooling to ``output_size``; sizes that divide the input's (1 included, the global
    mean) are supported."""
    _check_4d("adaptive_avg_pool2d", x)
    out = pair("output_size", output_size)
    h, w = x.shape[2:]
    if out == (1, 1):
        return GlobalAvgPool.apply(x).reshape(x.shape[0], x.shape[1], 1, 1)
    if h % out[0] or w % out[1]:
        raise ValueError(f"adaptive_avg_pool2d to {out} needs it to divide the input's "
                         f"spatial size {(h, w)}")
    kernel = (h // out[0], w // out[1])
    return AvgPool2D.apply(x, kernel, kernel, (0, 0))


def global_avg_pool(x):
    """``(N, C, H, W)`` to ``(N, C)``, the mean over the spatial axes."""
    _check_4d("global_avg_pool", x)
    return GlobalAvgPool.apply(x)

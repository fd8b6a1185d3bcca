"""Convolution and pooling over NCHW images.

A convolution is one batched matrix product per call, of each sample's columns
``(OH*OW, C*KH*KW)`` (im2col, read transposed) and the weight: the orientation OpenBLAS runs
fastest for these shapes; the result is put back into NCHW order. The columns are written
kernel offset by kernel offset, each a strided slice of the input, with the slices that fall
into the padding set to zero instead of padding the input first. Backward's input gradient is
the transpose product, added back offset by offset into the parts of the input each offset saw
(col2im), with the same ranges; both poolings use the same col2im. A 1x1 convolution without
padding needs no columns: the input (strided, for stride 2) is its own column matrix.
"""
import numpy as np

from ...core import backend
from ... import kernels
from ...kernels.products import matmul_arrays
from ...autograd import Function
from . import cudnn, cudnn_ops


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


def _offset_range(out_size, in_size, offset, stride, pad):
    """For kernel offset ``offset`` along one axis: the outputs ``[lo, hi)`` whose input
    ``o * stride + offset - pad`` lies inside the unpadded input, and that input's slice."""
    lo = max(0, -((offset - pad) // stride))
    hi = max(lo, min(out_size, (in_size - 1 - offset + pad) // stride + 1))
    first = lo * stride + offset - pad
    return lo, hi, slice(first, first + (hi - lo - 1) * stride + 1 if hi > lo else first, stride)


def _offsets(x_shape, out_shape, kernel, stride, padding):
    """Each kernel offset ``(i, j)`` with its output ranges and input slices."""
    for i in range(kernel[0]):
        ylo, yhi, ys = _offset_range(out_shape[0], x_shape[2], i, stride[0], padding[0])
        for j in range(kernel[1]):
            xlo, xhi, xs = _offset_range(out_shape[1], x_shape[3], j, stride[1], padding[1])
            yield i, j, (ylo, yhi, xlo, xhi), (ys, xs)


def im2col(x, kernel, stride, padding, out_shape):
    """The columns ``(N, C, KH, KW, OH, OW)`` of ``x``: entry ``[n, c, i, j, oy, ox]`` is the
    input under kernel offset ``(i, j)`` of output ``(oy, ox)``, zero in the padding."""
    n, c = x.shape[:2]
    oh, ow = out_shape
    cols = backend.array_module().empty((n, c) + tuple(kernel) + (oh, ow), dtype=x.dtype)
    for i, j, (ylo, yhi, xlo, xhi), (ys, xs) in _offsets(x.shape, out_shape, kernel, stride,
                                                         padding):
        part = cols[:, :, i, j]
        part[:, :, :ylo] = 0
        part[:, :, yhi:] = 0
        part[:, :, ylo:yhi, :xlo] = 0
        part[:, :, ylo:yhi, xhi:] = 0
        part[:, :, ylo:yhi, xlo:xhi] = x[:, :, ys, xs]
    return cols


def col2im(dcols, x_shape, kernel, stride, padding):
    """The input gradient from the columns' gradient ``(N, C, KH, KW, OH, OW)``: each offset's
    part added into the inputs it came from (the adjoint of ``im2col``)."""
    dx = backend.array_module().zeros(x_shape, dtype=dcols.dtype)
    for i, j, (ylo, yhi, xlo, xhi), (ys, xs) in _offsets(x_shape, dcols.shape[4:], kernel,
                                                         stride, padding):
        dx[:, :, ys, xs] += dcols[:, :, i, j, ylo:yhi, xlo:xhi]
    return dx


def _is_pointwise(kernel, padding):
    return tuple(kernel) == (1, 1) and tuple(padding) == (0, 0)


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
        if _is_pointwise(kernel, padding):
            strided = x if stride == (1, 1) else x[:, :, ::stride[0], ::stride[1]]
            cols = backend.array_module().ascontiguousarray(strided)
        else:
            cols = im2col(x, kernel, stride, padding, (oh, ow))
        self.cols = cols.reshape(n, -1, oh * ow)
        y = backend.array_module().ascontiguousarray(
            matmul_arrays(self.cols.transpose(0, 2, 1), self.w.T).transpose(0, 2, 1))
        y = y.reshape(n, out_channels, oh, ow)
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
        n, c = self.x_shape[:2]
        oh, ow = dy.shape[2:]
        out_channels = self.w.shape[0]
        dy3 = xp.ascontiguousarray(dy).reshape(n, out_channels, oh * ow)
        needs = self.needs_input_grad
        dweight = dbias = dx = None
        if needs[1]:
            per_sample = matmul_arrays(self.cols, dy3.transpose(0, 2, 1))
            dweight = per_sample.sum(axis=0).T.reshape((out_channels, c) + self.kernel)
        if needs[2]:
            dbias = dy3.sum(axis=(0, 2))
        if needs[0]:
            dcols = matmul_arrays(self.w.T, dy3)
            if not _is_pointwise(self.kernel, self.padding):
                dx = col2im(dcols.reshape((n, c) + self.kernel + (oh, ow)), self.x_shape,
                            self.kernel, self.stride, self.padding)
            elif self.stride == (1, 1):
                dx = dcols.reshape(self.x_shape)
            else:
                dx = xp.zeros(self.x_shape, dtype=dcols.dtype)
                dx[:, :, ::self.stride[0], ::self.stride[1]] = dcols.reshape(n, c, oh, ow)
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
        offsets = xp.arange(kh * kw).reshape(1, 1, kh * kw, 1, 1)
        dcols = dy[:, :, None] * (self.argmax[:, :, None] == offsets)
        dcols = dcols.reshape(dy.shape[:2] + (kh, kw) + dy.shape[2:])
        return col2im(dcols, self.x_shape, self.kernel, self.stride, self.padding), None, None, \
            None


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
        dcols = xp.broadcast_to(share[:, :, None, None],
                                share.shape[:2] + self.kernel + share.shape[2:])
        return col2im(dcols, self.x_shape, self.kernel, self.stride, self.padding), None, None, \
            None


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
    """2-d convolution (NCHW); ``act`` fuses a bias and an activation into the output. Through
    cuDNN where it has an engine for the shapes (``cudnn_ops.py``), else as im2col and a
    matrix product."""
    _check_4d("conv2d", x)
    stride, padding = pair("stride", stride), pair("padding", padding, minimum=0)
    dtype = cudnn.operation_dtype(Conv2D.op_type, x, weight, bias)
    if dtype is not None:
        out_shape = output_size("conv2d", x, weight.shape[2:], stride, padding)
        plans = cudnn_ops.conv_plans(x.shape, weight.shape, dtype, stride, padding, out_shape)
        if plans is not None:
            return cudnn_ops.CudnnConv2D.apply(x, weight, bias, plans, act=act)
    return Conv2D.apply(x, weight, bias, stride, padding, act)


def _pool_args(kernel_size, stride, padding):
    kernel = pair("kernel_size", kernel_size)
    stride = kernel if stride is None else pair("stride", stride)
    padding = pair("padding", padding, minimum=0)
    if any(p > k // 2 for p, k in zip(padding, kernel)):
        raise ValueError(f"pooling padding {padding} must be at most half the kernel size "
                         f"{kernel}")
    return kernel, stride, padding


def _pool(what, x, kernel, stride, padding):
    """Pooling ``what`` (``"max_pool2d"`` or ``"avg_pool2d"``) over strided windows."""
    function = MaxPool2D if what == "max_pool2d" else AvgPool2D
    return function.apply(x, kernel, stride, padding)


def max_pool2d(x, kernel_size, stride=None, padding=0):
    _check_4d("max_pool2d", x)
    return _pool("max_pool2d", x, *_pool_args(kernel_size, stride, padding))


def avg_pool2d(x, kernel_size, stride=None, padding=0):
    _check_4d("avg_pool2d", x)
    return _pool("avg_pool2d", x, *_pool_args(kernel_size, stride, padding))


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
    return _pool("avg_pool2d", x, kernel, kernel, (0, 0))


def global_avg_pool(x):
    """``(N, C, H, W)`` to ``(N, C)``, the mean over the spatial axes."""
    _check_4d("global_avg_pool", x)
    return GlobalAvgPool.apply(x)

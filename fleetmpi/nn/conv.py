"""Convolution and pooling layers over NCHW images (the math is in
``fleetmpi.nn.functional.conv``)."""
import math

from . import functional as F
from . import initializer
from .functional.conv import pair
from .layer import Layer
from .param_attr import needed, to_attr
from .basic_layers import check_input, check_positive_int


class Conv2D(Layer):
    """2-d convolution, ``weight`` of shape ``(out_channels, in_channels, KH, KW)``,
    Kaiming-normal initialised; optional per-channel ``bias`` starting at zero."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0,
                 weight_attr=None, bias_attr=None, name=None, dtype=None):
        super().__init__(dtype, name)
        self.in_channels = check_positive_int("in_channels", in_channels)
        self.out_channels = check_positive_int("out_channels", out_channels)
        self.kernel_size = pair("kernel_size", kernel_size)
        self.stride = pair("stride", stride)
        self.padding = pair("padding", padding, minimum=0)
        fan_in = in_channels * self.kernel_size[0] * self.kernel_size[1]
        self.weight = self.create_parameter(
            (out_channels, in_channels) + self.kernel_size, needed(weight_attr, "weight_attr"),
            default_initializer=initializer.Normal(0.0, math.sqrt(2.0 / fan_in)))
        self.bias = self.create_parameter((out_channels,), to_attr(bias_attr, "bias_attr"),
                                          is_bias=True)

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, bias={self.bias is not None}")

    def forward(self, x):
        check_input(self, x, 4, self.in_channels)
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding)

    def forward_act(self, x, act):
        """Fused ``act(conv(x) + bias)`` (``fuse_elewise_add_act_ops``)."""
        check_input(self, x, 4, self.in_channels)
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, act)


class _Pool2D(Layer):
    function = None

    def __init__(self, kernel_size, stride=None, padding=0):
        super().__init__()
        self.kernel_size = pair("kernel_size", kernel_size)
        self.stride = self.kernel_size if stride is None else pair("stride", stride)
        self.padding = pair("padding", padding, minimum=0)
        if any(p > k // 2 for p, k in zip(self.padding, self.kernel_size)):
            raise ValueError(f"{type(self).__name__}: padding {self.padding} must be at most "
                             f"half the kernel size {self.kernel_size}")

    def extra_repr(self):
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"

    def forward(self, x):
        check_input(self, x, 4)
        return type(self).function(x, self.kernel_size, self.stride, self.padding)


class MaxPool2D(_Pool2D):
    """Maximum over each window; padding counts as minus infinity."""

    function = staticmethod(F.max_pool2d)


class AvgPool2D(_Pool2D):
    """Mean over each window; with padding, the mean is over the window's real inputs only
    (Paddle's ``exclusive=True``)."""

    function = staticmethod(F.avg_pool2d)


class GlobalAvgPool(Layer):
    """Mean over the spatial axes: ``(N, C, H, W)`` to ``(N, C)``."""

    def forward(self, x):
        check_input(self, x, 4)
        return F.global_avg_pool(x)


class AdaptiveAvgPool2D(Layer):
    def __init__(self, output_size):
        super().__init__()
        self.output_size = pair("output_size", output_size)

    def forward(self, x):
        return F.adaptive_avg_pool2d(x, self.output_size)

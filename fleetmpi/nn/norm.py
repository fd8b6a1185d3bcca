"""Batch normalization over axis 1 (features of ``(N, C)``, channels of ``(N, C, ...)``)."""
import numpy as np

from .. import backend, kernels
from ..kernels import reference
from .layer import Layer
from .layers import check_input, check_positive_int


class BatchNorm(Layer):
    """``weight * (x - mean) / sqrt(var + epsilon) + bias`` with batch statistics while training
    and running statistics in eval mode; ``running = momentum * running + (1 - momentum) *
    batch`` (Paddle's convention; the variance is the biased batch variance)."""

    input_ndims = (2, 3, 4)

    def __init__(self, num_features, momentum=0.9, epsilon=1e-5, dtype=None):
        super().__init__(dtype)
        self.num_features = check_positive_int("num_features", num_features)
        if not 0 <= momentum <= 1:
            raise ValueError(f"BatchNorm momentum must lie in [0, 1], not {momentum!r}")
        if not epsilon > 0:
            raise ValueError(f"BatchNorm epsilon must be positive, not {epsilon!r}")
        self.momentum = float(momentum)
        self.epsilon = float(epsilon)
        self.create_parameter("weight", np.ones(num_features))
        self.create_parameter("bias", np.zeros(num_features))
        self.create_buffer("running_mean", np.zeros(num_features))
        self.create_buffer("running_var", np.ones(num_features))

    def extra_repr(self):
        return f"{self.num_features}, momentum={self.momentum}, epsilon={self.epsilon}"

    def _statistics(self, x):
        check_input(self, x, self.input_ndims, self.num_features)
        xp = backend.array_module()
        self._axes = (0,) + tuple(range(2, x.ndim))
        self._count = x.size // self.num_features
        if self.training:
            mean = x.mean(axis=self._axes)
            var = x.var(axis=self._axes)
            for name, batch in (("running_mean", mean), ("running_var", var)):
                running = self._buffers[name]
                running *= self.momentum
                running += (1 - self.momentum) * batch
        else:
            mean, var = self._buffers["running_mean"], self._buffers["running_var"]
        self._mean = mean
        self._invstd = 1.0 / xp.sqrt(var + self.epsilon)
        return mean, self._invstd

    def forward(self, x):
        mean, invstd = self._statistics(x)
        self._xhat, y = reference.bn_normalize(x, mean, invstd, self.weight.data,
                                               self.bias.data)
        return y

    def forward_act(self, x, act):
        """Fused ``relu(batch_norm(x))`` (``fuse_bn_act_ops``); only ``relu`` fuses."""
        if act != "relu":
            raise ValueError(f"fuse_bn_act_ops fuses batch norm with relu only, not {act!r}")
        mean, invstd = self._statistics(x)
        self._x = x
        self._y = kernels.bn_act_forward(x, mean, invstd, self.weight.data, self.bias.data)
        return self._y

    def _backward(self, dz, input_grad):
        xhat = self._xhat
        sum_dz = dz.sum(axis=self._axes)
        sum_dz_xhat = (dz * xhat).sum(axis=self._axes)
        self.weight.grad[...] = sum_dz_xhat
        self.bias.grad[...] = sum_dz
        if not input_grad:
            return None
        if not self.training:
            nd = dz.ndim
            return dz * reference.per_channel(self.weight.data * self._invstd, nd)
        return kernels.bn_input_grad(dz, xhat, self._invstd, self.weight.data, sum_dz,
                                     sum_dz_xhat, self._count)

    def backward_act(self, dy, act, input_grad=True):
        self._xhat = reference.bn_xhat(self._x, self._mean, self._invstd)
        return self._backward(kernels.bn_act_backward_mask(dy, self._y), input_grad)


class BatchNorm1D(BatchNorm):
    """Batch norm of ``(N, C)`` or ``(N, C, L)`` inputs."""

    input_ndims = (2, 3)


class BatchNorm2D(BatchNorm):
    """Batch norm of ``(N, C, H, W)`` inputs."""

    input_ndims = (4,)

"""Batch normalization over axis 1 (features of ``(N, C)``, channels of ``(N, C, ...)``), with
statistics over this process's batch or, through a communicator, over the global batch of all
ranks (``sync_batch_norm``), and layer normalization (the math is in
``fleetmpi.nn.functional.norm``)."""
import numpy as np

from . import functional as F
from . import initializer
from .layer import Layer
from .param_attr import fixed_when_false
from .basic_layers import check_input, check_positive_int


def _scale_and_shift(layer, shape, weight_attr, bias_attr):
    """A norm layer's ``weight`` (ones) and ``bias`` (zeros); an attr False makes that one a
    constant that is not trained, as Paddle's batch norm does."""
    weight = layer.create_parameter(shape, fixed_when_false(weight_attr, "weight_attr"),
                                    default_initializer=initializer.Constant(1.0))
    bias = layer.create_parameter(shape, fixed_when_false(bias_attr, "bias_attr"), is_bias=True)
    return weight, bias


class BatchNorm(Layer):
    """``weight * (x - mean) / sqrt(var + epsilon) + bias`` with batch statistics while training
    and running statistics in eval mode; ``running = momentum * running + (1 - momentum) *
    batch`` (Paddle's convention; the variance is the biased batch variance).

    ``sync_communicator``: None (the default) normalizes over this process's batch. A
    ``fleetmpi.comm.Communicator`` (the ``sync_batch_norm`` strategy sets it for each step)
    makes a training step normalize over the batch of all its ranks together, which may hold
    different numbers of rows, none included. Eval mode never communicates.

    The running statistics are the buffers ``_mean`` and ``_variance``: Paddle's names, so a
    ``state_dict`` moves between the two (PyTorch calls them ``running_mean`` and
    ``running_var``)."""

    input_ndims = (2, 3, 4)

    def __init__(self, num_features, momentum=0.9, epsilon=1e-5, weight_attr=None,
                 bias_attr=None, name=None, dtype=None):
        super().__init__(dtype, name)
        self.num_features = check_positive_int("num_features", num_features)
        if not 0 <= momentum <= 1:
            raise ValueError(f"BatchNorm momentum must lie in [0, 1], not {momentum!r}")
        if not epsilon > 0:
            raise ValueError(f"BatchNorm epsilon must be positive, not {epsilon!r}")
        self.momentum = float(momentum)
        self.epsilon = float(epsilon)
        self.sync_communicator = None
        self.weight, self.bias = _scale_and_shift(self, (num_features,), weight_attr, bias_attr)
        self.register_buffer("_mean", np.zeros(num_features, dtype=self.dtype))
        self.register_buffer("_variance", np.ones(num_features, dtype=self.dtype))

    def extra_repr(self):
        return f"{self.num_features}, momentum={self.momentum}, epsilon={self.epsilon}"

    def _normalize(self, x, act):
        check_input(self, x, self.input_ndims, self.num_features)
        return F.batch_norm(x, self._buffers["_mean"], self._buffers["_variance"],
                            self.weight, self.bias, self.training, self.momentum, self.epsilon,
                            self.sync_communicator if self.training else None, act)

    def forward(self, x):
        return self._normalize(x, None)

    def forward_act(self, x, act):
        """Fused ``relu(batch_norm(x))`` (``fuse_bn_act_ops``); only ``relu`` fuses."""
        return self._normalize(x, act)


class BatchNorm1D(BatchNorm):
    """Batch norm of ``(N, C)`` or ``(N, C, L)`` inputs."""

    input_ndims = (2, 3)


class BatchNorm2D(BatchNorm):
    """Batch norm of ``(N, C, H, W)`` inputs."""

    input_ndims = (4,)


class BatchNorm3D(BatchNorm):
    """Batch norm of ``(N, C, D, H, W)`` inputs."""

    input_ndims = (5,)


class LayerNorm(Layer):
    """Normalization of each sample over its trailing ``normalized_shape`` axes, with a learned
    ``weight`` (ones) and ``bias`` (zeros) of that shape."""

    def __init__(self, normalized_shape, epsilon=1e-5, weight_attr=None, bias_attr=None,
                 name=None, dtype=None):
        super().__init__(dtype, name)
        shape = (normalized_shape,) if isinstance(normalized_shape, (int, np.integer)) \
            else tuple(normalized_shape)
        self.normalized_shape = tuple(check_positive_int("normalized_shape", n) for n in shape)
        self.epsilon = float(epsilon)
        self.weight, self.bias = _scale_and_shift(self, self.normalized_shape, weight_attr,
                                                  bias_attr)

    def extra_repr(self):
        return f"{list(self.normalized_shape)}, epsilon={self.epsilon}"

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.epsilon)

"""Initializers for ``Layer.create_parameter`` (``fleetmpi.nn.initializer``, Paddle's names).

Each is called with the parameter's shape and returns host values drawn from the shared
generator, so every rank builds the same initial model."""
import math

import numpy as np

from .. import backend


def _fans(shape):
    """``(fan_in, fan_out)`` of a weight: ``(in, out)`` for a 2-d Linear weight (Paddle's
    layout), ``(in_channels * kernel, out_channels * kernel)`` for a convolution's."""
    if len(shape) < 2:
        return shape[0] if shape else 1, shape[0] if shape else 1
    if len(shape) == 2:
        return shape[0], shape[1]
    receptive = int(np.prod(shape[2:]))
    return shape[1] * receptive, shape[0] * receptive


class Constant:
    def __init__(self, value=0.0):
        self.value = float(value)

    def __call__(self, shape):
        return np.full(shape, self.value)


class Normal:
    def __init__(self, mean=0.0, std=1.0):
        self.mean, self.std = float(mean), float(std)

    def __call__(self, shape):
        return self.mean + self.std * backend.shared_rng().standard_normal(shape)


class Uniform:
    def __init__(self, low=-1.0, high=1.0):
        self.low, self.high = float(low), float(high)

    def __call__(self, shape):
        return backend.shared_rng().uniform(self.low, self.high, shape)


class XavierUniform:
    def __call__(self, shape):
        fan_in, fan_out = _fans(shape)
        bound = math.sqrt(6.0 / (fan_in + fan_out))
        return backend.shared_rng().uniform(-bound, bound, shape)


class XavierNormal:
    def __call__(self, shape):
        fan_in, fan_out = _fans(shape)
        return math.sqrt(2.0 / (fan_in + fan_out)) * backend.shared_rng().standard_normal(shape)


class KaimingNormal:
    def __call__(self, shape):
        fan_in, _ = _fans(shape)
        return math.sqrt(2.0 / fan_in) * backend.shared_rng().standard_normal(shape)

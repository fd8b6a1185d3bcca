"""Initializers for ``Layer.create_parameter`` (``fleetmpi.nn.initializer``, Paddle's names).

Each is called with the parameter's shape and returns host values drawn from the shared
generator, so every rank builds the same initial model.

The values are a stream in the parameter's flat (C) order: ``draw(shape, rng, count)`` gives
the next ``count`` of them from ``rng`` and ``skip(shape, rng, count)`` moves ``rng`` past
them, so a model built under ``LazyGuard`` can produce any range of a parameter in bounded
pieces, equal bit for bit to the whole draw (NumPy's generators fill an array element after
element, so pieces drawn one after another are the whole array's)."""
import math

import numpy as np

from ..core.paddle_names import module_getattr as _module_getattr
from ..core import backend

# The most elements ``skip`` draws at once where it cannot jump (normal draws reject some
# candidates, so their count is only known by drawing).
SKIP_CHUNK = 1 << 18


def _fans(shape):
    """``(fan_in, fan_out)`` of a weight: ``(in, out)`` for a 2-d Linear weight (Paddle's
    layout), ``(in_channels * kernel, out_channels * kernel)`` for a convolution's."""
    if len(shape) < 2:
        return shape[0] if shape else 1, shape[0] if shape else 1
    if len(shape) == 2:
        return shape[0], shape[1]
    receptive = int(np.prod(shape[2:]))
    return shape[1] * receptive, shape[0] * receptive


class Initializer:
    """Base of the initializers: ``__call__(shape)`` draws the whole parameter from the
    shared generator; subclasses define ``draw``."""

    def __call__(self, shape):
        return self.draw(shape, backend.shared_rng(), int(np.prod(shape))).reshape(shape)

    def draw(self, shape, rng, count):
        """The next ``count`` values (float64, 1-d) of a parameter of ``shape`` from ``rng``."""
        raise NotImplementedError(f"{type(self).__name__} does not define draw")

    def skip(self, shape, rng, count):
        """Move ``rng`` past the next ``count`` values of a parameter of ``shape``."""
        for begin in range(0, count, SKIP_CHUNK):
            self.draw(shape, rng, min(SKIP_CHUNK, count - begin))


class _UniformDraws(Initializer):
    """An initializer of uniform draws, one 64-bit output of the generator each, so ``skip``
    jumps (``advance``) instead of drawing."""

    def bounds(self, shape):
        raise NotImplementedError(f"{type(self).__name__} does not define bounds")

    def draw(self, shape, rng, count):
        low, high = self.bounds(shape)
        return rng.uniform(low, high, count)

    def skip(self, shape, rng, count):
        rng.bit_generator.advance(count)


class Constant(Initializer):
    def __init__(self, value=0.0):
        self.value = float(value)

    def draw(self, shape, rng, count):
        return np.full(count, self.value)

    def skip(self, shape, rng, count):
        pass


class Normal(Initializer):
    def __init__(self, mean=0.0, std=1.0):
        self.mean, self.std = float(mean), float(std)

    def draw(self, shape, rng, count):
        return self.mean + self.std * rng.standard_normal(count)


class Uniform(_UniformDraws):
    def __init__(self, low=-1.0, high=1.0):
        self.low, self.high = float(low), float(high)

    def bounds(self, shape):
        return self.low, self.high


class XavierUniform(_UniformDraws):
    def bounds(self, shape):
        fan_in, fan_out = _fans(shape)
        bound = math.sqrt(6.0 / (fan_in + fan_out))
        return -bound, bound


class XavierNormal(Initializer):
    def draw(self, shape, rng, count):
        fan_in, fan_out = _fans(shape)
        return math.sqrt(2.0 / (fan_in + fan_out)) * rng.standard_normal(count)


class KaimingNormal(Initializer):
    def draw(self, shape, rng, count):
        fan_in, _ = _fans(shape)
        return math.sqrt(2.0 / fan_in) * rng.standard_normal(count)


class Assign:
    """Paddle's ``Assign(value, name=None)``: the parameter takes ``value`` (an array, a list
    or a Tensor of the parameter's shape), the same on every rank; no draw from the shared
    generator."""

    def __init__(self, value, name=None):
        value = getattr(value, "data", value)
        self.value = backend.to_numpy(value) if hasattr(value, "shape") else np.asarray(value)

    def __call__(self, shape):
        if tuple(self.value.shape) != tuple(shape):
            raise ValueError(f"Assign holds a value of shape {tuple(self.value.shape)}, but the "
                             f"parameter has shape {tuple(shape)}")
        return self.value.copy()


def part_values(init, full_shape, index):
    """The initial values of the part ``index`` (an index into the whole parameter) that a rank
    of a model-parallel group holds of a parameter of ``full_shape``. An ``Assign`` is applied
    to the part, as Paddle's tensor-parallel layers apply their ``weight_attr``: it holds the
    rank's part (the whole parameter, which is cut, is taken too). Any other initializer draws
    the whole parameter, the serial layer's draws, and the part is cut from them: the ranks'
    parts differ as the per-rank seeds make them differ in Paddle, and a model built from a
    seed starts as the serial model does."""
    full_shape = tuple(full_shape)
    if isinstance(init, Assign):
        shape = np.broadcast_to(np.int8(0), full_shape)[index].shape
        if init.value.shape == shape:
            return init(shape)
        if init.value.shape != full_shape:
            raise ValueError(f"Assign holds a value of shape {init.value.shape}, but this "
                             f"rank's part of the parameter has shape {shape} (of the whole "
                             f"{full_shape}); give the rank's part, as Paddle takes it")
    return init(full_shape)[index]


# A name Paddle has and fleetmpi lacks raises an error that says so (core.paddle_names).
__getattr__ = _module_getattr(__name__, "paddle.nn.initializer", globals())

"""Paddle's top-level tensor creation functions that hybrid scripts use: ``randn``, ``rand``
and ``create_parameter``.

``randn`` and ``rand`` draw from the shared generator (``backend.shared_rng``, seeded by
``fleet.seed`` alone), so every rank draws the same values, as Paddle's global generator does
after ``paddle.seed``.
"""
import numpy as np

from ..core import backend
from ..autograd import Tensor
from .layer import Layer, _check_float_dtype, get_default_dtype
from .param_attr import ParamAttr


def _shape(shape, where):
    values = getattr(shape, "data", shape)
    if hasattr(values, "shape"):
        values = backend.to_numpy(values)
    shape = tuple(int(n) for n in np.atleast_1d(values))
    if any(n < 0 for n in shape):
        raise ValueError(f"{where} shape {shape} must have sizes >= 0")
    return shape


def _drawn(values, dtype):
    dtype = get_default_dtype() if dtype is None else _check_float_dtype(dtype)
    return Tensor(backend.asarray(values.astype(dtype)))


def randn(shape, dtype=None, name=None):
    """A tensor of ``shape`` drawn from the standard normal distribution (``dtype``: the
    default float dtype when None; ``name`` names nothing here)."""
    return _drawn(backend.shared_rng().standard_normal(_shape(shape, "randn")), dtype)


def rand(shape, dtype=None, name=None):
    """A tensor of ``shape`` drawn uniformly from [0, 1)."""
    return _drawn(backend.shared_rng().random(_shape(shape, "rand")), dtype)


def create_parameter(shape, dtype, name=None, attr=None, is_bias=False,
                     default_initializer=None):
    """Paddle's ``paddle.create_parameter``: a ``Parameter`` as ``Layer.create_parameter``
    makes it (``attr``, ``is_bias``, ``default_initializer`` alike; ``name`` names it when
    ``attr`` does not). Assign it to a layer's attribute to train it."""
    if name is not None and attr is None:
        attr = ParamAttr(name=name)
    return Layer(dtype=_check_float_dtype(dtype)).create_parameter(
        shape, attr=attr, dtype=dtype, is_bias=is_bias,
        default_initializer=default_initializer)

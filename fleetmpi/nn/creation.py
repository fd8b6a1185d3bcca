"""Paddle's top-level tensor creation functions: ``zeros``, ``ones``, ``full`` (and their
``_like`` forms), ``arange``, ``randn``, ``rand`` and ``create_parameter``. A dtype left None
is the default float dtype (``nn.set_default_dtype``), as in Paddle; ``arange`` of integers
gives int64.

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


def _dtype(dtype):
    return np.dtype(get_default_dtype() if dtype is None else dtype)


def full(shape, fill_value, dtype=None, name=None):
    """A tensor of ``shape`` holding ``fill_value`` everywhere."""
    xp = backend.array_module()
    return Tensor(xp.full(_shape(shape, "full"), fill_value, dtype=_dtype(dtype)))


def zeros(shape, dtype=None, name=None):
    return full(shape, 0, dtype)


def ones(shape, dtype=None, name=None):
    return full(shape, 1, dtype)


def full_like(x, fill_value, dtype=None, name=None):
    """A tensor of ``x``'s shape (and dtype, unless ``dtype`` is given) holding
    ``fill_value``."""
    return full(tuple(x.shape), fill_value, x.dtype if dtype is None else dtype)


def zeros_like(x, dtype=None, name=None):
    return full_like(x, 0, dtype)


def ones_like(x, dtype=None, name=None):
    return full_like(x, 1, dtype)


def arange(start=0, end=None, step=1, dtype=None, name=None):
    """``start, start + step, ...`` below ``end`` (``arange(n)``: 0 to n - 1); int64 when
    every bound is an integer and ``dtype`` is None, else the default float dtype."""
    if end is None:
        start, end = 0, start
    if step == 0:
        raise ValueError("arange step must not be 0")
    if dtype is None:
        whole = all(isinstance(v, (int, np.integer)) for v in (start, end, step))
        dtype = np.int64 if whole else get_default_dtype()
    return Tensor(backend.array_module().arange(start, end, step, dtype=np.dtype(dtype)))


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

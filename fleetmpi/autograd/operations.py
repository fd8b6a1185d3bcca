"""The elementary differentiable operations and the Tensor operators built on them.

Arithmetic broadcasts as NumPy does; the engine sums a gradient back to the shape of the input
it belongs to, so each backward here returns gradients of the broadcast shape. Comparisons
give boolean tensors and no gradient. ``install_tensor_methods`` (run on import) gives
``Tensor`` its operators and methods, as Chainer installs its variable arithmetic.
"""
import numbers

import numpy as np

from ..core import backend
from ..kernels.products import matmul_arrays
from .function import Cast, Function
from .tensor import Tensor, as_array


def _xp():
    return backend.array_module()


def _swap_last(a):
    return a.swapaxes(-1, -2)


class Add(Function):
    op_type = "elementwise_add"

    def forward(self, a, b):
        return a + b

    def backward(self, dy):
        return dy, dy


class Sub(Function):
    op_type = "elementwise_sub"

    def forward(self, a, b):
        return a - b

    def backward(self, dy):
        return dy, (-dy if self.needs_input_grad[1] else None)


class Mul(Function):
    op_type = "elementwise_mul"

    def forward(self, a, b):
        self.a, self.b = a, b
        return a * b

    def backward(self, dy):
        da = dy * self.b if self.needs_input_grad[0] else None
        db = dy * self.a if self.needs_input_grad[1] else None
        return da, db


class Div(Function):
    op_type = "elementwise_div"

    def forward(self, a, b):
        self.a, self.b = a, b
        return a / b

    def backward(self, dy):
        da = dy / self.b if self.needs_input_grad[0] else None
        db = -dy * self.a / (self.b * self.b) if self.needs_input_grad[1] else None
        return da, db


class Neg(Function):
    op_type = "scale"

    def forward(self, a):
        return -a

    def backward(self, dy):
        return -dy


class Pow(Function):
    """``a ** exponent`` for a number ``exponent``."""

    op_type = "pow"

    def forward(self, a, exponent):
        self.a, self.exponent = a, exponent
        return a ** exponent

    def backward(self, dy):
        return dy * self.exponent * self.a ** (self.exponent - 1), None


class MatMul(Function):
    """``a @ b`` over the last two axes (leading axes broadcast), both at least 2-d."""

    op_type = "matmul"

    def forward(self, a, b):
        if a.ndim < 2 or b.ndim < 2:
            raise ValueError(f"matmul needs operands of at least 2 dimensions, got shapes "
                             f"{tuple(a.shape)} and {tuple(b.shape)}")
        self.a, self.b = a, b
        return matmul_arrays(a, b)

    def backward(self, dy):
        da = matmul_arrays(dy, _swap_last(self.b)) if self.needs_input_grad[0] else None
        db = matmul_arrays(_swap_last(self.a), dy) if self.needs_input_grad[1] else None
        return da, db


def _axes(axis, ndim):
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, numbers.Integral) else tuple(axis)
    return tuple(a % ndim if ndim else 0 for a in axes)


def _expand_reduced(dy, shape, axes, keepdims):
    if not keepdims:
        for a in sorted(axes):
            dy = _xp().expand_dims(dy, a)
    return dy


class Sum(Function):
    op_type = "reduce_sum"

    def forward(self, x, axis=None, keepdims=False):
        self.shape, self.axes, self.keepdims = x.shape, _axes(axis, x.ndim), keepdims
        return x.sum(axis=axis if axis is None else self.axes, keepdims=keepdims)

    def backward(self, dy):
        dy = _expand_reduced(dy, self.shape, self.axes, self.keepdims)
        return _xp().broadcast_to(dy, self.shape)


class Mean(Function):
    op_type = "reduce_mean"

    def forward(self, x, axis=None, keepdims=False):
        self.shape, self.axes, self.keepdims = x.shape, _axes(axis, x.ndim), keepdims
        self.count = int(np.prod([x.shape[a] for a in self.axes])) if x.ndim else 1
        return x.mean(axis=axis if axis is None else self.axes, keepdims=keepdims)

    def backward(self, dy):
        dy = _expand_reduced(dy, self.shape, self.axes, self.keepdims)
        return _xp().broadcast_to(dy / self.count, self.shape)


class Max(Function):
    """The maximum; its gradient is shared equally by the elements that reach it."""

    op_type = "reduce_max"

    def forward(self, x, axis=None, keepdims=False):
        self.axes, self.keepdims = _axes(axis, x.ndim), keepdims
        axis = axis if axis is None else self.axes
        y = x.max(axis=axis, keepdims=True)
        self.mask = x == y
        self.mask = self.mask / self.mask.sum(axis=axis, keepdims=True)
        return y if keepdims else y.reshape([n for i, n in enumerate(x.shape)
                                             if i not in self.axes])

    def backward(self, dy):
        dy = _expand_reduced(dy, self.mask.shape, self.axes, self.keepdims)
        return (dy * self.mask).astype(dy.dtype, copy=False)


class Exp(Function):
    op_type = "exp"

    def forward(self, x):
        self.y = _xp().exp(x)
        return self.y

    def backward(self, dy):
        return dy * self.y


class Log(Function):
    op_type = "log"

    def forward(self, x):
        self.x = x
        return _xp().log(x)

    def backward(self, dy):
        return dy / self.x


class Sqrt(Function):
    op_type = "sqrt"

    def forward(self, x):
        self.y = _xp().sqrt(x)
        return self.y

    def backward(self, dy):
        return dy / (2 * self.y)


class Tanh(Function):
    op_type = "tanh"

    def forward(self, x):
        self.y = _xp().tanh(x)
        return self.y

    def backward(self, dy):
        return dy * (1 - self.y * self.y)


class Sigmoid(Function):
    op_type = "sigmoid"

    def forward(self, x):
        xp = _xp()
        self.y = (xp.tanh(x * 0.5) + 1) * 0.5
        return self.y.astype(x.dtype, copy=False)

    def backward(self, dy):
        return dy * self.y * (1 - self.y)


class Abs(Function):
    op_type = "abs"

    def forward(self, x):
        self.sign = _xp().sign(x)
        return _xp().abs(x)

    def backward(self, dy):
        return dy * self.sign


class Clone(Function):
    op_type = "assign"

    def forward(self, a):
        return a.copy()

    def backward(self, dy):
        return dy


class Reshape(Function):
    op_type = "reshape2"

    def forward(self, x, shape):
        self.shape = x.shape
        return x.reshape(shape)

    def backward(self, dy):
        return dy.reshape(self.shape), None


class Transpose(Function):
    op_type = "transpose2"

    def forward(self, x, perm):
        self.perm = tuple(perm)
        return x.transpose(self.perm)

    def backward(self, dy):
        inverse = sorted(range(len(self.perm)), key=self.perm.__getitem__)
        return dy.transpose(inverse), None


def _is_advanced(index):
    parts = index if isinstance(index, tuple) else (index,)
    return any(hasattr(p, "shape") or isinstance(p, list) for p in parts)


class GetItem(Function):
    op_type = "slice"

    def forward(self, x, index):
        self.shape, self.dtype, self.index = x.shape, x.dtype, index
        return x[index]

    def backward(self, dy):
        xp = _xp()
        dx = xp.zeros(self.shape, dtype=dy.dtype)
        if _is_advanced(self.index):
            xp.add.at(dx, self.index, dy)
        else:
            dx[self.index] = dy
        return dx, None


class Concat(Function):
    op_type = "concat"

    def forward(self, *arrays, axis=0):
        self.axis = axis
        self.sizes = [a.shape[axis] for a in arrays]
        return _xp().concatenate(arrays, axis=axis)

    def backward(self, dy):
        bounds = np.cumsum(self.sizes)[:-1].tolist()
        return tuple(_xp().split(dy, bounds, axis=self.axis))


class Stack(Function):
    op_type = "stack"

    def forward(self, *arrays, axis=0):
        self.axis = axis
        return _xp().stack(arrays, axis=axis)

    def backward(self, dy):
        count = dy.shape[self.axis]
        return tuple(dy.take(i, axis=self.axis) for i in range(count))


class Split(Function):
    op_type = "split"

    def forward(self, x, bounds, axis):
        self.shape, self.dtype, self.axis, self.bounds = x.shape, x.dtype, axis, bounds
        return tuple(_xp().split(x, bounds, axis=axis))

    def backward(self, *grads):
        xp = _xp()
        pieces = []
        bounds = [0] + list(self.bounds) + [self.shape[self.axis]]
        for grad, start, stop in zip(grads, bounds[:-1], bounds[1:]):
            if grad is None:
                shape = list(self.shape)
                shape[self.axis] = stop - start
                grad = xp.zeros(shape, dtype=self.dtype)
            pieces.append(grad)
        return xp.concatenate(pieces, axis=self.axis), None, None

    @classmethod
    def of(cls, x, num_or_sections, axis):
        size = x.shape[axis]
        if isinstance(num_or_sections, numbers.Integral):
            if size % num_or_sections:
                raise ValueError(f"split: axis {axis} of size {size} does not divide into "
                                 f"{num_or_sections} equal parts")
            sections = [size // num_or_sections] * num_or_sections
        else:
            sections = list(num_or_sections)
            if int(np.sum(sections)) != size:   # this module's sum is the Tensor one
                raise ValueError(f"split: sections {sections} do not add up to the size "
                                 f"{size} of axis {axis}")
        bounds = np.cumsum(sections)[:-1].tolist()
        return list(cls.apply(x, bounds, axis))


# -- the public functions -------------------------------------------------------------------
def _tensor(value):
    return value if isinstance(value, Tensor) else Tensor(backend.asarray(value))


def add(x, y):
    return Add.apply(x, y)


def subtract(x, y):
    return Sub.apply(x, y)


def multiply(x, y):
    return Mul.apply(x, y)


def divide(x, y):
    return Div.apply(x, y)


def matmul(x, y, transpose_x=False, transpose_y=False, name=None):
    """``x @ y`` (Paddle's ``transpose_x``/``transpose_y`` swap the last two axes first;
    ``name``, Paddle's name of the output, names nothing here)."""
    if transpose_x:
        x = transpose_last(x)
    if transpose_y:
        y = transpose_last(y)
    return MatMul.apply(x, y)


def transpose_last(x):
    x = _tensor(x)
    perm = list(range(x.ndim))
    perm[-1], perm[-2] = perm[-2], perm[-1]
    return Transpose.apply(x, perm)


def _keep(keepdim, keepdims):
    return bool(keepdim or keepdims)


def sum(x, axis=None, keepdim=False, keepdims=False):  # noqa: A001 - Paddle's name
    return Sum.apply(x, axis, _keep(keepdim, keepdims))


def mean(x, axis=None, keepdim=False, keepdims=False):
    return Mean.apply(x, axis, _keep(keepdim, keepdims))


def max(x, axis=None, keepdim=False, keepdims=False):  # noqa: A001 - Paddle's name
    return Max.apply(x, axis, _keep(keepdim, keepdims))


def exp(x):
    return Exp.apply(x)


def log(x):
    return Log.apply(x)


def sqrt(x):
    return Sqrt.apply(x)


def tanh(x):
    return Tanh.apply(x)


def abs(x):  # noqa: A001 - Paddle's name
    return Abs.apply(_tensor(x))


def sigmoid(x):
    return Sigmoid.apply(x)


def reshape(x, shape):
    """``x`` in ``shape``, Paddle's way: a 0 keeps ``x``'s size on that axis, and one -1 takes
    what is left."""
    sizes = tuple(int(n) for n in shape)
    if 0 in sizes:
        ndim = len(x.shape)
        kept = [i for i, n in enumerate(sizes) if n == 0 and i >= ndim]
        if kept:
            raise ValueError(f"reshape shape={list(shape)}: a 0 keeps the input's size on its "
                             f"axis, but the input {tuple(x.shape)} has no axis {kept[0]}")
        sizes = tuple(x.shape[i] if n == 0 else n for i, n in enumerate(sizes))
    return Reshape.apply(x, sizes)


def transpose(x, perm):
    return Transpose.apply(x, perm)


def concat(x, axis=0, name=None):
    """The tensors of the list ``x`` joined along ``axis`` (``name`` as ``matmul``'s)."""
    return Concat.apply(*x, axis=axis)


def stack(x, axis=0):
    return Stack.apply(*x, axis=axis)


def split(x, num_or_sections, axis=0, name=None):
    """A list of pieces of ``x`` along ``axis``: ``num_or_sections`` equal ones, or of the
    listed sizes (``name`` as ``matmul``'s)."""
    return Split.of(_tensor(x), num_or_sections, axis)


def gather(x, index, axis=None, name=None):
    """Paddle's ``gather``: the slices of ``x`` at the integers of ``index`` (1-d) along
    ``axis`` (0 when None); the gradient adds back into the slices taken (``name`` as
    ``matmul``'s)."""
    x = _tensor(x)
    axis = 0 if axis is None else int(axis)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"gather axis={axis} is out of range for a tensor of {x.ndim} "
                         "dimension(s)")
    index = _xp().asarray(getattr(index, "data", index))
    if index.ndim != 1 or index.dtype.kind not in "iu":
        raise ValueError(f"gather index must be a 1-d tensor of integers, not of shape "
                         f"{tuple(index.shape)} and dtype {index.dtype}")
    return GetItem.apply(x, (slice(None),) * (axis % x.ndim) + (index,))


def clone(x):
    """A copy of ``x``'s values that stays in the graph: the gradient flows back through it
    (Paddle's ``clone``; ``detach`` gives the values outside the graph)."""
    return Clone.apply(_tensor(x))


def cast(x, dtype):
    return Cast.apply(x, np.dtype(dtype))


# -- Tensor methods and operators -----------------------------------------------------------
def _compare(op):
    def compare(self, other):
        return Tensor(op(self.data, as_array(other)))
    return compare


def _shape_args(shape):
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        return shape[0]
    return shape


def _reshape_method(self, *shape):
    return reshape(self, _shape_args(shape))


def _transpose_method(self, *perm):
    """``transpose(perm)`` (Paddle: the new order of every axis) or ``transpose(a, b)``
    (PyTorch: swap two axes)."""
    perm = _shape_args(perm)
    if len(perm) == 2 and self.ndim != 2:
        order = list(range(self.ndim))
        order[perm[0]], order[perm[1]] = order[perm[1]], order[perm[0]]
        perm = order
    return Transpose.apply(self, perm)


def _getitem(self, index):
    if isinstance(index, Tensor):
        index = index.data
    elif isinstance(index, tuple):
        index = tuple(i.data if isinstance(i, Tensor) else i for i in index)
    return GetItem.apply(self, index)


def _reduction(function):
    def method(self, axis=None, keepdim=False, keepdims=False, dim=None):
        return function(self, axis if dim is None else dim, keepdim, keepdims)
    return method


def install_tensor_methods():
    methods = {
        "__add__": lambda a, b: Add.apply(a, b),
        "__radd__": lambda a, b: Add.apply(b, a),
        "__sub__": lambda a, b: Sub.apply(a, b),
        "__rsub__": lambda a, b: Sub.apply(b, a),
        "__mul__": lambda a, b: Mul.apply(a, b),
        "__rmul__": lambda a, b: Mul.apply(b, a),
        "__truediv__": lambda a, b: Div.apply(a, b),
        "__rtruediv__": lambda a, b: Div.apply(b, a),
        "__neg__": lambda a: Neg.apply(a),
        "__pow__": lambda a, p: Pow.apply(a, _exponent(p)),
        "__matmul__": lambda a, b: MatMul.apply(a, b),
        "__rmatmul__": lambda a, b: MatMul.apply(b, a),
        "__getitem__": _getitem,
        "__lt__": _compare(lambda a, b: a < b),
        "__le__": _compare(lambda a, b: a <= b),
        "__gt__": _compare(lambda a, b: a > b),
        "__ge__": _compare(lambda a, b: a >= b),
        "__eq__": _compare(lambda a, b: a == b),
        "__ne__": _compare(lambda a, b: a != b),
        "matmul": matmul,
        "reshape": _reshape_method,
        "transpose": _transpose_method,
        "T": property(transpose_last),
        "sum": _reduction(sum),
        "mean": _reduction(mean),
        "max": _reduction(max),
        "exp": exp,
        "log": log,
        "sqrt": sqrt,
        "tanh": tanh,
        "sigmoid": sigmoid,
        "astype": cast,
        "clone": clone,
        "abs": abs,
        "split": split,
    }
    for name, method in methods.items():
        setattr(Tensor, name, method)
    Tensor.__hash__ = object.__hash__


def _exponent(p):
    if not isinstance(p, numbers.Real):
        raise TypeError(f"a Tensor's ** takes a number as exponent, not {type(p).__name__}")
    return p


install_tensor_methods()

"""Dense and elementwise layers: Linear, activations, Dropout, Flatten, Embedding."""
import math

import numpy as np

from .. import backend, kernels
from ..kernels import reference
from .layer import Layer
from .sparse import SparseTable


def check_positive_int(name, value):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, not {value!r}")
    return int(value)


def check_input(layer, x, ndim, features=None, axis=1):
    """Raise a ValueError naming the layer when ``x`` has the wrong rank or feature size."""
    ndims = (ndim,) if isinstance(ndim, int) else ndim
    if x.ndim not in ndims:
        raise ValueError(f"{type(layer).__name__} expects a {' or '.join(map(str, ndims))}-d "
                         f"input, got shape {tuple(x.shape)}")
    if features is not None and x.shape[axis] != features:
        raise ValueError(f"{type(layer).__name__} expects {features} features on axis {axis}, "
                         f"got shape {tuple(x.shape)}")


class MixedPrecisionLayer(Layer):
    """A layer whose math can run in a dtype other than its parameters'.

    With ``compute_dtype`` set (amp sets float16 for the ops of its white list, float32 for
    those of its black list), forward casts the floating input and the parameters to it and
    computes in it; backward computes in it too and stores the parameter gradients in the
    parameters' own gradient buffer (amp's float32 master gradients), and the input gradient
    goes back in the dtype the input came in. None (the default): no casts at all."""

    compute_dtype = None

    def _cast_input(self, x):
        """``x`` in the compute dtype; remembers ``x``'s dtype for the input gradient."""
        self._input_dtype = x.dtype
        return self._in_compute_dtype(x)

    def _in_compute_dtype(self, array):
        if self.compute_dtype is None or array.dtype == self.compute_dtype:
            return array
        return array.astype(self.compute_dtype)

    def _operand(self, parameter):
        """A parameter's values in the compute dtype (the parameter itself without one)."""
        return None if parameter is None else self._in_compute_dtype(parameter.data)

    def _input_grad(self, dx):
        """The input gradient in the dtype the input came in."""
        if self.compute_dtype is None or dx.dtype == self._input_dtype:
            return dx
        return dx.astype(self._input_dtype)


def matmul(a, b):
    """``a @ b``. Float16 operands multiply as a GPU's float16 matrix product does, products
    summed in float32 and rounded to float16 once; on the host that runs as a float32 product,
    since NumPy has no BLAS for float16 and its own loop is hundreds of times slower."""
    if a.dtype == np.float16 and b.dtype == np.float16 and not backend.on_gpu():
        return (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16)
    return a @ b


def matmul_into(grad, a, b):
    """``grad[...] = a @ b``: the product in the operands' dtype (float16 under amp), stored in
    the gradient's dtype."""
    if a.dtype == grad.dtype:
        backend.array_module().matmul(a, b, out=grad)
    else:
        grad[...] = matmul(a, b)


def sum_into(grad, dy, axis):
    """``grad[...] = dy.sum(axis)``, accumulated in the gradient's dtype."""
    dy.sum(axis=axis, dtype=grad.dtype, out=grad)


class Linear(MixedPrecisionLayer):
    """``y = x @ weight + bias`` with ``weight`` of shape ``(in_features, out_features)``
    (Paddle's layout), Xavier-uniform initialised; ``bias`` starts at zero."""

    op_type = "matmul"

    def __init__(self, in_features, out_features, bias=True, dtype=None):
        super().__init__(dtype)
        self.in_features = check_positive_int("in_features", in_features)
        self.out_features = check_positive_int("out_features", out_features)
        bound = math.sqrt(6.0 / (in_features + out_features))
        self.create_parameter("weight", backend.shared_rng().uniform(
            -bound, bound, (in_features, out_features)))
        self.bias = None
        if bias:
            self.create_parameter("bias", np.zeros(out_features))

    def extra_repr(self):
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}"

    def _matmul(self, x):
        """``x @ weight`` in the compute dtype, keeping both operands for backward."""
        check_input(self, x, 2, self.in_features)
        self._x = self._cast_input(x)
        self._w = self._operand(self.weight)
        return matmul(self._x, self._w)

    def forward(self, x):
        y = self._matmul(x)
        if self.bias is not None:
            y += self._operand(self.bias)
        return y

    def forward_act(self, x, act):
        """Fused ``act(x @ weight + bias)`` (``fuse_elewise_add_act_ops``)."""
        y, self._pre = kernels.bias_act_forward(self._matmul(x), self._operand(self.bias), act)
        self._y = y
        return y

    def _backward(self, dy, input_grad):
        dy = self._in_compute_dtype(dy)
        matmul_into(self.weight.grad, self._x.T, dy)
        if self.bias is not None:
            sum_into(self.bias.grad, dy, 0)
        return self._input_grad(matmul(dy, self._w.T)) if input_grad else None

    def backward_act(self, dy, act, input_grad=True):
        dy = self._in_compute_dtype(dy)
        return self._backward(kernels.bias_act_backward(dy, self._y, self._pre, act),
                              input_grad)


class Activation(Layer):
    """An elementwise activation by name (``relu``, ``tanh``, ``gelu``)."""

    act = None

    def forward(self, x):
        xp = backend.array_module()
        self._x = x if self.act == "gelu" else None
        self._y = reference.activation_forward(x, self.act, xp)
        return self._y

    def _backward(self, dy, input_grad):
        return reference.activation_backward(dy, self._y, self._x, self.act,
                                             backend.array_module())


class ReLU(Activation):
    act = op_type = "relu"


class Tanh(Activation):
    act = op_type = "tanh"


class GELU(Activation):
    """GELU in its tanh approximation, ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``
    (Paddle's ``approximate=True``), which needs no ``erf`` and so runs the same on every
    backend."""

    act = op_type = "gelu"


class Dropout(Layer):
    """Zero each input with probability ``p`` while training and scale the rest by
    ``1 / (1 - p)`` (Paddle's ``upscale_in_train``); the identity in eval mode. Masks come from
    the rank generator, so they differ between ranks."""

    op_type = "dropout"

    def __init__(self, p=0.5):
        super().__init__()
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 <= p < 1:
            raise ValueError(f"Dropout p must be a number in [0, 1), not {p!r}")
        self.p = float(p)

    def extra_repr(self):
        return f"p={self.p}"

    def forward(self, x):
        if not self.training or self.p == 0:
            self._scale = None
            return x
        keep = backend.rank_rng().random(x.shape) >= self.p
        self._scale = keep.astype(x.dtype) * (1.0 / (1.0 - self.p))
        return x * self._scale

    def _backward(self, dy, input_grad):
        return dy if self._scale is None else dy * self._scale


class Flatten(Layer):
    """``(N, ...)`` to ``(N, everything else)``."""

    op_type = "flatten"

    def forward(self, x):
        self._shape = x.shape
        return x.reshape(x.shape[0], -1)

    def _backward(self, dy, input_grad):
        return dy.reshape(self._shape)


class Embedding(MixedPrecisionLayer):
    """Rows of ``weight`` (``(num_embeddings, embedding_dim)``, normal(0, 1) initialised)
    picked by an integer index array; the output gains a trailing axis of ``embedding_dim``.
    Backward returns None: integer indices have no gradient.

    ``sparse=True`` (parameter-server mode): the table is a ``SparseTable`` whose rows live on
    the servers; the layer has no dense parameter, looks up only the rows a batch touches and
    leaves their gradient in ``table.grad_ids`` / ``table.grad_values``."""

    op_type = "lookup_table"

    def __init__(self, num_embeddings, embedding_dim, dtype=None, sparse=False):
        super().__init__(dtype)
        self.num_embeddings = check_positive_int("num_embeddings", num_embeddings)
        self.embedding_dim = check_positive_int("embedding_dim", embedding_dim)
        self.sparse = bool(sparse)
        if self.sparse:
            self.table = SparseTable(num_embeddings, embedding_dim, self.dtype)
        else:
            self.create_parameter("weight", backend.shared_rng().standard_normal(
                (num_embeddings, embedding_dim)))

    def extra_repr(self):
        sparse = ", sparse=True" if self.sparse else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{sparse}"

    def forward(self, ids):
        xp = backend.array_module()
        if ids.dtype.kind not in "iu":
            raise ValueError(f"Embedding expects integer indices, got dtype {ids.dtype}")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise ValueError(f"Embedding indices must lie in [0, {self.num_embeddings}), got "
                             f"values in [{int(ids.min())}, {int(ids.max())}]")
        if self.sparse:
            return self._in_compute_dtype(self.table.lookup(ids))
        self._ids = xp.asarray(ids)
        return self._in_compute_dtype(self.weight.data[self._ids])

    def _backward(self, dy, input_grad):
        if self.sparse:
            self.table.backward(self._in_compute_dtype(dy))
            return None
        grad = self.weight.grad
        grad[...] = 0
        rows = self._ids.reshape(-1)
        values = self._in_compute_dtype(dy).reshape(-1, self.embedding_dim)
        values = values.astype(grad.dtype, copy=False)
        if backend.on_gpu():
            import cupyx

            cupyx.scatter_add(grad, rows, values)
        else:
            np.add.at(grad, rows, values)
        return None

"""Dense and elementwise layers: Linear, activations, Dropout, Flatten, Embedding."""
import math

import numpy as np

from .. import backend, kernels
from ..kernels import reference
from .layer import Layer


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


class Linear(Layer):
    """``y = x @ weight + bias`` with ``weight`` of shape ``(in_features, out_features)``
    (Paddle's layout), Xavier-uniform initialised; ``bias`` starts at zero."""

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

    def forward(self, x):
        check_input(self, x, 2, self.in_features)
        self._x = x
        y = x @ self.weight.data
        if self.bias is not None:
            y += self.bias.data
        return y

    def forward_act(self, x, act):
        """Fused ``act(x @ weight + bias)`` (``fuse_elewise_add_act_ops``)."""
        check_input(self, x, 2, self.in_features)
        self._x = x
        y, self._pre = kernels.bias_act_forward(x @ self.weight.data, self.bias.data, act)
        self._y = y
        return y

    def _backward(self, dy, input_grad):
        xp = backend.array_module()
        xp.matmul(self._x.T, dy, out=self.weight.grad)
        if self.bias is not None:
            dy.sum(axis=0, out=self.bias.grad)
        return dy @ self.weight.data.T if input_grad else None

    def backward_act(self, dy, act, input_grad=True):
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
    act = "relu"


class Tanh(Activation):
    act = "tanh"


class GELU(Activation):
    """GELU in its tanh approximation, ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``
    (Paddle's ``approximate=True``), which needs no ``erf`` and so runs the same on every
    backend."""

    act = "gelu"


class Dropout(Layer):
    """Zero each input with probability ``p`` while training and scale the rest by
    ``1 / (1 - p)`` (Paddle's ``upscale_in_train``); the identity in eval mode. Masks come from
    the rank generator, so they differ between ranks."""

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

    def forward(self, x):
        self._shape = x.shape
        return x.reshape(x.shape[0], -1)

    def _backward(self, dy, input_grad):
        return dy.reshape(self._shape)


class Embedding(Layer):
    """Rows of ``weight`` (``(num_embeddings, embedding_dim)``, normal(0, 1) initialised)
    picked by an integer index array; the output gains a trailing axis of ``embedding_dim``.
    Backward returns None: integer indices have no gradient."""

    def __init__(self, num_embeddings, embedding_dim, dtype=None):
        super().__init__(dtype)
        self.num_embeddings = check_positive_int("num_embeddings", num_embeddings)
        self.embedding_dim = check_positive_int("embedding_dim", embedding_dim)
        self.create_parameter("weight", backend.shared_rng().standard_normal(
            (num_embeddings, embedding_dim)))

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}"

    def forward(self, ids):
        xp = backend.array_module()
        if ids.dtype.kind not in "iu":
            raise ValueError(f"Embedding expects integer indices, got dtype {ids.dtype}")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise ValueError(f"Embedding indices must lie in [0, {self.num_embeddings}), got "
                             f"values in [{int(ids.min())}, {int(ids.max())}]")
        self._ids = xp.asarray(ids)
        return self.weight.data[self._ids]

    def _backward(self, dy, input_grad):
        grad = self.weight.grad
        grad[...] = 0
        rows = self._ids.reshape(-1)
        values = dy.reshape(-1, self.embedding_dim)
        if backend.on_gpu():
            import cupyx

            cupyx.scatter_add(grad, rows, values)
        else:
            np.add.at(grad, rows, values)
        return None

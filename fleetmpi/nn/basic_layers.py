"""Dense and elementwise layers: Linear, activations, Dropout, Flatten, Embedding."""
import numpy as np

from ..core import backend
from ..autograd import Tensor, as_array
from . import functional as F
from . import initializer
from .layer import Layer
from .param_attr import needed, to_attr
from .sparse import SparseTable


def check_positive_int(name, value):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, not {value!r}")
    return int(value)


def check_input(layer, x, ndim, features=None, axis=1):
    """Raise a ValueError naming the layer when ``x`` has the wrong rank or feature size."""
    ndims = (ndim,) if isinstance(ndim, int) else ndim
    if ndims and x.ndim not in ndims:
        raise ValueError(f"{type(layer).__name__} expects a {' or '.join(map(str, ndims))}-d "
                         f"input, got shape {tuple(x.shape)}")
    if features is not None and x.shape[axis] != features:
        raise ValueError(f"{type(layer).__name__} expects {features} features on axis {axis}, "
                         f"got shape {tuple(x.shape)}")


class Linear(Layer):
    """``y = x @ weight + bias`` over the last axis of ``x``, ``weight`` of shape
    ``(in_features, out_features)`` (Paddle's layout), Xavier-uniform initialised; ``bias``
    starts at zero."""

    def __init__(self, in_features, out_features, weight_attr=None, bias_attr=None, name=None,
                 dtype=None):
        super().__init__(dtype, name)
        self.in_features = check_positive_int("in_features", in_features)
        self.out_features = check_positive_int("out_features", out_features)
        self.weight = self.create_parameter((in_features, out_features),
                                            needed(weight_attr, "weight_attr"))
        self.bias = self.create_parameter((out_features,), to_attr(bias_attr, "bias_attr"),
                                          is_bias=True)

    def extra_repr(self):
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}"

    def forward(self, x):
        check_input(self, x, (), self.in_features, axis=-1)
        return F.linear(x, self.weight, self.bias)

    def forward_act(self, x, act):
        """Fused ``act(x @ weight + bias)`` (``fuse_elewise_add_act_ops``)."""
        check_input(self, x, (), self.in_features, axis=-1)
        return F.linear_activation(x, self.weight, self.bias, act)


class Activation(Layer):
    """An elementwise activation by name (``relu``, ``tanh``, ``gelu``)."""

    act = None

    def forward(self, x):
        return F.activation(x, self.act)


class ReLU(Activation):
    act = "relu"


class Tanh(Activation):
    act = "tanh"


class GELU(Activation):
    """GELU in its tanh approximation, ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``
    (Paddle's ``approximate=True``), which needs no ``erf`` and so runs the same on every
    backend."""

    act = "gelu"


class Sigmoid(Layer):
    def forward(self, x):
        return F.sigmoid(x)


class Softmax(Layer):
    def __init__(self, axis=-1):
        super().__init__()
        self.axis = axis

    def forward(self, x):
        return F.softmax(x, self.axis)


class Dropout(Layer):
    """Zero each input with probability ``p`` while training and scale the rest by
    ``1 / (1 - p)`` (Paddle's ``upscale_in_train``); the identity in eval mode. Masks come from
    the rank generator, so they differ between ranks."""

    def __init__(self, p=0.5, mode="upscale_in_train", name=None):
        super().__init__()
        self.p = F.common.check_dropout_rate(p)
        F.common.check_dropout_mode(mode)

    def extra_repr(self):
        return f"p={self.p}"

    def forward(self, x):
        return F.dropout(x, self.p, self.training)


class Flatten(Layer):
    """``(N, ...)`` to ``(N, everything else)``."""

    def forward(self, x):
        if not isinstance(x, Tensor):
            x = Tensor(backend.asarray(x))
        return x.reshape(x.shape[0], -1)


class Embedding(Layer):
    """Rows of ``weight`` (``(num_embeddings, embedding_dim)``, normal(0, 1) initialised)
    picked by an integer index array; the output gains a trailing axis of ``embedding_dim``.

    ``sparse=True`` (parameter-server mode): the table is a ``SparseTable`` whose rows live on
    the servers; the layer has no dense parameter, looks up only the rows a batch touches and
    leaves their gradient in ``table.grad_ids`` / ``table.grad_values``; ``weight_attr`` then
    has no parameter to describe and must be None."""

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, sparse=False,
                 weight_attr=None, name=None, dtype=None):
        super().__init__(dtype, name)
        if padding_idx is not None:
            raise ValueError(f"Embedding padding_idx={padding_idx!r}: only None is supported "
                             "(every row is looked up and trained)")
        self.num_embeddings = check_positive_int("num_embeddings", num_embeddings)
        self.embedding_dim = check_positive_int("embedding_dim", embedding_dim)
        self.sparse = bool(sparse)
        if self.sparse:
            if weight_attr is not None:
                raise ValueError("Embedding(sparse=True) keeps its rows on the parameter "
                                 f"servers; weight_attr must be None, not {weight_attr!r}")
            self.table = SparseTable(num_embeddings, embedding_dim, self.dtype)
        else:
            self.weight = self.create_parameter((num_embeddings, embedding_dim),
                                                needed(weight_attr, "weight_attr"),
                                                default_initializer=initializer.Normal())

    def extra_repr(self):
        sparse = ", sparse=True" if self.sparse else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{sparse}"

    def forward(self, ids):
        ids = as_array(ids)
        F.common.check_indices(ids, self.num_embeddings)
        if self.sparse:
            return F.embedding(ids, self.table, sparse=True)
        return F.embedding(ids, self.weight)

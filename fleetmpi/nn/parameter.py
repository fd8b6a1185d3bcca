"""``Parameter``: a trainable Tensor whose values and gradient are views into flat buffers."""
import numpy as np

from .. import backend
from ..autograd import Tensor


class Parameter(Tensor):
    """A trainable leaf tensor (``stop_gradient=False`` unless ``trainable=False``). ``data``
    and ``grad`` are views into the model's flat buffers once the model is flattened; read
    them afresh rather than keeping references across a repack. ``grad`` always exists (zero
    until a backward adds to it)."""

    def __init__(self, value, trainable=True):
        super().__init__(backend.asarray(value), stop_gradient=not trainable)
        self.grad = backend.array_module().zeros_like(self.data)
        self.buffer = None
        self.offset = None
        self.pipeline_stage = None

    @property
    def trainable(self):
        return not self.stop_gradient

    @trainable.setter
    def trainable(self, value):
        self.stop_gradient = not value

    def _bind(self, buffer, offset):
        stop = offset + self.size
        self.data = buffer.data[offset:stop].reshape(self.shape)
        self.grad = buffer.grad[offset:stop].reshape(self.shape)
        self.buffer = buffer
        self.offset = offset

    @property
    def size(self):
        return int(np.prod(self.data.shape))

    def __repr__(self):
        return f"Parameter({self.name!r}, shape={list(self.shape)}, dtype={self.dtype})"

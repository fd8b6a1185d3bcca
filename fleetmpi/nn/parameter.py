"""``Parameter``: a named trainable array and its gradient, both views into flat buffers."""
import numpy as np

from .. import backend


class Parameter:
    """A trainable array. ``data`` and ``grad`` are views into the model's flat buffers once the
    model is flattened; read them afresh rather than keeping references across a repack."""

    def __init__(self, value):
        self.data = backend.asarray(value)
        self.grad = backend.array_module().zeros_like(self.data)
        self.buffer = None
        self.offset = None
        self.name = None
        self.pipeline_stage = None

    def _bind(self, buffer, offset):
        stop = offset + self.size
        self.data = buffer.data[offset:stop].reshape(self.shape)
        self.grad = buffer.grad[offset:stop].reshape(self.shape)
        self.buffer = buffer
        self.offset = offset

    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def size(self):
        return int(np.prod(self.data.shape))

    def __repr__(self):
        return f"Parameter({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"

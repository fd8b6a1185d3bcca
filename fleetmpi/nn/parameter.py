"""``Parameter``: a trainable Tensor whose values and gradient are views into flat buffers."""
import numpy as np

from .. import backend
from ..autograd import Tensor


class Parameter(Tensor):
    """A trainable leaf tensor (``stop_gradient=False`` unless ``trainable=False``). ``data``
    and ``grad`` are views into the model's flat buffers once the model is flattened; read
    them afresh rather than keeping references across a repack. ``grad`` always exists (zero
    until a backward adds to it).

    ``clear_gradient`` does not write zeros at once: it marks the gradient as zero, and the
    first gradient backward accumulates is then copied in instead of added to zeros (one pass
    over the gradient memory instead of three). Reading ``grad`` writes the zeros first, and
    ``settle_gradient`` does it for a gradient no backward reached, before anything reads the
    flat buffer directly."""

    def __init__(self, value, trainable=True):
        super().__init__(backend.asarray(value), stop_gradient=not trainable)
        self._grad_is_zero = False
        self.grad = backend.array_module().zeros_like(self.data)
        self.buffer = None
        self.offset = None
        self.pipeline_stage = None

    @property
    def grad(self):
        self.settle_gradient()
        return self._grad

    @grad.setter
    def grad(self, value):
        self._grad = value

    def settle_gradient(self):
        """Write the zeros ``clear_gradient`` promised, if no gradient came since."""
        if self._grad_is_zero:
            self._grad[...] = 0
            self._grad_is_zero = False

    def clear_gradient(self):
        self._grad_is_zero = True

    clear_grad = clear_gradient

    def accumulate_grad(self, grad):
        """Add ``grad`` (already of this parameter's shape and dtype) to the gradient; ``grad``
        may be the gradient array itself, written by a Function through ``grad_buffer``."""
        if self._grad_is_zero:
            if grad is not self._grad:
                self._grad[...] = grad
            self._grad_is_zero = False
        else:
            self._grad += grad

    @property
    def trainable(self):
        return not self.stop_gradient

    @trainable.setter
    def trainable(self, value):
        self.stop_gradient = not value

    def _bind(self, buffer, offset):
        stop = offset + self.size
        self.settle_gradient()
        self.data = buffer.data[offset:stop].reshape(self.shape)
        self.grad = buffer.grad[offset:stop].reshape(self.shape)
        self.buffer = buffer
        self.offset = offset

    @property
    def size(self):
        return int(np.prod(self.data.shape))

    def __repr__(self):
        return f"Parameter({self.name!r}, shape={list(self.shape)}, dtype={self.dtype})"

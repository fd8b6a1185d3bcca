"""``Parameter``: a trainable Tensor whose values and gradient are views into flat buffers.

The interface strategies use, besides a tensor's ``data``, ``grad`` (``grad.data`` is the
gradient array), ``name``, ``shape``, ``size`` and ``dtype``:

* ``buffer``, ``offset``: the flat buffer (``nn.flat.FlatBuffer``) the parameter lives in and
  where; read only.
* ``pipeline_stage``: the pipeline stage it belongs to (``nn.layer``'s docstring); read.
* ``settle_gradient()``: before reading the gradient through the flat buffer.
* ``bind_gradient``, ``unbind_gradient``: gradient storage of a strategy's own (sharding
  stages 2 and 3 keep gradients in buckets).
* ``bind_data``, ``release_data``, ``bind_keeper``: values that exist only while used
  (sharding stage 3).
* ``materialized``, ``deferred_init``: whether the parameter has values, and how it gets them
  when it was built under ``LazyGuard`` (``nn.lazy``).
"""
import numpy as np

from ..core import backend
from ..autograd import Tensor
from .lazy import ABSENT, DeferredInit


class Parameter(Tensor):
    """A trainable leaf tensor (``stop_gradient=False`` unless ``trainable=False``). ``data``
    and ``grad.data`` are views into the model's flat buffers once the model is flattened; read
    them afresh rather than keeping references across a repack. ``grad`` always exists (zero
    until a backward adds to it).

    ``clear_gradient`` does not write zeros at once: it marks the gradient as zero, and the
    first gradient backward accumulates is then copied in instead of added to zeros (one pass
    over the gradient memory instead of three). Reading ``grad`` writes the zeros first, and
    ``settle_gradient`` does it for a gradient no backward reached, before anything reads the
    flat buffer directly. A parameter not yet in a flat buffer allocates its zeros when
    ``grad`` is first read or a gradient comes, so building a model allocates none.

    Under sharding stages 2 and 3 the flat gradient buffer does not exist: a parameter has
    gradient storage only from the moment backward first needs it (``home(parameter)``, given
    to ``unbind_gradient``, binds it through ``bind_gradient``) until its bucket is reduced,
    and ``grad`` is None outside that time. Under stage 3 the values too exist only while a
    layer uses them (``release_data``/``bind_data``, with the keeper of ``bind_keeper``
    gathering them); in between ``data`` is a placeholder of the right shape that holds NaN
    and takes no memory.

    Built under ``LazyGuard`` (``deferred_init`` given, ``value`` None) it has neither values
    nor gradient until its flat buffer is materialised (``nn.lazy``).

    ``is_distributed`` (Paddle's name): the parameter is this rank's part of a parameter split
    over a model-parallel group (a tensor-parallel layer's), not the whole of it."""

    def __init__(self, value, trainable=True, deferred_init=None, name=None):
        self.deferred_init = deferred_init
        if deferred_init is not None:
            value = _placeholder(deferred_init.shape, deferred_init.dtype)
        super().__init__(backend.asarray(value), stop_gradient=not trainable)
        # A name a ParamAttr gave is kept; the others are named by their path in the model.
        self.named_by_attr = name is not None
        self.name = name
        self._grad_is_zero = False
        self._grad = None
        # Its own zeros when first needed: a model under construction holds no gradients.
        self._grad_home = None if deferred_init else _own_zeros
        self.buffer = None
        self.offset = None
        self.pipeline_stage = None
        self.is_distributed = False
        if deferred_init is not None:
            self.bind_keeper(ABSENT)

    @property
    def materialized(self):
        """False while the parameter, built under ``LazyGuard``, has no values anywhere."""
        return self.deferred_init is None

    def _gradient_array(self):
        if self._grad is None and self._grad_home is _own_zeros:
            _own_zeros(self)
        self.settle_gradient()
        return self._grad

    def _set_gradient(self, array):
        """``p.grad = value`` writes the values into the gradient storage, so that a view of
        the flat buffer stays one (``p.grad += g`` adds into the buffer); None zeroes it."""
        if array is None:
            self.clear_gradient()
            return
        current = self._gradient_array()
        if current is None or tuple(current.shape) != tuple(array.shape):
            shape = None if current is None else tuple(current.shape)
            raise ValueError(f"{self.name}.grad = a value of shape {tuple(array.shape)}: the "
                             f"gradient storage has shape {shape}")
        current[...] = array

    def settle_gradient(self):
        """Write the zeros ``clear_gradient`` promised, if no gradient came since."""
        if self._grad_is_zero and self._grad is not None:
            self._grad[...] = 0
            self._grad_is_zero = False

    def clear_gradient(self):
        self._grad_is_zero = True

    clear_grad = clear_gradient

    def accumulate_grad(self, grad):
        """Add ``grad`` (already of this parameter's shape and dtype) to the gradient; ``grad``
        may be the gradient array itself, written by a Function through ``grad_buffer``."""
        if self._grad is None:
            self._grad_home(self)
        if self._grad_is_zero:
            if grad is not self._grad:
                self._grad[...] = grad
            self._grad_is_zero = False
        else:
            self._grad += grad

    def zero_gradient_storage(self, shape, dtype):
        """The gradient array, for a Function's backward to write this parameter's gradient
        into directly, when it is zero so far and has this shape and dtype; else None."""
        if self._grad is None and self._grad_home is not None:
            self._grad_home(self)
        if (self._grad_is_zero and self._grad.shape == tuple(shape)
                and self._grad.dtype == dtype):
            return self._grad
        return None

    def held_gradient(self):
        """The gradient array, or None where none is held or it is zero (nothing is
        allocated, unlike reading ``grad``)."""
        return None if self._grad_is_zero else self._grad

    def bind_gradient(self, array):
        """Give the parameter ``array`` (its shape) as gradient storage, holding zero."""
        self._grad = array
        self._grad_is_zero = True

    def unbind_gradient(self, home):
        """Drop the gradient storage; ``home(self)`` binds new storage when a gradient comes."""
        self._grad = None
        self._grad_is_zero = False
        self._grad_home = home

    def bind_data(self, array):
        """Make ``array`` (the parameter's shape) the parameter's values."""
        self.data = array

    def bind_keeper(self, keeper):
        """Let ``keeper`` provide the values whenever an operation uses the parameter, and
        ``values``/``assign`` go through it (sharding stage 3's gatherer; the protocol is
        ``Tensor``'s keeper's)."""
        self._keeper = keeper

    def values(self):
        """The parameter's values: ``data``, or under sharding stage 3 a gathered copy (a
        collective: every rank of the group calls it in the same order)."""
        return self.data if self._keeper is None else self._keeper.fetch(self)

    def assign(self, values):
        """Set the values from ``values`` (an array of the parameter's shape); under stage 3
        the part in this rank's shard."""
        if self._keeper is None:
            self.data[...] = values
        else:
            self._keeper.assign(self, values)

    def release_data(self):
        """Drop the values, keeping shape and dtype in a placeholder that holds NaN (so a
        computation that reads them by mistake shows it) and takes no memory; the values live
        elsewhere from now on (a keeper's shard), also for one built under ``LazyGuard``."""
        self.data = _placeholder(self.data.shape, self.data.dtype)
        self.deferred_init = None

    def set_value(self, value):
        """Overwrite the values (Paddle's ``set_value``); under ``LazyGuard`` ``value`` becomes
        the parameter's initial values, sliced when they are materialised."""
        if self.deferred_init is None:
            return super().set_value(value)
        self.defer(value.data if isinstance(value, Tensor) else value, self.deferred_init.layer)

    def defer(self, values, layer):
        """Hold no values from now on; ``values`` (an array of the parameter's shape, or an
        initializer, which draws from the shared generator's state now) give the initial
        values when the flat buffer is materialised. ``layer``: what built it, for the error
        that using it raises."""
        self.deferred_init = DeferredInit(values, tuple(self.shape), self.dtype, layer)
        self.data = _placeholder(self.shape, self.dtype)
        self._grad = None
        self._grad_home = None
        self.bind_keeper(ABSENT)

    @property
    def trainable(self):
        return not self.stop_gradient

    @trainable.setter
    def trainable(self, value):
        self.stop_gradient = not value

    def _place(self, buffer, offset):
        """Belong at ``offset`` of ``buffer`` before it has values (``LazyGuard``)."""
        self.buffer = buffer
        self.offset = offset

    def _materialize(self, buffer, offset):
        """Take the values the deferred buffer ``buffer`` now holds at ``offset``."""
        self.deferred_init = None
        self._keeper = None
        self._bind(buffer, offset)

    def _bind(self, buffer, offset):
        """Take ``buffer``'s values and its gradient memory, which holds zeros, at ``offset``:
        the first backward writes into it as every later one does (a graphed step's warm-up
        then plans the products its captured steps make)."""
        stop = offset + self.size
        self.settle_gradient()
        self.data = buffer.data[offset:stop].reshape(self.shape)
        self._grad = buffer.grad[offset:stop].reshape(self.shape)
        self._grad_is_zero = True
        self._grad_home = None
        self.buffer = buffer
        self.offset = offset

    def __repr__(self):
        return f"Parameter({self.name!r}, shape={list(self.shape)}, dtype={self.dtype})"


def _own_zeros(parameter):
    """The gradient home of a parameter outside a flat buffer: zeros of its own."""
    parameter.bind_gradient(backend.array_module().zeros(parameter.shape, parameter.dtype))


def _placeholder(shape, dtype):
    """An array of ``shape`` and ``dtype`` that holds NaN and takes no memory."""
    xp = backend.array_module()
    return xp.broadcast_to(xp.full((), np.nan, dtype=dtype), shape)

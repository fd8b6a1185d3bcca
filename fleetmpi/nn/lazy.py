"""``LazyGuard``: build a model without allocating its parameters (Paddle's ``LazyGuard``).

Inside ``with LazyGuard():`` ``Layer.create_parameter`` records how each parameter is to be
initialised (a ``DeferredInit``) instead of running its initializer. The parameter has its
shape and dtype but no values (``Parameter.materialized`` is False): its ``data`` is a
placeholder that holds NaN and takes no memory, and using it in an operation, reading it with
``values()`` or writing it with ``assign`` raises ``NotMaterializedError``, naming it.

The values come later, for a range of the flat buffer at a time (``FlatBuffer.read``):
``fleet.distributed_optimizer`` under sharding stage 3 produces only this rank's shard, and
anything else materialises the flat buffers whole (``materialize``). Either way they equal,
bit for bit, what building the model outside the guard gives from the same seed: each record
holds the shared generator's state from just before its parameter's draws, and the guard moves
the shared generator past them (``Initializer.skip``: a jump for uniform draws, bounded pieces
for normal ones), so every later parameter and every draw after the model sees the generator
as it would have been.

The built-in initializers (``fleetmpi.nn.initializer``) produce any range in pieces of at most
``CHUNK`` elements. Another callable is run whole, from the recorded state, each time values
are needed (once while building, to move the generator past it), and an array given as the
initializer is kept and sliced.
"""
import contextlib

import numpy as np

from ..core import backend
from ..autograd import as_array
from .initializer import Initializer

# The most elements drawn at once when producing part of a parameter (float64: 2 MiB).
CHUNK = 1 << 18
_depth = 0


class NotMaterializedError(RuntimeError):
    """A parameter built under ``LazyGuard`` was used before it got values."""


@contextlib.contextmanager
def LazyGuard():
    """Record parameters instead of allocating them while the block runs (module docstring)."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def building():
    """Whether a ``LazyGuard`` block is running."""
    return _depth > 0


def _generator(state):
    generator = np.random.Generator(np.random.PCG64())
    generator.bit_generator.state = state
    return generator


class DeferredInit:
    """How one parameter gets its values: ``initializer`` (an ``Initializer``, another
    callable of the shape, or an array), the shared generator's ``state`` before its draws,
    its ``shape`` and ``dtype``, and ``layer``: the name of the layer class that created it."""

    def __init__(self, initializer, shape, dtype, layer):
        self.initializer = initializer
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.layer = layer
        self.size = int(np.prod(self.shape))
        shared = backend.shared_rng()
        self.state = shared.bit_generator.state
        if isinstance(initializer, Initializer):
            initializer.skip(self.shape, shared, self.size)
        elif callable(initializer):
            self._whole()
        else:
            self.initializer = np.asarray(backend.to_numpy(initializer))
            self._checked(self.initializer)

    def _checked(self, values):
        if tuple(values.shape) != self.shape:
            raise ValueError(f"create_parameter: the initializer gave shape "
                             f"{tuple(values.shape)} for a parameter of shape {self.shape}")
        return values

    def _whole(self):
        """A callable initializer's values, drawn whole from the recorded state; the shared
        generator is left where the draws end."""
        shared = backend.shared_rng()
        shared.bit_generator.state = self.state
        values = np.asarray(backend.to_numpy(as_array(self.initializer(self.shape))))
        return self._checked(values)

    def fill(self, out, start):
        """Write elements ``[start, start + out.size)`` of the flat values into ``out`` (1-d,
        host or device)."""
        stop = start + out.size
        if isinstance(self.initializer, Initializer):
            generator = _generator(self.state)
            self.initializer.skip(self.shape, generator, start)
            for begin in range(start, stop, CHUNK):
                count = min(CHUNK, stop - begin)
                piece = self.initializer.draw(self.shape, generator, count)
                out[begin - start:begin - start + count] = backend.asarray(
                    piece.astype(self.dtype))
            return
        if callable(self.initializer):
            shared = backend.shared_rng()
            after = shared.bit_generator.state
            values = self._whole()
            shared.bit_generator.state = after
        else:
            values = self.initializer
        out[...] = backend.asarray(values.reshape(-1)[start:stop].astype(self.dtype))


def unmaterialized(parameter):
    """The ``NotMaterializedError`` for using ``parameter``, naming it."""
    init = parameter.deferred_init
    which = f"parameter {parameter.name!r}" if parameter.name else \
        f"a parameter of shape {list(init.shape)}"
    return NotMaterializedError(
        f"{which} of a {init.layer} was built under LazyGuard and holds no values yet. "
        f"Give the model's optimizer to fleet.distributed_optimizer first: under sharding "
        f"stage 3 that materialises this rank's shard of each parameter, under any other "
        f"strategy the whole model; or call fleetmpi.nn.lazy.materialize(model.parameters())")


class _Absent:
    """The keeper of a parameter without values (``Parameter.bind_keeper``): any use raises."""

    def fetch(self, parameter):
        raise unmaterialized(parameter)

    def after_forward(self, node):
        return None

    def assign(self, parameter, values):
        raise unmaterialized(parameter)


ABSENT = _Absent()


def materialize(parameters):
    """Give the flat buffers of ``parameters`` their values whole (and gradients), where built
    under ``LazyGuard``; returns whether any was."""
    buffers = {id(p.buffer): p.buffer for p in parameters
               if p.buffer is not None and p.buffer.deferred}
    for buffer in buffers.values():
        buffer.materialize()
    return bool(buffers)

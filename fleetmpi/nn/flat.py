"""Flat buffers: the parameters (and gradients) of a model as views into one contiguous array
per dtype.

A fusion bucket of the comm layer is then a slice of the gradient buffer (no packing copy), and a
fused optimizer updates every parameter with one kernel over the whole buffer. Parameters are laid
out in the order their gradients complete during backward (last layer first), so the buckets of
the gradient buffer fill from its start while backward is still running.
"""
import numpy as np

from ..core import backend


class FlatBuffer:
    """The parameters of one dtype packed back to back: ``data`` and ``grad`` are 1-d arrays,
    each parameter's ``data``/``grad`` a view of a slice of them.

    ``deferred``: the buffer holds parameters built under ``LazyGuard`` (a parameter built
    outside it joins them, its values kept as its initial values): ``data`` and ``grad`` are
    None until ``materialize``, and ``read`` produces any range of the values meanwhile."""

    def __init__(self, parameters):
        dtypes = {np.dtype(p.dtype) for p in parameters}
        if len(dtypes) != 1:
            raise ValueError(f"a flat buffer holds one dtype, got {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        self.parameters = list(parameters)
        self.offsets = []
        offset = 0
        for p in self.parameters:
            self.offsets.append(offset)
            offset += p.size
        self.deferred = not all(p.materialized for p in self.parameters)
        if self.deferred:
            self.data = self.grad = None
            for p, start in zip(self.parameters, self.offsets):
                if p.materialized:
                    p.defer(backend.to_numpy(p.data).copy(), "layer built outside LazyGuard")
                p._place(self, start)
            return
        xp = backend.array_module()
        # The values first, each parameter's own array freed as it is copied in; then the
        # gradients: building holds the model's values about twice, never four times.
        self.data = xp.empty(offset, dtype=self.dtype)
        self.grad = None
        old_grads = []
        for p, start in zip(self.parameters, self.offsets):
            old_grads.append(p.held_gradient())
            values = self.data[start:start + p.size].reshape(p.shape)
            values[...] = p.data
            p.bind_data(values)
        self.grad = xp.zeros(offset, dtype=self.dtype)
        for p, start, old_grad in zip(self.parameters, self.offsets, old_grads):
            p._bind(self, start)
            if old_grad is not None:
                p.grad.data[...] = old_grad

    @property
    def size(self):
        return self.offsets[-1] + self.parameters[-1].size if self.parameters else 0

    def materialize(self):
        """Allocate the values and gradients of a deferred buffer and initialise them."""
        xp = backend.array_module()
        size = self.size
        self.data = xp.empty(size, dtype=self.dtype)
        self.grad = xp.zeros(size, dtype=self.dtype)
        for p, start in zip(self.parameters, self.offsets):
            p.deferred_init.fill(self.data[start:start + p.size], 0)
            p._materialize(self, start)
        self.deferred = False

    def read(self, first, last, out):
        """Write elements ``[first, last)`` of the values into ``out``; of a deferred buffer
        each parameter's part is produced from its initializer, never the whole buffer."""
        if not self.deferred:
            out[...] = self.data[first:last]
            return
        for p, start in zip(self.parameters, self.offsets):
            lo, hi = max(first, start), min(last, start + p.size)
            if lo < hi:
                p.deferred_init.fill(out[lo - first:hi - first], lo - start)

    def release_gradient(self, home):
        """Free the flat gradient; each parameter gets storage from ``home(parameter)`` when
        backward first needs it (sharding stages 2 and 3)."""
        self.grad = None
        for p in self.parameters:
            p.unbind_gradient(home)

    def release_data(self):
        """Free the flat values; each parameter keeps a placeholder (sharding stage 3)."""
        self.data = None
        self.deferred = False
        for p in self.parameters:
            p.release_data()

    def span(self, parameter):
        """``(start, stop)`` of ``parameter`` in the buffer."""
        start = self.offsets[self.parameters.index(parameter)]
        return start, start + parameter.size


def flatten(parameters):
    """Pack ``parameters`` (in the given order) into one new flat buffer per dtype, unless they
    already fill exactly one buffer per dtype; returns the buffers."""
    by_dtype = {}
    for p in parameters:
        by_dtype.setdefault(np.dtype(p.dtype), []).append(p)
    buffers = []
    for group in by_dtype.values():
        owners = {id(p.buffer) for p in group}
        current = group[0].buffer
        if (len(owners) == 1 and current is not None
                and [id(p) for p in current.parameters] == [id(p) for p in group]):
            buffers.append(current)
        else:
            buffers.append(FlatBuffer(group))
    return buffers

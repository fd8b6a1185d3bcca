"""``SparseTable``: the rows of a sparse ``nn.Embedding``, kept on the parameter servers.

A worker never holds the whole table. Each lookup asks the table's ``source`` (installed by
``fleet.init_worker()`` in parameter-server mode) for the distinct rows the batch touches. The
lookup is recorded (``F.embedding(ids, table, sparse=True)``, through the table's ``anchor``)
and its backward adds the gradient to the table as distinct row ids with one summed gradient
row each (Paddle's SelectedRows), which the worker pushes to the servers.
"""
import numpy as np

from ..core import backend
from ..autograd import Tensor


class SparseTable:
    """``num_rows x dim`` rows of ``dtype`` that live elsewhere; see the module docstring.

    ``grad_ids``: the sorted distinct ids the backward passes since the gradient was last
    pushed or cleared reached; ``grad_values``: their summed gradient rows (both None when
    there are none). Gradients accumulate: a table looked up twice gets both lookups'
    contributions."""

    def __init__(self, num_rows, dim, dtype):
        self.num_rows = num_rows
        self.dim = dim
        self.dtype = np.dtype(dtype)
        self.source = None
        self.grad_ids = None
        self.grad_values = None
        # An empty tensor that requires a gradient, so that lookups are recorded for backward
        # (the rows themselves are not a parameter of this process).
        self.anchor = Tensor(backend.array_module().zeros(0, dtype=self.dtype),
                             stop_gradient=False)

    def lookup(self, ids):
        """The rows of ``ids`` (any shape), shaped ``ids.shape + (dim,)``."""
        return self.gather(ids)[0]

    def gather(self, ids):
        """``(rows, where)``: the rows of ``ids`` as ``lookup`` gives them, and what
        ``add_grad`` needs to send their gradient back to the distinct ids."""
        if self.source is None:
            raise RuntimeError("Embedding(sparse=True) keeps its rows on the parameter servers: "
                               "start the job with fleet.init(is_collective=False), call "
                               "fleet.distributed_model(model) and fleet.init_worker() first")
        host_ids = backend.to_numpy(ids).reshape(-1).astype(np.int64)
        unique, inverse = np.unique(host_ids, return_inverse=True)
        rows = np.asarray(self.source.lookup(self, unique), dtype=self.dtype)
        rows = backend.asarray(rows[inverse].reshape(tuple(ids.shape) + (self.dim,)))
        return rows, (unique, inverse)

    def add_grad(self, where, dy):
        """Add ``dy``, the gradient of rows ``gather`` returned with ``where``, to the table's
        gradient: summed into one row per distinct id, merged with the ids already there."""
        unique, inverse = where
        values = np.zeros((len(unique), self.dim), dtype=self.dtype)
        np.add.at(values, inverse, backend.to_numpy(dy).reshape(-1, self.dim))
        if self.grad_ids is None:
            self.grad_ids, self.grad_values = unique, values
            return
        ids = np.union1d(self.grad_ids, unique)
        merged = np.zeros((len(ids), self.dim), dtype=self.dtype)
        merged[np.searchsorted(ids, self.grad_ids)] += self.grad_values
        merged[np.searchsorted(ids, unique)] += values
        self.grad_ids, self.grad_values = ids, merged

    def clear_gradient(self):
        self.grad_ids = self.grad_values = None

    def __repr__(self):
        return f"SparseTable({self.num_rows}, {self.dim}, dtype={self.dtype})"

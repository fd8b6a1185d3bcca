"""``SparseTable``: the rows of a sparse ``nn.Embedding``, kept on the parameter servers.

A worker never holds the whole table. Each lookup asks the table's ``source`` (installed by
``fleet.init_worker()`` in parameter-server mode) for the distinct rows the batch touches, and
backward leaves the gradient as those same distinct row ids with one summed gradient row each
(Paddle's SelectedRows), which the worker pushes to the servers.
"""
import numpy as np

from .. import backend
from ..autograd import Tensor


class SparseTable:
    """``num_rows x dim`` rows of ``dtype`` that live elsewhere; see the module docstring.

    After a backward, ``grad_ids`` holds the sorted distinct ids of the last lookup and
    ``grad_values`` their summed gradient rows."""

    def __init__(self, num_rows, dim, dtype):
        self.num_rows = num_rows
        self.dim = dim
        self.dtype = np.dtype(dtype)
        self.source = None
        self.grad_ids = None
        self.grad_values = None
        self._ids = None
        self._inverse = None
        # An empty tensor that requires a gradient, so that lookups are recorded for backward
        # (the rows themselves are not a parameter of this process).
        self.anchor = Tensor(backend.array_module().zeros(0, dtype=self.dtype),
                             stop_gradient=False)

    def lookup(self, ids):
        """The rows of ``ids`` (any shape), shaped ``ids.shape + (dim,)``."""
        if self.source is None:
            raise RuntimeError("Embedding(sparse=True) keeps its rows on the parameter servers: "
                               "start the job with fleet.init(is_collective=False), call "
                               "fleet.distributed_model(model) and fleet.init_worker() first")
        host_ids = backend.to_numpy(ids).reshape(-1).astype(np.int64)
        unique, inverse = np.unique(host_ids, return_inverse=True)
        rows = np.asarray(self.source.lookup(self, unique), dtype=self.dtype)
        self._ids, self._inverse = unique, inverse
        return backend.asarray(rows[inverse].reshape(tuple(ids.shape) + (self.dim,)))

    def backward(self, dy):
        """Sum ``dy`` (shaped like the last lookup's output) into one row per distinct id."""
        values = np.zeros((len(self._ids), self.dim), dtype=self.dtype)
        np.add.at(values, self._inverse, backend.to_numpy(dy).reshape(-1, self.dim))
        self.grad_ids, self.grad_values = self._ids, values

    def __repr__(self):
        return f"SparseTable({self.num_rows}, {self.dim}, dtype={self.dtype})"

"""Linear (plain and with a fused bias+activation), dropout (plain and fused with a residual
add) and embedding."""
import numpy as np

from ...core import backend
from ... import kernels
from ...kernels.products import matmul_arrays
from ...autograd import Function, Tensor
from ...kernels import transformer_reference


def _weight_grads(node, x, weight, dz):
    """``(dx, dweight, dbias)`` of ``z = x @ weight + bias`` from ``dz``; the parameter
    gradients go straight into the parameters' gradient memory when it is still zero."""
    needs = node.needs_input_grad
    dx = matmul_arrays(dz, weight.T) if needs[0] else None
    dw = db = None
    if needs[1] or needs[2]:
        dz2 = dz.reshape(-1, dz.shape[-1])
        if needs[1]:
            x2 = x.reshape(-1, x.shape[-1]).T
            dw = node.grad_buffer(1, weight.shape, weight.dtype)
            if dw is not None and x2.dtype == dw.dtype and dz2.dtype == dw.dtype:
                matmul_arrays(x2, dz2, out=dw)
            else:
                dw = matmul_arrays(x2, dz2)
        if needs[2]:
            db = node.grad_buffer(2, dz2.shape[1:], dz2.dtype)
            db = dz2.sum(axis=0, out=db) if db is not None else dz2.sum(axis=0)
    return dx, dw, db


class Linear(Function):
    """``x @ weight + bias`` over the last axis of ``x`` (``weight``: ``(in, out)``, Paddle's
    layout)."""

    op_type = "matmul"

    def forward(self, x, weight, bias):
        self.x, self.weight = x, weight
        return matmul_arrays(x, weight, bias=bias)

    def backward(self, dy):
        return _weight_grads(self, self.x, self.weight, dy)


class LinearActivation(Function):
    """``act(x @ weight + bias)`` over the last axis of ``x`` with the bias and activation in
    one fused kernel (``fuse_elewise_add_act_ops``), which sees the product as rows of
    features. Runs in the dtype of the matmul, as the operator it is fused into."""

    op_type = "matmul"

    def forward(self, x, weight, bias, act):
        self.x, self.weight, self.act = x, weight, act
        z = matmul_arrays(x, weight)
        self.y, self.pre = kernels.bias_act_forward(z.reshape(-1, z.shape[-1]), bias, act)
        return self.y.reshape(z.shape)

    def backward(self, dy):
        dz = kernels.bias_act_backward(dy.reshape(self.y.shape), self.y, self.pre, self.act)
        return _weight_grads(self, self.x, self.weight, dz.reshape(dy.shape)) + (None,)


def linear(x, weight, bias=None):
    return Linear.apply(x, weight, bias)


def linear_activation(x, weight, bias, act):
    return LinearActivation.apply(x, weight, bias, act)


class Dropout(Function):
    """Zero each input with probability ``p`` and scale the rest by ``1 / (1 - p)`` (Paddle's
    ``upscale_in_train``). The mask comes from the rank generator
    (``backend.rank_rng``), so it differs between ranks and is reproducible from the seed."""

    op_type = "dropout"

    def forward(self, x, p):
        keep = backend.rank_rng().random(x.shape) >= p
        self.scale = transformer_reference.dropout_scale(keep, x.dtype, p)
        return x * self.scale

    def backward(self, dy):
        return dy * self.scale, None


def check_dropout_rate(p):
    if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 <= p < 1:
        raise ValueError(f"dropout p must be a number in [0, 1), not {p!r}")
    return float(p)


DROPOUT_MODES = ("upscale_in_train",)


def check_dropout_mode(mode):
    if mode not in DROPOUT_MODES:
        raise ValueError(f"dropout mode={mode!r}; allowed: 'upscale_in_train' (the kept values "
                         "scaled by 1 / (1 - p) while training, the identity in eval), the "
                         "one mode this trainer computes")
    return mode


def dropout(x, p=0.5, training=True, mode="upscale_in_train", name=None):
    """``x`` with dropout at rate ``p`` while ``training``; the identity otherwise. Paddle's
    arguments by name: ``mode`` (``"upscale_in_train"`` alone) and ``name`` (a label)."""
    p = check_dropout_rate(p)
    check_dropout_mode(mode)
    if not training or p == 0:
        return x if isinstance(x, Tensor) else Tensor(backend.asarray(x))
    return Dropout.apply(x, p)


class DropoutAdd(Function):
    """``residual + dropout(x)`` in one pass (Paddle's ``fused_dropout_add``), one fused kernel
    per direction on a GPU. The mask comes from the same draws of the rank generator as
    ``Dropout``'s, and the values equal those of ``Dropout`` followed by the add bit for bit;
    only the mask (one byte a value) is kept for backward."""

    op_type = "fused_dropout_add"

    def forward(self, x, residual, p):
        draws = backend.rank_rng().random(x.shape)
        y, self.keep = kernels.dropout_add_forward(x, residual, draws, p)
        self.p, self.dtype = p, x.dtype
        return y

    def backward(self, dy):
        return kernels.dropout_add_backward(dy, self.keep, self.p, self.dtype), dy, None


def dropout_add(x, residual, p=0.5, training=True):
    """``residual + dropout(x)`` (``x`` and ``residual`` of one shape) with dropout at rate
    ``p`` while ``training``; ``residual + x`` otherwise."""
    p = check_dropout_rate(p)
    if tuple(x.shape) != tuple(residual.shape):
        raise ValueError(f"dropout_add expects x and residual of one shape, got "
                         f"{tuple(x.shape)} and {tuple(residual.shape)}")
    if not isinstance(residual, Tensor):
        residual = Tensor(backend.asarray(residual))
    if not training or p == 0:
        return residual + x
    return DropoutAdd.apply(x, residual, p)


def check_indices(ids, num_embeddings, what="Embedding"):
    """A ValueError for indices that are not integers or, where they are host arrays, not in
    ``[0, num_embeddings)``. Indices on a device are not read back, which would make the host
    wait for the device at every call (and cannot be captured in a CUDA graph): there
    ``Embedding`` gives the rows of indices out of range NaN values (``gather_rows``), which a
    step's non-finite check reports; the tensor-parallel embedding gives them zeros."""
    if ids.dtype.kind not in "iu":
        raise ValueError(f"{what} expects integer indices, got dtype {ids.dtype}")
    if isinstance(ids, np.ndarray) and ids.size and (
            int(ids.min()) < 0 or int(ids.max()) >= num_embeddings):
        raise ValueError(f"{what} indices must lie in [0, {num_embeddings}), got values in "
                         f"[{int(ids.min())}, {int(ids.max())}]")


def gather_rows(weight, ids):
    """``(weight[ids], the indices used)``. On a device, where ``check_indices`` reads
    nothing, an index outside the rows picks row 0 and its row of the result is NaN, rather
    than the row CuPy's indexing would wrap it to."""
    if isinstance(ids, np.ndarray):
        return weight[ids], ids
    xp = backend.array_module()
    inside = (ids >= 0) & (ids < weight.shape[0])
    ids = xp.where(inside, ids, 0)
    return xp.where(inside[..., None], weight[ids], weight.dtype.type(np.nan)), ids


class Embedding(Function):
    """Rows of ``weight`` picked by integer ``ids``; the gradient of the rows is summed into
    a dense gradient of ``weight`` (a scatter-add)."""

    op_type = "lookup_table"

    def forward(self, ids, weight):
        check_indices(ids, weight.shape[0])
        rows, self.ids = gather_rows(weight, backend.array_module().asarray(ids))
        self.shape = weight.shape
        return rows

    def backward(self, dy):
        xp = backend.array_module()
        grad = xp.zeros(self.shape, dtype=dy.dtype)
        rows = self.ids.reshape(-1)
        values = dy.reshape(-1, self.shape[1])
        xp.add.at(grad, rows, values)
        return None, grad


class SparseLookup(Function):
    """Rows of a parameter-server ``SparseTable``: backward adds the rows' summed gradient to
    the table (``grad_ids``/``grad_values``) for the worker to push. ``anchor`` is the
    table's gradient-requiring empty tensor, which gets the lookup recorded."""

    op_type = "lookup_table"

    def forward(self, ids, anchor, table):
        self.table = table
        rows, self.where = table.gather(ids)
        return rows

    def backward(self, dy):
        self.table.add_grad(self.where, dy)
        return None, None, None


def embedding(x, weight, sparse=False):
    """The rows of ``weight`` at the integer indices ``x``; ``weight`` may be a
    ``SparseTable`` (``sparse=True`` in parameter-server mode)."""
    if sparse:
        return SparseLookup.apply(x, weight.anchor, weight)
    return Embedding.apply(x, weight)

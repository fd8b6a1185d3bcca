"""How a row-major product ``C = A @ B`` of arrays is described to cuBLASLt, which is
column-major.

A matrix ``X`` (``r x c``) whose rows lie ``ld`` elements apart (row-major, the last axis
contiguous) is, read column-major, ``X^T``: ``c`` rows, ``r`` columns, leading dimension
``ld``. So cuBLASLt computes ``C^T = B^T A^T``: its ``A`` is our ``B`` and its ``B`` our ``A``,
and ``D`` (and ``C``, the same memory) is our ``C`` read as ``n`` rows and ``m`` columns. An
operand whose columns are contiguous instead (``w.T``, ``x.swapaxes(-1, -2)`` of a row-major
array) is ``X`` itself read column-major: it is handed over as stored, with the transpose op
(``CUBLAS_OP_T``) in place of a copy. An operand that is neither (a step in both axes, a
negative or unaligned stride, a stride of 0 inside a matrix) is copied C-contiguous.

Leading axes become one batch: cuBLASLt takes a batch count and, per matrix, one stride between
consecutive batch members (0 where an operand is broadcast). Leading axes whose strides make no
such single stride (an operand broadcast along one leading axis but not another) are copied,
the broadcast made real. Where ``B`` is the same for every batch member and the members of
``A`` and ``C`` follow each other evenly (a ``(batch, seq, in)`` activation times a weight),
the batch folds into the rows: one product rather than a batch of them.
"""
import dataclasses

OP_N, OP_T = 0, 1  # cublasOperation_t (cublas_api.h)


@dataclasses.dataclass(frozen=True)
class Matrix:
    """One operand as cuBLASLt stores it: ``rows x cols`` column-major with leading dimension
    ``ld``, ``batch_stride`` elements between batch members, and the op that turns it into the
    operand the product needs (``OP_T`` for an operand stored transposed)."""

    rows: int
    cols: int
    ld: int
    batch_stride: int
    op: int


def _element_strides(array):
    """The strides of ``array`` in elements, or None where one is not a whole number of them."""
    size = array.dtype.itemsize
    if any(stride % size for stride in array.strides):
        return None
    return tuple(stride // size for stride in array.strides)


def batch_stride(shape, strides, lead):
    """The one stride (elements) between consecutive members of the batch ``lead`` (the
    broadcast leading shape) of an operand whose leading axes have ``shape`` and ``strides``;
    0 where it is broadcast over the whole batch, None where no single stride walks it."""
    pad = len(lead) - len(shape)
    stride, inner = None, 1
    for extent, own, step in reversed(list(zip(lead, (1,) * pad + tuple(shape),
                                               (0,) * pad + tuple(strides)))):
        if extent == 1:
            continue
        step = 0 if own == 1 else step
        if stride is None:
            stride = step
        elif step != stride * inner:
            return None
        inner *= extent
    return 0 if stride is None else stride


def _stored(rows, cols, row_step, col_step):
    """``(stored rows, stored cols, ld, op)`` of an ``rows x cols`` matrix with these element
    steps, read column-major for a product that needs it transposed (module docstring); None
    where neither its rows nor its columns are contiguous."""
    if (cols == 1 or col_step == 1) and (rows == 1 or row_step >= max(cols, 1)):
        return cols, rows, row_step if rows > 1 else max(cols, 1), OP_N
    if (rows == 1 or row_step == 1) and (cols == 1 or col_step >= max(rows, 1)):
        return rows, cols, col_step if cols > 1 else max(rows, 1), OP_T
    return None


def describe(array, lead):
    """The ``Matrix`` of ``array`` (at least 2-d, its leading axes broadcasting to ``lead``) in
    a product that needs it transposed, as both operands of ``C^T = B^T A^T`` and its result
    are; None where the array must be copied first (module docstring)."""
    strides = _element_strides(array)
    if strides is None or any(s < 0 for s in strides):
        return None
    rows, cols = array.shape[-2:]
    stored = _stored(rows, cols, strides[-2], strides[-1])
    step = batch_stride(array.shape[:-2], strides[:-2], lead)
    if stored is None or step is None:
        return None
    return Matrix(*stored[:3], step, stored[3])


def fold(a, b, d, count, m):
    """``(a, b, d, count)`` with the batch folded into the rows of ``a`` and ``d`` (cuBLASLt's
    columns: they are read transposed) where ``b`` is the same for every member and ``a`` and
    ``d`` are row-major with their members ``m`` rows apart; the arguments as given otherwise.
    ``a``, ``b`` and ``d`` are our operands' ``Matrix``."""
    if count == 1 or b.batch_stride != 0:
        return a, b, d, count
    for matrix in (a, d):
        if matrix.op != OP_N or matrix.batch_stride != matrix.ld * m:
            return a, b, d, count
    return (dataclasses.replace(a, cols=a.cols * count, batch_stride=0), b,
            dataclasses.replace(d, cols=d.cols * count, batch_stride=0), 1)

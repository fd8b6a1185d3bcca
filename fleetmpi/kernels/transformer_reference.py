"""NumPy references of the transformer step's fused kernels (``layer_norm.cu``,
``softmax_cross_entropy.cu``, ``dropout_add.cu``): they define the kernels' math and are what
runs on the CPU, where they perform the operations the trainer performed before the kernels
existed, in the same order (the same results bit for bit).

Row reductions. LayerNorm and softmax cross entropy reduce each row of their input; the kernels
give each row to one thread, which loops over it. The kernels are checked without a GPU by
compiling them as host C++ and running their simulated threads one after another
(``tests/cuda_host.py``), which holds only for threads that never cooperate: no shared memory,
``__syncthreads``, warp shuffles or atomics. Of the designs that fit, one thread per row is the
simple and exact one: a row is summed in one order, the same on every run (no atomics), and
each kernel stays one launch per direction. Simulating a cooperating block on the host would
need the shim to run threads concurrently up to each barrier, a scheduler of its own, and
partial sums per block would need a second launch or atomics. The cost is on wide rows: a row
is read by a single thread, so neighbouring threads read addresses a row apart, and the forward
runs only as many threads as there are rows (the kernels' comments say what this means on a
GPU). Work that is elementwise (the cross entropy's gradient over the whole vocabulary, dropout)
uses every thread.

Statistics are computed in at least float32 (``compute_dtype``), float16 inputs converted value
by value, as the kernels' float16 instances do.
"""
import numpy as np


def compute_dtype(dtype):
    """The dtype a row's statistics are computed in: at least float32."""
    return np.result_type(dtype, np.float32)


def layer_norm_forward(x, weight, bias, epsilon, xp):
    """LayerNorm over the trailing axes ``weight`` covers: ``(y, mean, rstd, xhat)`` with
    ``y = xhat * weight + bias`` in ``x``'s dtype, ``xhat = (x - mean) * rstd`` and
    ``rstd = 1 / sqrt(var + epsilon)`` (``mean`` and ``rstd`` keep the reduced axes as 1)."""
    axes = tuple(range(x.ndim - weight.ndim, x.ndim))
    xc = x.astype(compute_dtype(x.dtype), copy=False)
    mean = xc.mean(axis=axes, keepdims=True)
    xhat = xc - mean
    rstd = 1.0 / xp.sqrt((xhat * xhat).mean(axis=axes, keepdims=True) + epsilon)
    xhat *= rstd
    y = xhat * weight + bias
    return y.astype(x.dtype, copy=False), mean, rstd, xhat


def layer_norm_xhat(x, mean, rstd):
    """The normalized input formed again from the saved statistics, as forward formed it."""
    xhat = x.astype(mean.dtype, copy=False) - mean
    xhat *= rstd
    return xhat


def layer_norm_backward(dy, xhat, rstd, weight):
    """``(dx, dweight, dbias)`` of ``layer_norm_forward``: with ``g = dy * weight`` and ``n``
    values per row, ``dx = rstd / n * (n g - sum(g) - xhat sum(g xhat))`` (in ``dy``'s dtype);
    the parameters' gradients are the sums over the rows of ``dy * xhat`` and ``dy``."""
    axes = tuple(range(dy.ndim - weight.ndim, dy.ndim))
    lead = tuple(range(dy.ndim - weight.ndim))
    n = weight.size
    dyc = dy.astype(xhat.dtype, copy=False)
    dweight = (dyc * xhat).sum(axis=lead) if lead else dyc * xhat
    dbias = dyc.sum(axis=lead) if lead else dyc
    g = dyc * weight
    dx = rstd / n * (n * g - g.sum(axis=axes, keepdims=True)
                     - xhat * (g * xhat).sum(axis=axes, keepdims=True))
    return dx.astype(dy.dtype, copy=False), dweight, dbias


def log_probs(logits, row_max, row_logsum):
    """``log softmax`` of each row of 2-d ``logits`` from its maximum and the log of its sum of
    ``exp(logits - maximum)``, in their dtype."""
    shifted = logits.astype(row_max.dtype, copy=False) - row_max
    shifted -= row_logsum
    return shifted


def softmax_cross_entropy_forward(logits, labels, xp):
    """``(loss, log_probs, row_max, row_logsum)`` of 2-d ``logits`` and one integer label per
    row: ``loss[r] = log(sum_j exp(logits[r, j] - max_r)) - (logits[r, label_r] - max_r)``,
    ``log_probs`` the log-softmax backward needs, ``row_max`` and ``row_logsum`` (columns) the
    statistics that form it again; all in the compute dtype."""
    x = logits.astype(compute_dtype(logits.dtype), copy=False)
    row_max = x.max(axis=1, keepdims=True)
    shifted = x - row_max
    row_logsum = xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
    shifted -= row_logsum
    return -shifted[xp.arange(x.shape[0]), labels], shifted, row_max, row_logsum


def softmax_cross_entropy_backward(log_probs, labels, scale, dtype, xp):
    """The logits' gradient ``(softmax - onehot(labels)) * scale`` in ``dtype``; ``scale`` is
    each row's loss gradient (a column) or one value for every row."""
    grad = xp.exp(log_probs)
    grad[xp.arange(grad.shape[0]), labels] -= 1
    grad *= scale
    return grad.astype(dtype, copy=False)


def dropout_scale(keep, dtype, p):
    """Dropout's factor of each value in ``dtype``: ``1 / (1 - p)`` where kept, 0 where
    dropped (Paddle's ``upscale_in_train``)."""
    return keep.astype(dtype) * (1.0 / (1.0 - p))


def dropout_add_forward(x, residual, draws, p):
    """``(residual + dropout(x), keep)``: ``keep = draws >= p`` for uniform ``draws`` in
    [0, 1) (the rank generator's, as ``F.dropout`` draws them)."""
    keep = draws >= p
    return residual + x * dropout_scale(keep, x.dtype, p), keep


def dropout_add_backward(dy, keep, p, dtype):
    """The gradient of ``x``: ``dy`` in ``x``'s ``dtype`` times the dropout factor. (The
    residual's is ``dy`` itself.)"""
    return dy.astype(dtype, copy=False) * dropout_scale(keep, dtype, p)

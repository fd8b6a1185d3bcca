"""NumPy reference of ``attention.cu``: scaled dot-product attention, ``softmax(scale * q k^T +
mask) v`` over the last two axes, computed over blocks of keys so that the whole ``(q_len,
k_len)`` scores never exist, forward and backward. It defines the kernels' math and is checked
against ``ScaledDotProductAttention`` (``fleetmpi/nn/functional/attention.py``), which stays the
CPU path.

Forward: an online softmax. For each block of keys, every query row's scores against them,
``s = scale * q . k + mask``; each row keeps its running maximum ``m``, the running sum ``l``
of ``exp(s - m)`` and the output accumulator ``acc = sum exp(s - m) v``, both rescaled by
``exp(m_old - m_new)`` when a block raises the maximum. At the end ``out = acc / l`` and
``lse = m + log(l)``, the log-sum-exp of the row's scores. The kernel runs the same recurrence
one key at a time (blocks of one key), rescaling only when the maximum grows.

Backward: FlashAttention-2's (Dao, 2023), from the output, its gradient and ``lse``: the
probabilities are recomputed as ``P_ij = exp(s_ij - lse_i)``, and with
``D_i = rowsum(dO_i * O_i)``, ``dQ_i = scale * sum_j P_ij (dO_i . V_j - D_i) K_j``,
``dK_j = scale * sum_i P_ij (dO_i . V_j - D_i) Q_i``, ``dV_j = sum_i P_ij dO_i``.

Masks: a boolean mask keeps the positions that are True (a masked score is ``-inf``), a float
mask is added; either broadcasts to ``lead + (q_len, k_len)`` and is read a block at a time.
``is_causal``: query ``i`` attends keys ``j <= i``. A row with every key masked has ``l = 0``:
its output is 0 and its ``lse`` is ``+inf``, so its recomputed probabilities are 0 and it
passes no gradient, as ``ScaledDotProductAttention`` gives.

Computed in at least float32 (``compute_dtype``); the output and the gradients in the inputs'
dtypes, ``lse`` (shape ``lead + (q_len,)``) in the compute dtype.
"""
import math

import numpy as np

from .products import matmul_arrays
from .transformer_reference import compute_dtype

KEY_BLOCK = 64


def _key_blocks(k_len, key_block):
    return [(start, min(start + key_block, k_len)) for start in range(0, k_len, key_block)]


def _scores(q, key, mask, is_causal, start, stop, scale, xp):
    """``scale * q k^T + mask`` of every query against keys ``start:stop`` (``q`` in the compute
    dtype, ``mask`` None or broadcast to the whole scores' shape), ``-inf`` where masked."""
    s = matmul_arrays(q, key[..., start:stop, :].astype(q.dtype, copy=False).swapaxes(-1, -2))
    s *= scale
    if mask is not None:
        block = mask[..., start:stop]
        s += (xp.where(block, q.dtype.type(0), q.dtype.type(-np.inf)) if block.dtype == np.bool_
              else block.astype(q.dtype, copy=False))
    if is_causal:
        later = xp.arange(start, stop) > xp.arange(s.shape[-2])[:, None]
        s += xp.where(later, q.dtype.type(-np.inf), q.dtype.type(0))
    return s


def _prepared(query, key, value, mask, xp):
    """The compute dtype, the query in it, the scale and the mask broadcast (a view)."""
    compute = compute_dtype(np.result_type(query.dtype, key.dtype, value.dtype))
    scores_shape = query.shape[:-1] + key.shape[-2:-1]
    if mask is not None:
        mask = xp.broadcast_to(mask, scores_shape)
    return compute, query.astype(compute, copy=False), compute.type(
        1.0 / math.sqrt(query.shape[-1])), mask


def attention_forward(query, key, value, mask, is_causal, xp, key_block=KEY_BLOCK):
    """``(out, lse)`` of the attention of ``query`` over ``key`` and ``value`` (module
    docstring), ``key_block`` keys at a time."""
    compute, q, scale, mask = _prepared(query, key, value, mask, xp)
    rows = query.shape[:-1] + (1,)
    top = xp.full(rows, -np.inf, dtype=compute)
    total = xp.zeros(rows, dtype=compute)
    acc = xp.zeros(query.shape[:-1] + value.shape[-1:], dtype=compute)
    for start, stop in _key_blocks(key.shape[-2], key_block):
        s = _scores(q, key, mask, is_causal, start, stop, scale, xp)
        new_top = xp.maximum(top, s.max(axis=-1, keepdims=True))
        shift = xp.where(xp.isfinite(new_top), new_top, compute.type(0))
        p = xp.exp(s - shift)
        shrink = xp.exp(top - shift)
        total = total * shrink + p.sum(axis=-1, keepdims=True)
        acc = acc * shrink + matmul_arrays(p, value[..., start:stop, :].astype(compute, copy=False))
        top = new_top
    seen = total > 0
    safe_total = xp.where(seen, total, compute.type(1))
    out = xp.where(seen, acc / safe_total, compute.type(0))
    lse = xp.where(seen, top + xp.log(safe_total), compute.type(np.inf))
    dtype = np.result_type(query.dtype, key.dtype, value.dtype)
    return out.astype(dtype, copy=False), lse[..., 0]


def attention_delta(dout, out, compute):
    """``D = rowsum(dout * out)`` of each query row, in ``compute``: the part of every
    probability's gradient that the softmax subtracts (``sum_j P_ij dO_i . V_j = dO_i . O_i``)."""
    return (dout.astype(compute, copy=False) * out.astype(compute, copy=False)).sum(axis=-1)


def attention_backward(dout, query, key, value, out, lse, mask, is_causal, xp,
                       key_block=KEY_BLOCK):
    """``(dquery, dkey, dvalue)`` of ``attention_forward`` from its ``out`` and ``lse`` and the
    output's gradient ``dout``, ``key_block`` keys at a time."""
    compute, q, scale, mask = _prepared(query, key, value, mask, xp)
    grad_out = dout.astype(compute, copy=False)
    delta = attention_delta(dout, out, compute)[..., None]
    lse = lse[..., None]
    dq = xp.zeros(q.shape, dtype=compute)
    dk = xp.empty(key.shape, dtype=compute)
    dv = xp.empty(value.shape, dtype=compute)
    for start, stop in _key_blocks(key.shape[-2], key_block):
        p = xp.exp(_scores(q, key, mask, is_causal, start, stop, scale, xp) - lse)
        keys = key[..., start:stop, :].astype(compute, copy=False)
        values = value[..., start:stop, :].astype(compute, copy=False)
        dv[..., start:stop, :] = matmul_arrays(p.swapaxes(-1, -2), grad_out)
        ds = p * (matmul_arrays(grad_out, values.swapaxes(-1, -2)) - delta)
        dq += matmul_arrays(ds, keys)
        dk[..., start:stop, :] = matmul_arrays(ds.swapaxes(-1, -2), q)
    dq *= scale
    dk *= scale
    return (dq.astype(query.dtype, copy=False), dk.astype(key.dtype, copy=False),
            dv.astype(value.dtype, copy=False))

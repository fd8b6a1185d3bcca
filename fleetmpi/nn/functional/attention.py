"""Scaled dot-product attention as one fused operation with a hand-written backward.

``softmax(query @ key^T / sqrt(head_dim) + mask) @ value`` composed from the Tensor operations
records a matmul, a scale, a mask, a softmax and a second matmul, each keeping its own
activations; on a CPU the Python cost of those nodes and the extra passes over the
``(seq, seq)`` scores are a large part of a small transformer's step. Here the scores, the
softmax and both products run in one ``Function`` that keeps only the inputs and the attention
probabilities, and its backward computes the three input gradients from those directly.

The scores and the softmax are computed in at least float32 (the inputs are upcast first), with
the row maximum subtracted before ``exp``, so float16 inputs (amp) neither overflow nor lose the
small probabilities; the output and the gradients go back in the inputs' dtypes.

On a GPU the scores are not stored where it can be helped: float16 and bfloat16 attention
without a mask tensor or dropout runs as cuDNN's fused (flash) attention (``cudnn_attention.py``);
what cuDNN does not take (cuDNN unusable or declining the shapes, float32 or float64, a mask)
runs ``attention.cu``'s kernels (``kernel_attention.py``) when it has no dropout and no mask that
needs a gradient; the rest, and everything on the CPU, runs the operation here.
"""
import math

import numpy as np

from ...core import backend
from ... import kernels
from ...kernels.products import matmul_arrays
from ...autograd import Function, Tensor
from ...autograd.autocast import input_dtype
from . import cudnn, cudnn_attention, kernel_attention
from .common import check_dropout_rate


def _swap_last(a):
    return a.swapaxes(-1, -2)


def _check_shapes(query, key, value, mask):
    if query.ndim < 2 or query.ndim != key.ndim or query.ndim != value.ndim:
        raise ValueError(f"scaled_dot_product_attention expects query, key and value of one "
                         f"rank >= 2 ((batch, heads, seq, head_dim)), got shapes "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    lead = tuple(query.shape[:-2])
    if tuple(key.shape[:-2]) != lead or tuple(value.shape[:-2]) != lead:
        raise ValueError(f"scaled_dot_product_attention: query, key and value must share their "
                         f"leading (batch, heads) axes, got shapes {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"scaled_dot_product_attention: key's head_dim {key.shape[-1]} is not "
                         f"query's {query.shape[-1]}")
    if value.shape[-2] != key.shape[-2]:
        raise ValueError(f"scaled_dot_product_attention: value has {value.shape[-2]} positions, "
                         f"key {key.shape[-2]}")
    if mask is not None:
        scores = lead + (query.shape[-2], key.shape[-2])
        try:
            np.broadcast_shapes(tuple(mask.shape), scores)
        except ValueError:
            raise ValueError(f"scaled_dot_product_attention: attn_mask of shape "
                             f"{tuple(mask.shape)} does not broadcast to the scores' shape "
                             f"{scores}") from None


def _additive(mask, dtype, xp):
    """A boolean mask (True: may attend) as 0 / -inf, or a float mask as it is, in ``dtype``."""
    if mask.dtype == np.bool_:
        return xp.where(mask, dtype.type(0), dtype.type(-np.inf))
    return mask.astype(dtype, copy=False)


class ScaledDotProductAttention(Function):
    """``softmax(query @ key^T * scale + mask) @ value`` over the last two axes (module
    docstring); ``dropout_p`` drops attention probabilities with the rank generator's masks."""

    op_type = "flash_attn"

    def forward(self, query, key, value, attn_mask, is_causal=False, dropout_p=0.0):
        xp = backend.array_module()
        _check_shapes(query, key, value, attn_mask)
        compute = np.result_type(query.dtype, key.dtype, value.dtype, np.float32)
        self.query, self.key, self.value = query, key, value
        self.compute = compute
        self.scale = 1.0 / math.sqrt(query.shape[-1])
        q = query.astype(compute, copy=False)
        k = key.astype(compute, copy=False)
        scores = matmul_arrays(q, _swap_last(k))
        scores *= compute.type(self.scale)
        if attn_mask is not None:
            scores += _additive(attn_mask, compute, xp)
        if is_causal:
            rows, columns = scores.shape[-2:]
            scores += xp.triu(xp.full((rows, columns), -np.inf, dtype=compute), k=1)
        top = scores.max(axis=-1, keepdims=True)
        top[~xp.isfinite(top)] = 0
        scores -= top
        probs = xp.exp(scores, out=scores)
        total = probs.sum(axis=-1, keepdims=True)
        total[total == 0] = 1
        probs /= total
        self.probs = probs
        self.keep = None
        if dropout_p:
            keep = backend.rank_rng().random(probs.shape) >= dropout_p
            self.keep = keep.astype(compute) * compute.type(1.0 / (1.0 - dropout_p))
            probs = probs * self.keep
        out = matmul_arrays(probs, value.astype(compute, copy=False))
        return out.astype(np.result_type(query.dtype, key.dtype, value.dtype), copy=False)

    def backward(self, dy):
        needs = self.needs_input_grad
        compute = self.compute
        dy = dy.astype(compute, copy=False)
        probs = self.probs
        dropped = probs if self.keep is None else probs * self.keep
        dvalue = None
        if needs[2]:
            dvalue = matmul_arrays(_swap_last(dropped), dy).astype(self.value.dtype, copy=False)
        if not (needs[0] or needs[1] or needs[3]):
            return None, None, dvalue, None
        dprobs = matmul_arrays(dy, _swap_last(self.value.astype(compute, copy=False)))
        if self.keep is not None:
            dprobs *= self.keep
        dprobs *= probs
        dscores = dprobs
        dscores -= probs * dprobs.sum(axis=-1, keepdims=True)
        dmask = dscores.copy() if needs[3] else None
        dscores *= compute.type(self.scale)
        dquery = dkey = None
        if needs[0]:
            dquery = matmul_arrays(dscores, self.key.astype(compute, copy=False)).astype(
                self.query.dtype, copy=False)
        if needs[1]:
            query = self.query.astype(compute, copy=False)
            dkey = matmul_arrays(_swap_last(dscores), query).astype(self.key.dtype, copy=False)
        return dquery, dkey, dvalue, dmask


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, training=True):
    """Attention of ``query`` over ``key``/``value``, all of shape ``(batch, heads, seq,
    head_dim)`` (any leading axes shared by the three): ``softmax(query @ key^T /
    sqrt(head_dim) + mask) @ value``, one fused operation (Paddle's ``flash_attn`` operator).

    ``attn_mask``: broadcastable to ``(batch, heads, seq_q, seq_k)``; a boolean mask keeps the
    positions that are True, a float mask is added to the scores (and gets a gradient when it
    requires one). ``is_causal``: query ``i`` attends keys ``j <= i`` only. A row with every key
    masked gives zeros. ``dropout_p``: dropout on the attention probabilities while
    ``training``, with the rank generator's masks as ``F.dropout``."""
    dropout_p = check_dropout_rate(dropout_p) if training else 0.0
    plans = None if attn_mask is not None or dropout_p else _fused_plans(query, key, value,
                                                                       is_causal)
    if plans is not None:
        return cudnn_attention.CudnnAttention.apply(query, key, value, plans)
    if not dropout_p and _kernel_runs(query, key, value, attn_mask):
        return kernel_attention.KernelAttention.apply(query, key, value, attn_mask,
                                                      is_causal=bool(is_causal))
    return ScaledDotProductAttention.apply(query, key, value, attn_mask,
                                           is_causal=bool(is_causal), dropout_p=dropout_p)


def _fused_plans(query, key, value, is_causal):
    """cuDNN's fused attention plans for these operands (``cudnn_attention.py``), or None
    where it does not run them."""
    dtype = cudnn.operation_dtype(ScaledDotProductAttention.op_type, query, key, value)
    if dtype is None or dtype.name not in cudnn_attention.FUSED_DTYPES:
        return None
    _check_shapes(query, key, value, None)
    return cudnn_attention.attention_plans(query.shape, key.shape, value.shape, dtype,
                                           bool(is_causal))


def _kernel_runs(query, key, value, mask):
    """Whether ``attention.cu`` runs this attention (``kernel_attention.py``): on a GPU, for a
    mask that needs no gradient (a float mask's gradient is itself a ``(seq, seq)`` array, which
    the operation here forms) and has no more axes than the scores, and where the kernels have
    an instance for the inputs' dtypes under amp and hold their head sizes."""
    if not backend.on_gpu() or (isinstance(mask, Tensor) and not mask.stop_gradient):
        return False
    _check_shapes(query, key, value, mask)
    if mask is not None and mask.ndim > query.ndim:
        return False
    dtypes = [input_dtype(ScaledDotProductAttention.op_type, a.dtype) for a in (query, key, value)]
    return kernels.attention_runs_kernel(dtypes, query.shape[-1], value.shape[-1])

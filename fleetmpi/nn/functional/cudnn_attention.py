"""Scaled dot-product attention as cuDNN's fused (flash) attention graphs, forward and backward
(``cudnn.py`` builds, caches and runs them), in float16 and bfloat16, with or without the
causal mask: ``softmax(query @ key^T / sqrt(head_dim)) @ value`` without the ``(seq, seq)``
scores ever stored. The forward keeps the output and the softmax statistics (each row's
log-sum-exp, float32) that the backward recomputes the probabilities from.

``attention.py`` sends an attention here when it has no mask tensor and no dropout, and its
inputs are of one dtype cuDNN's fused attention computes in; shapes cuDNN declines (its head
sizes and alignments) stay with ``attention.py``'s own operation.
"""
import math

import numpy as np

from ...core import backend
from ...autograd import Function
from . import cudnn
from .cudnn import declare, mark_output as output

FUSED_DTYPES = frozenset({"float16", "bfloat16"})
_STATS = np.float32


def _as_4d(shape):
    """``(batch, heads, seq, head_dim)`` for an attention operand of ``shape``: leading axes
    beyond two folded into the batch, missing ones taken as one."""
    shape = (1,) * max(0, 4 - len(shape)) + tuple(shape)
    return (int(np.prod(shape[:-3], dtype=np.int64)),) + shape[-3:]


def attention_plans(query_shape, key_shape, value_shape, dtype, is_causal):
    """The forward and backward plans of a fused attention in ``dtype`` (``FUSED_DTYPES``) on
    operands of these shapes, or None where cuDNN declines either."""
    q_shape, k_shape, v_shape = (_as_4d(s) for s in (query_shape, key_shape, value_shape))
    o_shape = q_shape[:3] + v_shape[3:]
    stats_shape = q_shape[:3] + (1,)
    scale = 1.0 / math.sqrt(query_shape[-1])

    def operands(graph):
        return {name: declare(graph, name, shape, dtype)
                for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape))}

    def forward(graph):
        tensors = operands(graph)
        out, stats = graph.sdpa(q=tensors["q"], k=tensors["k"], v=tensors["v"],
                                generate_stats=True, attn_scale=scale,
                                use_causal_mask=is_causal, name="sdpa")
        tensors.update(o=output(out, o_shape, dtype), stats=output(stats, stats_shape, _STATS))
        return tensors

    def backward(graph):
        tensors = operands(graph)
        tensors.update(o=declare(graph, "o", o_shape, dtype),
                       do=declare(graph, "do", o_shape, dtype),
                       stats=declare(graph, "stats", stats_shape, _STATS))
        dq, dk, dv = graph.sdpa_backward(q=tensors["q"], k=tensors["k"], v=tensors["v"],
                                         o=tensors["o"], dO=tensors["do"],
                                         stats=tensors["stats"], attn_scale=scale,
                                         use_causal_mask=is_causal, name="sdpa_backward")
        tensors.update(dq=output(dq, q_shape, dtype), dk=output(dk, k_shape, dtype),
                       dv=output(dv, v_shape, dtype))
        return tensors

    key = (q_shape, k_shape, v_shape, bool(is_causal))
    plans = (cudnn.plan("fused attention", dtype, key, forward),
             cudnn.plan("fused attention gradient", dtype, key, backward))
    return None if None in plans else plans


class CudnnAttention(Function):
    """``ScaledDotProductAttention`` without mask and dropout through cuDNN's fused attention
    plans (``attention_plans``): the same output and input gradients."""

    op_type = "flash_attn"

    def forward(self, query, key, value, plans):
        xp = backend.array_module()
        self.shapes = (query.shape, key.shape, value.shape)
        self.q, self.k, self.v = (cudnn.contiguous(a).reshape(_as_4d(a.shape))
                                  for a in (query, key, value))
        fprop = plans[0]
        self.plans = plans
        self.o = xp.empty(fprop.tensors["o"].get_dim(), dtype=self.q.dtype)
        self.stats = xp.empty(fprop.tensors["stats"].get_dim(), dtype=_STATS)
        cudnn.execute(fprop, {"q": self.q, "k": self.k, "v": self.v, "o": self.o,
                              "stats": self.stats})
        return self.o.reshape(query.shape[:-1] + value.shape[-1:])

    def backward(self, dout):
        xp = backend.array_module()
        do = cudnn.contiguous(dout, dtype=self.q.dtype).reshape(self.o.shape)
        grads = {name: xp.empty_like(array)
                 for name, array in (("dq", self.q), ("dk", self.k), ("dv", self.v))}
        cudnn.execute(self.plans[1], dict(q=self.q, k=self.k, v=self.v, o=self.o, do=do,
                                          stats=self.stats, **grads))
        needs = self.needs_input_grad
        return tuple(grads[name].reshape(shape) if needs[i] else None
                     for i, (name, shape) in enumerate(zip(("dq", "dk", "dv"), self.shapes))
                     ) + (None,)

"""Scaled dot-product attention on a GPU through ``fleetmpi/kernels/attention.cu``: forward and
backward without the ``(seq, seq)`` scores or probabilities in memory (an online softmax
forward keeping each query row's log-sum-exp; FlashAttention-2's recomputation backward),
memory O(seq * head_dim) per head.

``attention.py`` sends an attention here on a GPU when cuDNN's fused attention does not take it
(cuDNN unusable, declining the shapes, float32 or float64 inputs, a mask tensor) and it has no
dropout and no mask that needs a gradient; head sizes up to the kernel's ``MAX_HEAD_DIM``.
"""
from ... import kernels
from ...autograd import Function


class KernelAttention(Function):
    """``ScaledDotProductAttention`` without dropout through ``attention.cu``: the same output
    and query, key and value gradients; a mask gets none."""

    op_type = "flash_attn"

    def forward(self, query, key, value, attn_mask, is_causal=False):
        self.inputs = (query, key, value)
        self.mask, self.is_causal = attn_mask, is_causal
        self.out, self.lse = kernels.attention_forward(query, key, value, attn_mask, is_causal)
        return self.out

    def backward(self, dout):
        grads = kernels.attention_backward(dout, *self.inputs, self.out, self.lse, self.mask,
                                           self.is_causal)
        return tuple(g if need else None for g, need in zip(grads, self.needs_input_grad)) + (
            None,)

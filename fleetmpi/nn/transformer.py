"""Paddle's ``MultiHeadAttention``, ``TransformerEncoderLayer`` and ``TransformerEncoder``, with
Paddle 2.5's arguments, defaults, sublayer names (``q_proj``, ``linear1``, ``norm1``...; so a
Paddle ``state_dict`` loads as it is) and arithmetic, composed from the recorded operations.

An ``attn_mask`` is added to the attention scores before the softmax: a float mask as it is,
a bool or integer mask as Paddle converts it, ``(mask - 1) * 1e9`` (True or 1 keeps a key, False
or 0 masks it out). It broadcasts to ``(batch, num_heads, query length, key length)``.
"""
import numpy as np

from ..autograd import Tensor, matmul
from ..core import backend
from . import functional as F
from .basic_layers import Dropout, Linear, check_positive_int
from .containers import LayerList
from .layer import Layer
from .norm import LayerNorm

ACTIVATIONS = {"relu": F.relu}


def convert_attention_mask(mask, dtype):
    """``mask`` as the additive array Paddle makes of it (module docstring); None stays None."""
    if mask is None:
        return None
    array = backend.asarray(getattr(mask, "data", mask))
    if array.dtype == np.bool_ or array.dtype.kind in "iu":
        return (array.astype(dtype) - 1.0) * 1e9
    return array.astype(dtype, copy=False)


def _refuse_cache(cache, where):
    if cache is not None:
        raise ValueError(f"{where} cache is not supported: incremental decoding caches are "
                         "not implemented; run the whole sequence")


class MultiHeadAttention(Layer):
    """``out_proj(softmax(q k^T / sqrt(head_dim) + mask) v)`` over ``num_heads`` heads of
    ``embed_dim // num_heads``, with dropout on the attention weights while training;
    ``need_weights`` returns the weights too. ``key`` and ``value`` default to ``query``."""

    def __init__(self, embed_dim, num_heads, dropout=0.0, kdim=None, vdim=None,
                 need_weights=False, weight_attr=None, bias_attr=None):
        super().__init__()
        self.embed_dim = check_positive_int("embed_dim", embed_dim)
        self.num_heads = check_positive_int("num_heads", num_heads)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} must divide into num_heads={num_heads} "
                             "heads of one size")
        self.head_dim = embed_dim // num_heads
        self.kdim, self.vdim = kdim or embed_dim, vdim or embed_dim
        self.dropout = F.common.check_dropout_rate(dropout)
        self.need_weights = bool(need_weights)
        self.q_proj = Linear(embed_dim, embed_dim, weight_attr, bias_attr)
        self.k_proj = Linear(self.kdim, embed_dim, weight_attr, bias_attr)
        self.v_proj = Linear(self.vdim, embed_dim, weight_attr, bias_attr)
        self.out_proj = Linear(embed_dim, embed_dim, weight_attr, bias_attr)

    def extra_repr(self):
        return f"{self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}"

    def _heads(self, x):
        """``(batch, length, embed_dim)`` to ``(batch, num_heads, length, head_dim)``."""
        batch, length = x.shape[:2]
        return x.reshape([batch, length, self.num_heads, self.head_dim]).transpose([0, 2, 1, 3])

    def forward(self, query, key=None, value=None, attn_mask=None, cache=None):
        _refuse_cache(cache, "MultiHeadAttention")
        if not isinstance(query, Tensor):
            query = Tensor(backend.asarray(query))
        key = query if key is None else key
        value = query if value is None else value
        if query.ndim != 3 or query.shape[-1] != self.embed_dim:
            raise ValueError(f"MultiHeadAttention expects query (batch, length, "
                             f"{self.embed_dim}), got shape {tuple(query.shape)}")
        q = self._heads(self.q_proj(query)) * self.head_dim ** -0.5
        k, v = self._heads(self.k_proj(key)), self._heads(self.v_proj(value))
        scores = matmul(q, k, transpose_y=True)
        mask = convert_attention_mask(attn_mask, scores.dtype)
        if mask is not None:
            scores = scores + mask
        weights = F.dropout(F.softmax(scores), self.dropout, self.training)
        out = matmul(weights, v).transpose([0, 2, 1, 3])
        out = self.out_proj(out.reshape([out.shape[0], out.shape[1], self.embed_dim]))
        return (out, weights) if self.need_weights else out


class TransformerEncoderLayer(Layer):
    """Self-attention then a feed-forward block (``linear2(dropout(activation(linear1(x))))``),
    each added to its input after ``dropout1``/``dropout2`` and layer-normalised after
    (``normalize_before=False``) or before (True), as Paddle's. ``attn_dropout`` and
    ``act_dropout`` default to ``dropout``. Only ``activation="relu"``: Paddle's ``"gelu"`` is
    the exact (erf) form, which this trainer does not compute (``nn.GELU`` is the tanh
    form)."""

    def __init__(self, d_model, nhead, dim_feedforward, dropout=0.1, activation="relu",
                 attn_dropout=None, act_dropout=None, normalize_before=False,
                 weight_attr=None, bias_attr=None, layer_norm_eps=1e-5):
        super().__init__()
        self._config = dict(d_model=d_model, nhead=nhead, dim_feedforward=dim_feedforward,
                            dropout=dropout, activation=activation, attn_dropout=attn_dropout,
                            act_dropout=act_dropout, normalize_before=normalize_before,
                            weight_attr=weight_attr, bias_attr=bias_attr,
                            layer_norm_eps=layer_norm_eps)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not supported; allowed: "
                             f"{sorted(ACTIVATIONS)} (Paddle's 'gelu' is the exact erf form, "
                             "which this trainer does not compute)")
        self.activation = ACTIVATIONS[activation]
        self.normalize_before = bool(normalize_before)
        self.self_attn = MultiHeadAttention(
            d_model, nhead, dropout if attn_dropout is None else attn_dropout,
            weight_attr=weight_attr, bias_attr=bias_attr)
        self.linear1 = Linear(d_model, dim_feedforward, weight_attr, bias_attr)
        self.dropout = Dropout(dropout if act_dropout is None else act_dropout)
        self.linear2 = Linear(dim_feedforward, d_model, weight_attr, bias_attr)
        self.norm1 = LayerNorm(d_model, layer_norm_eps)
        self.norm2 = LayerNorm(d_model, layer_norm_eps)
        self.dropout1, self.dropout2 = Dropout(dropout), Dropout(dropout)

    def _block(self, x, norm, block, dropout):
        out = block(norm(x) if self.normalize_before else x)
        out = x + dropout(out)
        return out if self.normalize_before else norm(out)

    def forward(self, src, src_mask=None, cache=None):
        _refuse_cache(cache, "TransformerEncoderLayer")
        if not isinstance(src, Tensor):
            src = Tensor(backend.asarray(src))
        mask = convert_attention_mask(src_mask, src.dtype)
        src = self._block(src, self.norm1, lambda x: self.self_attn(x, x, x, mask),
                          self.dropout1)
        return self._block(src, self.norm2, lambda x: self.linear2(
            self.dropout(self.activation(self.linear1(x)))), self.dropout2)


class TransformerEncoder(Layer):
    """``num_layers`` encoder layers in turn (the first the one given, the others new ones of
    its configuration, as Paddle builds them), then ``norm`` if one is given."""

    def __init__(self, encoder_layer, num_layers, norm=None):
        super().__init__()
        check_positive_int("num_layers", num_layers)
        self.layers = LayerList([encoder_layer if i == 0
                                 else type(encoder_layer)(**encoder_layer._config)
                                 for i in range(num_layers)])
        self.num_layers = num_layers
        self.norm = norm

    def forward(self, src, src_mask=None, cache=None):
        _refuse_cache(cache, "TransformerEncoder")
        mask = None if src_mask is None else convert_attention_mask(
            src_mask, getattr(src, "dtype", np.float32))
        for layer in self.layers:
            src = layer(src, mask)
        return src if self.norm is None else self.norm(src)

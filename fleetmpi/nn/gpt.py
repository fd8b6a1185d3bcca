"""``GPT``: a small GPT-style decoder (Radford et al. 2018/2019), written only with the public
Layer API, as a user would write one.

Token and position embeddings, ``n_layer`` pre-norm blocks (``x + attn(ln1(x))``, then
``x + mlp(ln2(x))``) of causal multi-head self-attention and a Linear-GELU-Linear MLP, a final
LayerNorm, and logits through the token embedding's own weight (tied input and output
embeddings). The blocks are ``blocks.0``, ``blocks.1``..., the names recompute checkpoints
take. Weights start as GPT-2's: normal(0, 0.02), the projections back into the residual
stream scaled by ``1 / sqrt(2 * n_layer)``, biases zero.
"""
import math

from .. import backend
from ..autograd import matmul
from . import functional as F
from . import initializer
from .containers import LayerList
from .layer import Layer
from .layers import Dropout, Embedding, Linear, check_positive_int
from .norm import LayerNorm

INIT_STD = 0.02


def _normal_(parameter, std):
    parameter.set_value(initializer.Normal(0.0, std)(parameter.shape))


class CausalSelfAttention(Layer):
    """``n_head`` heads of causal attention: one Linear makes queries, keys and values, one
    projects the heads' outputs back."""

    def __init__(self, n_embd, n_head, dropout=0.0, dtype=None):
        super().__init__(dtype)
        if n_embd % n_head:
            raise ValueError(f"n_embd {n_embd} does not divide into n_head {n_head} heads")
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = Linear(n_embd, 3 * n_embd, dtype=dtype)
        self.proj = Linear(n_embd, n_embd, dtype=dtype)
        self.resid_drop = Dropout(dropout)

    def forward(self, x):
        batch, seq, width = x.shape
        heads = [t.reshape([batch, seq, self.n_head, width // self.n_head])
                 .transpose([0, 2, 1, 3]) for t in self.qkv(x).split(3, axis=-1)]
        y = F.scaled_dot_product_attention(*heads, dropout_p=self.dropout, is_causal=True,
                                           training=self.training)
        y = y.transpose([0, 2, 1, 3]).reshape([batch, seq, width])
        return self.resid_drop(self.proj(y))


class FeedForward(Layer):
    """Linear to ``4 * n_embd``, GELU, Linear back."""

    def __init__(self, n_embd, dropout=0.0, dtype=None):
        super().__init__(dtype)
        self.fc = Linear(n_embd, 4 * n_embd, dtype=dtype)
        self.proj = Linear(4 * n_embd, n_embd, dtype=dtype)
        self.drop = Dropout(dropout)

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x))))


class TransformerBlock(Layer):
    """A pre-norm transformer block."""

    def __init__(self, n_embd, n_head, dropout=0.0, dtype=None):
        super().__init__(dtype)
        self.ln1 = LayerNorm(n_embd, dtype=dtype)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, dtype)
        self.ln2 = LayerNorm(n_embd, dtype=dtype)
        self.mlp = FeedForward(n_embd, dropout, dtype)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(Layer):
    """A GPT-style decoder over token ids (module docstring). ``forward(idx)``: integer ids
    ``(batch, seq)`` with ``seq <= block_size`` to logits ``(batch, seq, vocab_size)``."""

    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, dropout=0.0,
                 dtype=None):
        super().__init__(dtype)
        self.vocab_size = check_positive_int("vocab_size", vocab_size)
        self.block_size = check_positive_int("block_size", block_size)
        check_positive_int("n_layer", n_layer)
        check_positive_int("n_head", n_head)
        self.n_embd = check_positive_int("n_embd", n_embd)
        self.wte = Embedding(vocab_size, n_embd, dtype=dtype)
        self.wpe = Embedding(block_size, n_embd, dtype=dtype)
        self.drop = Dropout(dropout)
        self.blocks = LayerList([TransformerBlock(n_embd, n_head, dropout, dtype)
                                 for _ in range(n_layer)])
        self.ln_f = LayerNorm(n_embd, dtype=dtype)
        for name, layer in self.named_sublayers():
            if isinstance(layer, (Linear, Embedding)):
                residual = name.endswith(".proj")
                _normal_(layer.weight, INIT_STD / math.sqrt(2 * n_layer) if residual
                         else INIT_STD)

    def forward(self, idx):
        batch, seq = idx.shape
        if seq > self.block_size:
            raise ValueError(f"GPT got sequences of {seq} tokens; block_size is "
                             f"{self.block_size}")
        positions = backend.array_module().arange(seq)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x).reshape([batch * seq, self.n_embd])
        logits = matmul(x, self.wte.weight, transpose_y=True)
        return logits.reshape([batch, seq, self.vocab_size])

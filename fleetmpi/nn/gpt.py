"""``GPT``: a small GPT-style decoder (Radford et al. 2018/2019), written only with the public
Layer API, as a user would write one.

Token and position embeddings, ``n_layer`` pre-norm blocks (``x + dropout(attn(ln1(x)))``,
then ``x + dropout(mlp(ln2(x)))``) of causal multi-head self-attention and a Linear-GELU-Linear
MLP, a final LayerNorm, and logits through the token embedding's own weight (tied input and
output embeddings). The blocks are ``blocks.0``, ``blocks.1``..., the names recompute
checkpoints take. Weights start as GPT-2's: normal(0, 0.02), the projections back into the
residual stream scaled by ``1 / sqrt(2 * n_layer)``, biases zero.

On a GPU the step's elementwise work runs as fused kernels (``fleetmpi.kernels``): the
LayerNorms, each residual dropout with its add (``F.dropout_add``), the MLP's bias with its GELU
(under ``fuse_elewise_add_act_ops``: the MLP is an ``nn.Sequential``) and the loss
(``F.cross_entropy``).

Tensor-parallel (Megatron-LM's split) over a model-parallel group of more than one rank
(``mp_group``, by default that of the hybrid layout ``fleet.init`` built from
``hybrid_configs``): each rank holds ``n_head / size`` attention heads (their query, key and
value columns and their rows of the output projection), ``4 * n_embd / size`` of the MLP's
hidden features and ``vocab_size / size`` rows of the token embedding; two allreduces per
block in forward (after the attention and the MLP) and two in backward (into their inputs).
The logits are then this rank's part of the vocabulary (``parallel_output``, the default; the
loss is ``nn.ParallelCrossEntropy``) or gathered whole. Every part starts as the slice of the
serial model's weight from the same seed. Dropout follows Paddle's rule: the attention
probabilities (each rank's own heads) are dropped inside the RNG state tracker's
``"model_parallel_rng"`` (``fleetmpi.core.rng_tracker``; ``fleet.init`` seeds it per model-parallel
rank), so each rank draws its own masks; the residual and embedding dropouts act on activations
every rank of the group holds whole, and draw the same masks there from the rank generator,
which the group shares.
"""
import contextlib

import math

from ..core import backend
from ..autograd import matmul
from ..core.rng_tracker import get_rng_state_tracker
from . import functional as F
from . import initializer
from .containers import LayerList, Sequential
from .layer import Layer
from .basic_layers import GELU, Dropout, Embedding, Linear, check_positive_int
from .norm import LayerNorm
from .tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                              initialize_weight, model_parallel_group)

INIT_STD = 0.02
_WEIGHTED = (Linear, Embedding, ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


def _initialize_as_gpt2(model, n_layer):
    """GPT-2's initial weights (module docstring), each rank its part of them."""
    for name, layer in model.named_sublayers():
        if isinstance(layer, _WEIGHTED):
            residual = name.endswith(".proj")
            std = INIT_STD / math.sqrt(2 * n_layer) if residual else INIT_STD
            initialize_weight(layer, initializer.Normal(0.0, std))


def _heads_part(n_head, mp_group):
    size = 1 if mp_group is None else mp_group.size
    if n_head % size:
        raise ValueError(f"n_head {n_head} does not split over the {size} ranks of the "
                         f"model-parallel group")
    return n_head // size


class CausalSelfAttention(Layer):
    """``n_head`` heads of causal attention: one Linear makes queries, keys and values, one
    projects the heads' outputs back (the dropout after it is the block's, fused with its
    residual add)."""

    def __init__(self, n_embd, n_head, dropout=0.0, dtype=None, mp_group=None):
        super().__init__(dtype)
        if n_embd % n_head:
            raise ValueError(f"n_embd {n_embd} does not divide into n_head {n_head} heads")
        self.n_head = _heads_part(n_head, mp_group)
        self.head_size = n_embd // n_head
        self.dropout = dropout
        self.mp_group = mp_group
        if mp_group is None:
            self.qkv = Linear(n_embd, 3 * n_embd, dtype=dtype)
            self.proj = Linear(n_embd, n_embd, dtype=dtype)
        else:
            self.qkv = ColumnParallelLinear(n_embd, 3 * n_embd, has_bias=True,
                                            gather_output=False, mp_group=mp_group, dtype=dtype,
                                            output_blocks=3)
            self.proj = RowParallelLinear(n_embd, n_embd, input_is_parallel=True,
                                          mp_group=mp_group, dtype=dtype)

    def forward(self, x):
        batch, seq, _ = x.shape
        heads = [t.reshape([batch, seq, self.n_head, self.head_size])
                 .transpose([0, 2, 1, 3]) for t in self.qkv(x).split(3, axis=-1)]
        split = self.mp_group is not None and self.dropout and self.training
        with get_rng_state_tracker().rng_state() if split else contextlib.nullcontext():
            y = F.scaled_dot_product_attention(*heads, dropout_p=self.dropout, is_causal=True,
                                               training=self.training)
        y = y.transpose([0, 2, 1, 3]).reshape([batch, seq, self.n_head * self.head_size])
        return self.proj(y)


class FeedForward(Sequential):
    """Linear to ``4 * n_embd``, GELU, Linear back: a Sequential, so that
    ``fuse_elewise_add_act_ops`` runs the first Linear's bias and the GELU as one kernel
    (serial layers only; the dropout after it is the block's, fused with its residual add)."""

    def __init__(self, n_embd, dtype=None, mp_group=None):
        if mp_group is None:
            fc = Linear(n_embd, 4 * n_embd, dtype=dtype)
            proj = Linear(4 * n_embd, n_embd, dtype=dtype)
        else:
            fc = ColumnParallelLinear(n_embd, 4 * n_embd, has_bias=True, gather_output=False,
                                      mp_group=mp_group, dtype=dtype)
            proj = RowParallelLinear(4 * n_embd, n_embd, input_is_parallel=True,
                                     mp_group=mp_group, dtype=dtype)
        super().__init__(("fc", fc), ("act", GELU()), ("proj", proj))


class TransformerBlock(Layer):
    """A pre-norm transformer block: ``x + dropout(attn(ln1(x)))``, then
    ``x + dropout(mlp(ln2(x)))``, each residual dropout and its add one operation
    (``F.dropout_add``)."""

    def __init__(self, n_embd, n_head, dropout=0.0, dtype=None, mp_group=None):
        super().__init__(dtype)
        self.ln1 = LayerNorm(n_embd, dtype=dtype)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, dtype, mp_group)
        self.ln2 = LayerNorm(n_embd, dtype=dtype)
        self.mlp = FeedForward(n_embd, dtype, mp_group)
        self.dropout = dropout

    def forward(self, x):
        x = F.dropout_add(self.attn(self.ln1(x)), x, self.dropout, self.training)
        return F.dropout_add(self.mlp(self.ln2(x)), x, self.dropout, self.training)


class GPT(Layer):
    """A GPT-style decoder over token ids (module docstring). ``forward(idx)``: integer ids
    ``(batch, seq)`` with ``seq <= block_size`` to logits ``(batch, seq, vocab_size)``
    (tensor-parallel with ``parallel_output``: ``(batch, seq, vocab_size / size)``, this
    rank's part of the vocabulary)."""

    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, dropout=0.0,
                 dtype=None, mp_group=None, parallel_output=True):
        super().__init__(dtype)
        self.vocab_size = check_positive_int("vocab_size", vocab_size)
        self.block_size = check_positive_int("block_size", block_size)
        check_positive_int("n_layer", n_layer)
        check_positive_int("n_head", n_head)
        self.n_embd = check_positive_int("n_embd", n_embd)
        self.mp_group = model_parallel_group(mp_group)
        self.parallel_output = bool(parallel_output)
        if self.mp_group is None:
            self.wte = Embedding(vocab_size, n_embd, dtype=dtype)
        else:
            self.wte = VocabParallelEmbedding(vocab_size, n_embd, mp_group=self.mp_group,
                                              dtype=dtype)
        self.wpe = Embedding(block_size, n_embd, dtype=dtype)
        self.drop = Dropout(dropout)
        self.blocks = LayerList([TransformerBlock(n_embd, n_head, dropout, dtype,
                                                  self.mp_group)
                                 for _ in range(n_layer)])
        self.ln_f = LayerNorm(n_embd, dtype=dtype)
        _initialize_as_gpt2(self, n_layer)

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
        logits = matmul(F.copy_to_model_parallel(x, self.mp_group), self.wte.weight,
                        transpose_y=True)
        if not self.parallel_output:
            logits = F.gather_from_model_parallel(logits, self.mp_group)
        return logits.reshape([batch, seq, logits.shape[-1]])


class GPTEmbeddings(Layer):
    """The first piece of ``gpt_pipeline``: token (split over the model-parallel group when
    there is one) and position embeddings."""

    def __init__(self, vocab_size, block_size, n_embd, dropout=0.0, dtype=None, mp_group=None):
        super().__init__(dtype)
        self.block_size = block_size
        self.wte = Embedding(vocab_size, n_embd, dtype=dtype) if mp_group is None else \
            VocabParallelEmbedding(vocab_size, n_embd, mp_group=mp_group, dtype=dtype)
        self.wpe = Embedding(block_size, n_embd, dtype=dtype)
        self.drop = Dropout(dropout)

    def forward(self, idx):
        seq = idx.shape[1]
        if seq > self.block_size:
            raise ValueError(f"GPT got sequences of {seq} tokens; block_size is "
                             f"{self.block_size}")
        return self.drop(self.wte(idx) + self.wpe(backend.array_module().arange(seq)))


class GPTHead(Layer):
    """The last piece of ``gpt_pipeline``: the final LayerNorm and an output projection of its
    own to the vocabulary (split over the model-parallel group: this rank's logits)."""

    def __init__(self, vocab_size, n_embd, dtype=None, mp_group=None):
        super().__init__(dtype)
        self.ln_f = LayerNorm(n_embd, dtype=dtype)
        self.out = Linear(n_embd, vocab_size, bias_attr=False, dtype=dtype) if mp_group is None \
            else ColumnParallelLinear(n_embd, vocab_size, has_bias=False, gather_output=False,
                                      mp_group=mp_group, dtype=dtype)

    def forward(self, x):
        return self.out(self.ln_f(x))


def gpt_pipeline(vocab_size, block_size, n_layer, n_head, n_embd, stages=1, dropout=0.0,
                 dtype=None, mp_group=None):
    """``GPT``'s layers as an ``nn.Sequential`` that ``pipeline`` can cut: ``embed``
    (``GPTEmbeddings``), ``block0`` ... ``block{n_layer-1}`` and ``head`` (``GPTHead``), put
    on ``stages`` stages (block ``i`` on stage ``i * stages // n_layer``, the embeddings on
    the first, the head on the last; ``stages=1``: no stage).

    A stage boundary separates the token embedding from the output projection, so the head has
    a weight of its own instead of GPT's tied one. Tensor-parallel over ``mp_group`` as
    ``GPT`` (by default the layout's model-parallel group), GPT-2's initialisation."""
    from .containers import Sequential

    check_positive_int("stages", stages)
    if stages > n_layer + 1:
        raise ValueError(f"gpt_pipeline: {stages} stages need at least {stages - 1} blocks, "
                         f"n_layer is {n_layer}")
    mp_group = model_parallel_group(mp_group)

    def on_stage(stage, build):
        layer = build()
        if stages > 1:
            layer.set_pipeline_stage(stage)
        return layer
    layers = [("embed", on_stage(0, lambda: GPTEmbeddings(vocab_size, block_size, n_embd,
                                                          dropout, dtype, mp_group)))]
    for i in range(n_layer):
        layers.append((f"block{i}", on_stage(i * stages // n_layer, lambda: TransformerBlock(
            n_embd, n_head, dropout, dtype, mp_group))))
    layers.append(("head", on_stage(stages - 1, lambda: GPTHead(vocab_size, n_embd, dtype,
                                                                 mp_group))))
    model = Sequential(*layers)
    _initialize_as_gpt2(model, n_layer)
    return model

"""A GPT written the PaddleNLP way (``paddlenlp/transformers/gpt/modeling.py`` of PaddleNLP
2.4, cut down to its parts) trained at 4 ranks in dp2 x mp2 and pp2 x mp2, equal to one
process on the global batch.

The model: ``VocabParallelEmbedding`` and a position embedding with ``ParamAttr`` normal
initializers; pre-norm decoder layers of a fused qkv ``ColumnParallelLinear``, a
``RowParallelLinear`` out-projection and a column/row MLP; dropout on the attention weights
under the tracker's ``"local_seed"`` (each model-parallel rank holds its heads) and on the
embeddings and residual branches under ``"global_seed"`` (held whole), seeded as PaddleNLP's
``set_hyrbid_parallel_seed``; an LM head through the embedding's weight (``parallel_matmul``
with ``_c_identity``), ``ParallelCrossEntropy`` per token. The pipeline version is PaddleNLP's
``GPTForPretrainingPipe``: ``PipelineLayer`` with the embedding and the head as one
``SharedLayerDesc``. Training: ``fleet.init(is_collective=True, strategy=strategy)``,
``fleet.distributed_optimizer(opt)`` with no strategy, ``auto_cast`` with PaddleNLP's custom
white list, ``fleet.distributed_scaler(GradScaler(...))``; ``scaler.minimize`` in dp2 x mp2,
``train_batch(..., scaler=scaler)`` in pp2 x mp2.

Dropout stays on (p = 0.2). The masks of one process can only be the ranks' own, so each rank
records the masks it drew (``Dropout``'s forward, watched); the test checks on every rank that
a mask drawn under ``"global_seed"`` is the same on the ranks of a model-parallel group and
differs between data-parallel replicas, and that the attention masks drawn under
``"local_seed"`` differ between the ranks of a model-parallel group; then one process trains
the same model on the global batch with those masks put together (the replicas' along the
batch, the model-parallel ranks' heads along the head axis), and every rank's parameters
equal its part of that process's, the tied embedding equal on both stages.

Each layout runs twice: with auto_cast off (float32, the scaler still scaling), where the
parameters equal one process's to float32 rounding (2e-6); and with ``auto_cast`` O1 and
PaddleNLP's custom white list (layer_norm, softmax and gelu in float16 too), where a
model-parallel rank sums its part of a row-parallel product, a layer norm and the softmax
apart from the others and float16 rounds those sums differently from one process's: 1e-2,
with weights moved by up to ~0.45 (each check also asserts that training moved every weight
by more than its tolerance, and the largest by twenty times more). In one process, replaying
a run's own recorded masks reproduces it bit for bit."""
from types import SimpleNamespace

import numpy as np
import pytest

import fleetmpi as paddle
import fleetmpi as fleet
import fleetmpi.nn as nn
import fleetmpi.nn.functional as F
from fleetmpi.core import backend
from fleetmpi.comm import get_communicator
from fleetmpi.distributed.collective import _c_identity
from fleetmpi.meta_parallel import (ColumnParallelLinear, LayerDesc, ParallelCrossEntropy,
                                    PipelineLayer, RowParallelLinear, SharedLayerDesc,
                                    VocabParallelEmbedding, get_rng_state_tracker)
from fleetmpi.nn.functional.common import Dropout
from comm_support import close, ok

VOCAB, HIDDEN, HEADS, LAYERS, FFN, SEQ = 16, 8, 4, 2, 16, 6
BATCH, STEPS, DROPOUT, INIT_RANGE = 8, 3, 0.2, 0.2
BASIC_SEED = 1234
WHITE_LIST = ["layer_norm", "softmax", "gelu"]       # PaddleNLP's run_pretrain.py
# How far each rank's parameters may be from one process's: float32 (auto_cast off) to its
# rounding; float16 (auto_cast O1 with PaddleNLP's list) to what float16's own rounding of
# the split sums leaves after three steps that move the weights by up to ~0.45.
ATOL = {"float32": 2e-6, "float16": 1e-2}
LOSS_RTOL = {"float32": 1e-6, "float16": 1e-3}


# -- the model, as PaddleNLP writes it ----------------------------------------------------------

def normal_attr():
    return paddle.ParamAttr(initializer=nn.initializer.Normal(mean=0.0, std=INIT_RANGE))


def mp_info():
    """(size, rank, group) of the model-parallel axis (PaddleNLP reads them from the hcg)."""
    try:
        hcg = fleet.get_hybrid_communicate_group()
    except RuntimeError:
        return 1, 0, None
    return (hcg.get_model_parallel_world_size(), hcg.get_model_parallel_rank(),
            hcg.get_model_parallel_group())


def parallel_matmul(lm_output, logit_weights, parallel_output=True):
    world_size, _, group = mp_info()
    if world_size > 1:
        input_parallel = _c_identity(lm_output, group=group)
        return paddle.matmul(input_parallel, logit_weights, transpose_y=True)
    return paddle.matmul(lm_output, logit_weights, transpose_y=True)


def causal_mask(length, dtype):
    return paddle.to_tensor(np.triu(np.full((length, length), -1e4, dtype=dtype), 1))


class MultiHeadAttention(nn.Layer):
    def __init__(self, embed_dim, num_heads, dropout=0.0, weight_attr=None):
        super().__init__()
        num_partitions = mp_info()[0]
        self.embed_dim, self.dropout = embed_dim, dropout
        self.head_dim = embed_dim // num_heads
        assert num_heads % num_partitions == 0
        self.num_heads = num_heads // num_partitions
        self.qkv_proj = ColumnParallelLinear(embed_dim, 3 * embed_dim, weight_attr=weight_attr,
                                             has_bias=True, gather_output=False)
        self.out_proj = RowParallelLinear(embed_dim, embed_dim, weight_attr=weight_attr,
                                          has_bias=True, input_is_parallel=True)

    def _fuse_prepare_qkv(self, query):
        mix_layer = self.qkv_proj(query)
        mix_layer = paddle.reshape(mix_layer, [0, 0, self.num_heads, 3 * self.head_dim])
        mix_layer = paddle.transpose(mix_layer, [0, 2, 1, 3])
        q, k, v = paddle.split(mix_layer, num_or_sections=3, axis=-1)
        return q, k, v

    def forward(self, query, attn_mask=None):
        q, k, v = self._fuse_prepare_qkv(query)
        product = paddle.matmul(x=q * (self.head_dim ** -0.5), y=k, transpose_y=True)
        if attn_mask is not None:
            product = product + attn_mask
        weights = F.softmax(product)
        if self.dropout:
            with get_rng_state_tracker().rng_state("local_seed"):
                weights = F.dropout(weights, self.dropout, training=self.training,
                                    mode="upscale_in_train")
        out = paddle.matmul(weights, v)
        out = paddle.transpose(out, perm=[0, 2, 1, 3])
        out = paddle.reshape(x=out, shape=[0, 0, out.shape[2] * out.shape[3]])
        return self.out_proj(out)


class TransformerDecoderLayer(nn.Layer):
    def __init__(self, d_model, nhead, dim_feedforward, dropout=0.1, weight_attr=None):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, nhead, dropout=dropout,
                                            weight_attr=weight_attr)
        self.linear1 = ColumnParallelLinear(d_model, dim_feedforward, weight_attr=weight_attr,
                                            gather_output=False, has_bias=True)
        self.linear2 = RowParallelLinear(dim_feedforward, d_model, weight_attr=weight_attr,
                                         input_is_parallel=True, has_bias=True)
        self.norm1 = nn.LayerNorm(d_model, epsilon=1e-5)
        self.norm2 = nn.LayerNorm(d_model, epsilon=1e-5)
        self.dropout1 = nn.Dropout(dropout, mode="upscale_in_train")
        self.dropout2 = nn.Dropout(dropout, mode="upscale_in_train")

    def forward(self, tgt, tgt_mask=None):
        if tgt_mask is None:
            tgt_mask = causal_mask(tgt.shape[1], "float32")
        residual = tgt
        tgt = self.norm1(tgt)
        tgt = self.self_attn(tgt, tgt_mask)
        with get_rng_state_tracker().rng_state("global_seed"):
            tgt = residual + self.dropout1(tgt)
        residual = tgt
        tgt = self.norm2(tgt)
        with get_rng_state_tracker().rng_state("global_seed"):
            tgt = residual + self.dropout2(
                self.linear2(F.gelu(self.linear1(tgt), approximate=True)))
        return tgt


class GPTEmbeddings(nn.Layer):
    def __init__(self, vocab_size, hidden_size, hidden_dropout_prob, max_position_embeddings):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(vocab_size, hidden_size,
                                                      weight_attr=normal_attr())
        self.position_embeddings = nn.Embedding(max_position_embeddings, hidden_size,
                                                weight_attr=normal_attr())
        self.dropout = nn.Dropout(hidden_dropout_prob)

    def forward(self, input_ids, position_ids=None):
        if position_ids is None:
            position_ids = paddle.to_tensor(np.arange(input_ids.shape[-1]))
        embeddings = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        with get_rng_state_tracker().rng_state("global_seed"):
            embeddings = self.dropout(embeddings)
        return embeddings


class GPTModel(nn.Layer):
    def __init__(self):
        super().__init__()
        self.embeddings = GPTEmbeddings(VOCAB, HIDDEN, DROPOUT, SEQ)
        self.layers = nn.LayerList([
            TransformerDecoderLayer(HIDDEN, HEADS, FFN, dropout=DROPOUT,
                                    weight_attr=normal_attr()) for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, input_ids):
        output = self.embeddings(input_ids)
        mask = causal_mask(input_ids.shape[-1], "float32")
        for layer in self.layers:
            output = layer(output, tgt_mask=mask)
        return self.norm(output)


class GPTForPretraining(nn.Layer):
    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, input_ids):
        encoder_outputs = self.gpt(input_ids)
        return parallel_matmul(encoder_outputs, self.gpt.embeddings.word_embeddings.weight)


class GPTPretrainingCriterion(nn.Layer):
    def __init__(self):
        super().__init__()
        self.loss_func = ParallelCrossEntropy()

    def forward(self, prediction_scores, masked_lm_labels, loss_mask=None):
        masked_lm_loss = self.loss_func(prediction_scores, masked_lm_labels)
        if loss_mask is None:
            loss_mask = np.ones(masked_lm_labels.shape, dtype="float32")
        loss_mask = loss_mask.reshape([-1])
        masked_lm_loss = (masked_lm_loss.reshape([-1]) * loss_mask).sum()
        return masked_lm_loss / loss_mask.sum()


class EmbeddingPipe(GPTEmbeddings):
    @property
    def embedding_weight(self):
        return self.word_embeddings.weight


def logits_pipe(embedding, output):
    return parallel_matmul(output, embedding.embedding_weight)


def gpt_pipe(topology=None, local=False):
    """PaddleNLP's ``GPTForPretrainingPipe``: the embedding and the tied head one
    SharedLayerDesc, cut at the decoder layers."""
    descs = [SharedLayerDesc("embed", EmbeddingPipe, shared_weight_attr="embedding_weight",
                             vocab_size=VOCAB, hidden_size=HIDDEN,
                             hidden_dropout_prob=DROPOUT, max_position_embeddings=SEQ)]
    descs += [LayerDesc(TransformerDecoderLayer, d_model=HIDDEN, nhead=HEADS,
                        dim_feedforward=FFN, dropout=DROPOUT, weight_attr=normal_attr())
              for _ in range(LAYERS)]
    descs += [LayerDesc(nn.LayerNorm, normalized_shape=HIDDEN),
              SharedLayerDesc("embed", EmbeddingPipe, forward_func=logits_pipe,
                              shared_weight_attr="embedding_weight", vocab_size=VOCAB,
                              hidden_size=HIDDEN, hidden_dropout_prob=DROPOUT,
                              max_position_embeddings=SEQ)]
    return PipelineLayer(layers=descs, loss_fn=GPTPretrainingCriterion(), topology=topology,
                         seg_method="layer:TransformerDecoderLayer",
                         num_stages=2 if local else None, local=local)


def set_hyrbid_parallel_seed(basic_seed, data_world_rank, mp_rank, pp_rank):
    """PaddleNLP's ``run_pretrain.py`` (its spelling)."""
    paddle.seed(basic_seed + data_world_rank)
    tracker = get_rng_state_tracker()
    tracker.reset()
    tracker.add("global_seed", basic_seed + data_world_rank)
    tracker.add("local_seed", basic_seed + 123 + mp_rank * 10 + pp_rank * 1000)


# -- the training scripts -------------------------------------------------------------------

def tokens(step):
    ids = np.random.default_rng(900 + step).integers(0, VOCAB, (BATCH, SEQ + 1))
    return ids[:, :-1], ids[:, 1:]


def sgd(parameters):
    return paddle.optimizer.Momentum(learning_rate=0.5, momentum=0.9, parameters=parameters)


def new_scaler():
    return fleet.distributed_scaler(paddle.amp.GradScaler(init_loss_scaling=1024.0,
                                                          incr_every_n_steps=2))


def train_dygraph(layout, precision, replicas=1, replica=0, local=False):
    """PaddleNLP's run_pretrain.py with pp_degree 1: this rank's share of each batch
    (``local``, ``layout`` None: one process on the whole batch, the reference)."""
    strategy = fleet.DistributedStrategy()
    if layout is not None:
        strategy.hybrid_configs = layout
    fleet.init(is_collective=True, strategy=strategy)
    coords = coordinates()
    set_hyrbid_parallel_seed(BASIC_SEED, coords["data"], coords["model"], coords["pipe"])
    model = fleet.distributed_model(GPTForPretraining(GPTModel()))
    opt = fleet.distributed_optimizer(sgd(model.parameters()), local=local)
    scaler = new_scaler()
    criterion = GPTPretrainingCriterion()
    share = BATCH // replicas
    losses = []
    for step in range(STEPS):
        x, y = (a[replica * share:(replica + 1) * share] for a in tokens(step))
        with paddle.amp.auto_cast(precision == "float16", custom_white_list=WHITE_LIST, level="O1"):
            loss = criterion(model(x), y)
        scaled = scaler.scale(loss)
        scaled.backward()
        scaler.minimize(opt, scaled)
        opt.clear_grad()
        losses.append(float(loss))
    return model, losses, scaler


def train_pipeline(layout, precision, local=False):
    """PaddleNLP's run_pretrain.py with pp_degree 2: train_batch with the scaler (``local``,
    ``layout`` None: every stage in one process on the whole batch, the reference)."""
    strategy = fleet.DistributedStrategy()
    if layout is not None:
        strategy.hybrid_configs = layout
    strategy.pipeline = local
    strategy.pipeline_configs = {"accumulate_steps": 2, "micro_batch_size": BATCH // 2}
    fleet.init(is_collective=True, strategy=strategy)
    coords = coordinates()
    set_hyrbid_parallel_seed(BASIC_SEED, coords["data"], coords["model"], coords["pipe"])
    topology = None if local else fleet.get_hybrid_communicate_group().topology()
    model = fleet.distributed_model(gpt_pipe(topology, local))
    opt = fleet.distributed_optimizer(sgd(model.parameters()), local=local)
    scaler = new_scaler()
    losses = []
    for step in range(STEPS):
        with paddle.amp.auto_cast(precision == "float16", custom_white_list=WHITE_LIST, level="O1"):
            losses.append(float(model.train_batch(list(tokens(step)), opt, scaler=scaler)))
    return model, losses, scaler


def coordinates():
    try:
        hcg = fleet.get_hybrid_communicate_group()
    except RuntimeError:
        return {"data": 0, "model": 0, "pipe": 0}
    return {"data": hcg.get_data_parallel_rank(), "model": hcg.get_model_parallel_rank(),
            "pipe": hcg.get_stage_id()}


# -- the masks ------------------------------------------------------------------------------

class Masks:
    """Watches ``Dropout``'s forward: records each mask (its ``1 / (1 - p)`` or 0 factors) in
    call order, or with ``replay`` set, computes with the given ones instead of drawing."""

    def __init__(self, monkeypatch):
        self.recorded, self.replay = [], None
        draw = Dropout.forward

        def forward(fn, x, p):
            if self.replay is None:
                out = draw(fn, x, p)
                self.recorded.append(backend.to_numpy(fn.scale).copy())
                return out
            fn.scale = backend.asarray(self.replay.pop(0).astype(x.dtype))
            return x * fn.scale
        monkeypatch.setattr(Dropout, "forward", forward)


def gather_masks(recorded):
    """Every rank's masks: ``[rank][call]`` arrays, over the world."""
    comm = get_communicator()
    shapes = np.zeros((len(recorded), 5), dtype=np.int64)
    for i, mask in enumerate(recorded):
        shapes[i, 0] = mask.ndim
        shapes[i, 1:1 + mask.ndim] = mask.shape
    flat = np.concatenate([m.ravel().astype(np.float64) for m in recorded])
    most = comm.allreduce(np.array([len(recorded), flat.size]), op="max")
    table = np.zeros((int(most[0]), 5), dtype=np.int64)
    table[:len(recorded)] = shapes
    values = np.zeros(int(most[1]))
    values[:flat.size] = flat
    tables = backend.to_numpy(comm.allgather(table, stack=True))
    everyone = backend.to_numpy(comm.allgather(values, stack=True))
    masks = []
    for table, values in zip(tables, everyone):
        calls, offset = [], 0
        for row in table:
            if row[0] == 0:
                break
            shape = tuple(int(n) for n in row[1:1 + row[0]])
            size = int(np.prod(shape))
            calls.append(values[offset:offset + size].reshape(shape))
            offset += size
        masks.append(calls)
    return masks


def one_process_masks(masks, forwards):
    """The masks one process on the global batch draws in its ``forwards`` forward passes
    (steps x micro-batches), put together from every rank's, after checking the tracker's
    promises: a ``"global_seed"`` mask (3 axes: batch, sequence, hidden) is the same on the
    ranks of a model-parallel group and differs between replicas; a ``"local_seed"`` mask
    (4 axes: batch, heads, sequence, sequence) differs between the ranks of a model-parallel
    group. Returns them and the failures."""
    hcg = fleet.get_hybrid_communicate_group()
    topology = hcg.topology()
    degrees = {axis: topology.get_dim(axis) for axis in ("data", "pipe", "model")}
    assert degrees["data"] == 1 or forwards == STEPS, "replicas and micro-batches not both"
    where = {}
    for rank in range(topology.world_size()):
        coord = topology.get_coord(rank)
        where[coord.data, coord.pipe, coord.model] = masks[rank]
    failures, serial = [], []
    for forward in range(forwards):
        for stage in range(degrees["pipe"]):
            calls = where[0, stage, 0]
            per_forward = len(calls) // forwards
            for call in range(forward * per_forward, (forward + 1) * per_forward):
                parts = [[where[d, stage, m][call] for m in range(degrees["model"])]
                         for d in range(degrees["data"])]
                if parts[0][0].ndim == 3:
                    if not all(np.array_equal(p, row[0]) for row in parts for p in row):
                        failures.append(f"global_seed mask {call} of stage {stage} differs "
                                        "within a model-parallel group")
                    if degrees["data"] > 1 and np.array_equal(parts[0][0], parts[1][0]):
                        failures.append(f"global_seed mask {call} is the same on two replicas")
                    serial.append(np.concatenate([row[0] for row in parts], axis=0))
                else:
                    if any(np.array_equal(row[0], row[1]) for row in parts):
                        failures.append(f"local_seed mask {call} of stage {stage} is the same "
                                        "on two model-parallel ranks")
                    serial.append(np.concatenate([np.concatenate(row, axis=1)
                                                  for row in parts], axis=0))
    return serial, failures


# -- the tests ------------------------------------------------------------------------------

def four_ranks():
    fleet.init(is_collective=True)
    if fleet.worker_num() != 4:
        pytest.skip("layouts of four ranks")


def check_parameters(model, reference, initial, atol):
    """This rank's parameters equal its part of the one-process model's to ``atol``; training
    moved every weight by more than that, and the largest by twenty times more."""
    from test_hybrid import expected_parts

    want = {name: p.numpy() for name, p in reference.named_parameters()}
    parts = expected_parts(model, SimpleNamespace(state_dict=lambda: want))
    worst = {name: float(np.abs(p.numpy() - parts[name]).max())
             for name, p in model.named_parameters()}
    bad = {name: error for name, error in worst.items() if error > atol}
    ok(not bad, f"rank {fleet.worker_index()}: {bad}")
    moved = [float(np.abs(want[name] - initial[name]).max()) for name in want
             if name.endswith("weight")]
    ok(min(moved) > atol and max(moved) > 20 * atol, f"the weights moved by {moved}")


def test_replaying_a_runs_own_masks_reproduces_it_bit_for_bit(monkeypatch):
    masks = Masks(monkeypatch)
    model, losses, _ = train_dygraph(None, "float32", local=True)
    assert len(masks.recorded) == STEPS * (1 + 3 * LAYERS)
    assert {m.ndim for m in masks.recorded} == {3, 4}
    masks.replay = list(masks.recorded)
    again, again_losses, _ = train_dygraph(None, "float32", local=True)
    assert masks.replay == [] and again_losses == losses
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        np.testing.assert_array_equal(p.numpy(), q.numpy(), err_msg=name)


PRECISIONS = pytest.mark.parametrize("precision", ["float32", "float16"])


@pytest.mark.mpi(min_size=4)
@PRECISIONS
def test_gpt_in_dp2_mp2_equals_one_process_with_the_same_masks(monkeypatch, precision):
    four_ranks()
    masks = Masks(monkeypatch)
    layout = {"dp_degree": 2, "mp_degree": 2, "pp_degree": 1}
    replica = coordinates_of(layout)["data"]
    model, losses, scaler = train_dygraph(layout, precision, replicas=2, replica=replica)
    serial_masks, failures = one_process_masks(gather_masks(masks.recorded), STEPS)
    ok(not failures, "; ".join(failures))
    masks.replay = serial_masks
    fleet.init(is_collective=True, strategy=fleet.DistributedStrategy())
    set_hyrbid_parallel_seed(BASIC_SEED, 0, 0, 0)
    initial = {n: p.numpy() for n, p in GPTForPretraining(GPTModel()).named_parameters()}
    reference, reference_losses, reference_scaler = train_dygraph(None, precision, local=True)
    ok(masks.replay == [], "the one-process run used another number of masks")
    check_parameters(model, reference, initial, ATOL[precision])
    mean = get_communicator().allreduce(np.array(losses), op="mean")
    close(backend.to_numpy(mean), reference_losses, rtol=LOSS_RTOL[precision])
    ok(scaler.loss_scaling == reference_scaler.loss_scaling == 2048.0)


@pytest.mark.mpi(min_size=4)
@PRECISIONS
def test_gpt_pipe_in_pp2_mp2_equals_one_process_with_the_same_masks(monkeypatch, precision):
    four_ranks()
    masks = Masks(monkeypatch)
    model, losses, scaler = train_pipeline({"dp_degree": 1, "mp_degree": 2, "pp_degree": 2},
                                           precision)
    serial_masks, failures = one_process_masks(gather_masks(masks.recorded), 2 * STEPS)
    ok(not failures, "; ".join(failures))
    masks.replay = serial_masks
    layer = model._layers
    ok(layer.shared_comm.get("embed") is not None)
    fleet.init(is_collective=True, strategy=fleet.DistributedStrategy())
    set_hyrbid_parallel_seed(BASIC_SEED, 0, 0, 0)
    initial = {n: p.numpy() for n, p in gpt_pipe(local=True).named_parameters()}
    reference, reference_losses, reference_scaler = train_pipeline(None, precision,
                                                                   local=True)
    ok(masks.replay == [], "the one-process run used another number of masks")
    check_parameters(layer, reference._layers, initial, ATOL[precision])
    weight = layer.shared_layers["embed"].embedding_weight.data
    both = layer.shared_comm["embed"].allgather(weight, stack=True)
    ok(np.array_equal(backend.to_numpy(both[0]), backend.to_numpy(both[1])),
       "the tied embedding differs between the stages")
    close(losses, reference_losses, rtol=LOSS_RTOL[precision])
    ok(scaler.loss_scaling == reference_scaler.loss_scaling == 2048.0)


def coordinates_of(layout):
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = layout
    fleet.init(is_collective=True, strategy=strategy)
    return coordinates()

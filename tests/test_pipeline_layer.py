"""Pipeline parallelism as Paddle dygraph writes it: ``PipelineLayer`` of ``LayerDesc`` and
``SharedLayerDesc`` entries, ``fleet.distributed_model`` returning ``PipelineParallel``, and its
``train_batch``/``eval_batch``.

In one process: ``seg_method``'s cuts (Paddle 2.4's), initial weights that do not depend on
the stage count, train_batch equal to the plain model with its gradients accumulated over the
same micro-batches, a tied weight used twice, recompute_interval bit for bit, eval_batch,
``accumulate_steps``/``micro_batch_size``, and refusals naming the value and what is allowed.
At 2 and 4 ranks (pp2 over the plain world, pp2 x dp2 and pp2 x mp2 from hybrid_configs, an
MLP and a GPT-like model whose token embedding and output projection share one weight over
the first and last stage): every rank's parameters equal its part of the same PipelineLayer
trained in one process on the global batch, the shared weight equal on both stages, each
stage built only its own layers, and the losses those of one process."""
import numpy as np
import pytest

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from fleetmpi.core import backend
from fleetmpi import nn, optimizer
from fleetmpi.autograd import matmul
from fleetmpi.comm.hybrid_topology import CommunicateTopology
from fleetmpi.meta_parallel import (ColumnParallelLinear, LayerDesc, PipelineLayer,
                                    RowParallelLinear, SharedLayerDesc)
from fleetmpi.nn.gpt import TransformerBlock
from fleetmpi.nn.pipeline_segments import segment_parts, uniform_parts
from fleetmpi.nn.tensor_parallel import model_parallel_group
from comm_support import close, ok, raises
from strategy_support import make_strategy

STEPS = 3
BATCH, FEATURES, CLASSES = 8, 6, 4
VOCAB, SEQ, WIDTH = 12, 5, 8


def mlp_descs(parallel=False, dtype="float64"):
    """Linear-Tanh-Linear-Tanh-Linear-Tanh-Linear as descriptions: Megatron's column/row pairs
    when ``parallel`` (serial over a model-parallel group of one)."""
    if parallel:
        pairs = [LayerDesc(ColumnParallelLinear, FEATURES, 16, has_bias=True,
                           gather_output=False, dtype=dtype),
                 LayerDesc(RowParallelLinear, 16, 12, input_is_parallel=True, dtype=dtype),
                 LayerDesc(ColumnParallelLinear, 12, 16, has_bias=True, gather_output=False,
                           dtype=dtype),
                 LayerDesc(RowParallelLinear, 16, CLASSES, input_is_parallel=True, dtype=dtype)]
    else:
        sizes = [FEATURES, 16, 12, 16, CLASSES]
        pairs = [LayerDesc(nn.Linear, a, b, dtype=dtype) for a, b in zip(sizes, sizes[1:])]
    descs = []
    for i, desc in enumerate(pairs):
        descs.append(desc)
        if i < len(pairs) - 1:
            descs.append(LayerDesc(nn.Tanh))
    return descs


class Embed(nn.Layer):
    """Token embedding (split over the model-parallel group when there is one) plus position
    embedding; ``embedding_weight`` is the token table the output projection shares."""

    def __init__(self, dtype="float64"):
        super().__init__()
        group = model_parallel_group()
        self.word = nn.Embedding(VOCAB, WIDTH, dtype=dtype) if group is None else \
            nn.VocabParallelEmbedding(VOCAB, WIDTH, dtype=dtype)
        self.pos = nn.Embedding(SEQ, WIDTH, dtype=dtype)

    @property
    def embedding_weight(self):
        return self.word.weight

    def forward(self, ids):
        return self.word(ids) + self.pos(backend.array_module().arange(ids.shape[1]))


def tied_head(embed, x):
    """Logits through the embedding's own weight (this rank's part of the vocabulary)."""
    return matmul(F.copy_to_model_parallel(x, model_parallel_group()), embed.embedding_weight,
                  transpose_y=True)


def gpt_descs(dtype="float64"):
    """A GPT-like model: the shared embedding, two blocks, a LayerNorm and the tied head."""
    group = model_parallel_group()
    return ([SharedLayerDesc("embed", Embed, None, "embedding_weight", dtype)]
            + [LayerDesc(TransformerBlock, WIDTH, 4, 0.0, dtype, group) for _ in range(2)]
            + [LayerDesc(nn.LayerNorm, WIDTH, dtype=dtype),
               SharedLayerDesc("embed", Embed, tied_head, "embedding_weight", dtype)])


def feature_batch(step, batch=BATCH):
    rng = np.random.default_rng(400 + step)
    return rng.standard_normal((batch, FEATURES)), rng.integers(0, CLASSES, batch)


def token_batch(step, batch=BATCH):
    tokens = np.random.default_rng(300 + step).integers(0, VOCAB, (batch, SEQ + 1))
    return tokens[:, :-1], tokens[:, 1:]


MODELS = {"mlp": (mlp_descs, feature_batch, nn.CrossEntropyLoss, "uniform"),
          "gpt": (gpt_descs, token_batch, lambda: nn.ParallelCrossEntropy(reduction="mean"),
                  "layer:TransformerBlock")}


def momentum(parameters):
    return optimizer.Momentum(learning_rate=0.05, momentum=0.9, parameters=parameters)


def pipeline_configs(batch, accumulate_steps=2):
    return {"accumulate_steps": accumulate_steps, "micro_batch_size": batch // accumulate_steps}


def build(kind, local, num_stages=2, topology=None, **kwargs):
    descs, _, loss, seg_method = MODELS[kind]
    backend.manual_seed(0)
    return PipelineLayer(descs(**kwargs), num_stages=num_stages, topology=topology,
                         loss_fn=loss(), seg_method=seg_method, local=local)


def train_one_process(kind, steps=STEPS, **kwargs):
    """The PipelineLayer built whole in this process, trained on the global batch."""
    fleet.init(is_collective=True, strategy=fleet.DistributedStrategy())
    model = fleet.distributed_model(build(kind, local=True, **kwargs))
    strategy = make_strategy(pipeline=True, pipeline_configs=pipeline_configs(BATCH))
    opt = fleet.distributed_optimizer(momentum(model.parameters()), strategy, local=True)
    batch = MODELS[kind][1]
    losses = [float(model.train_batch(list(batch(step)), opt)) for step in range(steps)]
    return model, losses


# -- one process ----------------------------------------------------------------------------

def test_uniform_cuts_as_paddle_2_4_the_last_stages_one_longer():
    assert uniform_parts(10, 4) == [0, 2, 4, 7, 10]
    assert uniform_parts(6, 3) == [0, 2, 4, 6]
    assert uniform_parts(3, 3) == [0, 1, 2, 3]


def test_layer_method_gives_each_stage_as_many_matching_layers():
    class Block(nn.Layer):
        pass
    entries = [LayerDesc(nn.Embedding, 4, 2)] + [LayerDesc(Block)] * 4 + \
        [LayerDesc(nn.LayerNorm, 2), lambda x: x]
    assert segment_parts(entries, 2, "layer:Block") == [0, 3, 7]
    assert segment_parts(entries, 4, "layer:block") == [0, 2, 3, 4, 7]   # case-insensitive
    layer = build("gpt", local=True)
    assert layer.segment_parts == [0, 2, 5]
    assert [layer.get_stage_from_index(i) for i in range(5)] == [0, 0, 1, 1, 1]


@pytest.mark.parametrize("method, match", [
    ("even", r"seg_method='even'; allowed: 'uniform', 'layer:<ClassName>'"),
    ("layer:", r"seg_method='layer:'; allowed: 'uniform', 'layer:<ClassName>'"),
    ("layer:Conv", r"no layer's class name matches 'Conv'; the classes in layers are "
                   r"\['LayerNorm', 'Linear', 'Tanh'\]"),
    ("layer:Linear", r"3 layers match 'Linear', which do not split evenly over 2 stages"),
])
def test_a_bad_seg_method_is_refused_naming_it_and_what_is_allowed(method, match):
    descs = [LayerDesc(nn.Linear, 2, 2), LayerDesc(nn.Tanh), LayerDesc(nn.Linear, 2, 2),
             LayerDesc(nn.LayerNorm, 2), LayerDesc(nn.Linear, 2, 2)]
    with pytest.raises(ValueError, match=match):
        PipelineLayer(descs, num_stages=2, seg_method=method, local=True)


@pytest.mark.parametrize("make, error, match", [
    (lambda: LayerDesc(len), TypeError, "layer_func must be a subclass of fleetmpi.nn.Layer, "
                                        "not <built-in function len>"),
    (lambda: SharedLayerDesc("", nn.Linear), ValueError, "key must be a non-empty string"),
    (lambda: PipelineLayer([LayerDesc(nn.Tanh)], local=True), ValueError,
     "give num_stages or topology"),
    (lambda: PipelineLayer([LayerDesc(nn.Tanh)], num_stages=2, local=True), ValueError,
     "1 layers cannot fill 2 stages"),
    (lambda: PipelineLayer([], num_stages=1, local=True), ValueError, "layers is empty"),
    (lambda: PipelineLayer([LayerDesc(nn.Tanh), 3], num_stages=1, local=True), TypeError,
     r"layers\[1\] is 3; allowed: a LayerDesc, a SharedLayerDesc, a Layer or a function"),
    (lambda: PipelineLayer([LayerDesc(nn.Tanh)], num_stages=0, local=True), ValueError,
     "num_stages must be a positive integer"),
    (lambda: PipelineLayer([LayerDesc(nn.Tanh)], num_stages=1, recompute_interval=-1,
                           local=True), ValueError,
     r"recompute_interval=-1; allowed: 0 \(off\) or a positive number"),
    (lambda: PipelineLayer([LayerDesc(nn.Tanh)], num_stages=1, recompute_offload=True,
                           local=True), ValueError, "recompute_offload and recompute_partition"),
    (lambda: PipelineLayer([LayerDesc(nn.Tanh)] * 2, num_stages=1, local=True,
                           topology=CommunicateTopology(dims=[1, 2, 1, 1])), ValueError,
     "num_stages=1 but the topology's pipe axis has 2 stages"),
    (lambda: PipelineLayer([SharedLayerDesc("e", nn.Linear, None, "kernel", 2, 2)],
                           num_stages=1, local=True), ValueError,
     "shared_weight_attr='kernel' is not a parameter of Linear"),
])
def test_bad_arguments_are_refused_naming_the_value(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_initial_weights_do_not_depend_on_the_stage_count():
    whole = {n: p.numpy() for n, p in build("mlp", local=True, num_stages=1).named_parameters()}
    for stages in (2, 4):
        split = build("mlp", local=True, num_stages=stages)
        assert split.segment_parts != [0, 7]
        for name, p in split.named_parameters():
            np.testing.assert_array_equal(p.numpy(), whole[name], err_msg=name)
    other = PipelineLayer(mlp_descs(), num_stages=1, local=True)     # the generator moved on
    assert not np.array_equal(other.parameters()[0].numpy(), whole["0.weight"])


def _plain_steps(kind, steps, accumulate_steps):
    """The same PipelineLayer trained as a plain model: forward and backward per micro-batch,
    the gradients of mean loss / accumulate_steps accumulated, one Momentum step."""
    fleet.init(is_collective=True, strategy=fleet.DistributedStrategy())
    layer = build(kind, local=True)
    opt = momentum(layer.parameters())
    losses = []
    for step in range(steps):
        x, y = MODELS[kind][1](step)
        size = len(x) // accumulate_steps
        opt.clear_grad()
        total = 0.0
        for k in range(accumulate_steps):
            part = slice(k * size, (k + 1) * size)
            loss = layer.loss_fn(layer(fleet.to_tensor(x[part])), y[part])
            (loss * (1.0 / accumulate_steps)).backward()
            total += float(loss) / accumulate_steps
        opt.step()
        losses.append(total)
    return layer, losses


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_train_batch_in_one_process_equals_accumulated_gradients(kind):
    plain, plain_losses = _plain_steps(kind, STEPS, 2)
    model, losses = train_one_process(kind)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-12)
    reference = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.numpy(), reference[name].numpy(), rtol=1e-11,
                                   atol=1e-13, err_msg=name)


def test_a_shared_layer_is_one_layer_in_one_process():
    layer = build("gpt", local=True)
    assert [name for name, _ in layer.shared_layers.named_children()] == ["embed"]
    tables = [p for name, p in layer.named_parameters() if name.endswith("word.weight")]
    assert len(tables) == 1 and tables[0].pipeline_stage == 0
    assert layer.run_function[-1].func is tied_head
    assert layer.run_function[-1].args[0] is layer.run_function[0]


def test_recompute_interval_is_bit_for_bit_and_recomputes():
    fleet.init(is_collective=True, strategy=fleet.DistributedStrategy())
    results = []
    for interval in (0, 2):
        backend.manual_seed(0)
        layer = PipelineLayer(gpt_descs(), num_stages=2, seg_method="layer:TransformerBlock",
                              loss_fn=nn.ParallelCrossEntropy(reduction="mean"),
                              recompute_interval=interval, local=True)
        calls = []
        layer.run_function[2].register_forward_pre_hook(lambda *_: calls.append(1))
        model = fleet.distributed_model(layer)
        strategy = make_strategy(pipeline=True, pipeline_configs={"accumulate_steps": 2})
        opt = fleet.distributed_optimizer(momentum(model.parameters()), strategy, local=True)
        for step in range(2):
            model.train_batch(list(token_batch(step)), opt)
        results.append(([p.numpy() for p in model.parameters()], len(calls)))
    for a, b in zip(results[0][0], results[1][0]):
        np.testing.assert_array_equal(a, b)
    # the second block ran again in backward; the first, on the token ids, which need no
    # gradient, is not recomputed (Paddle's rule)
    assert (results[0][1], results[1][1]) == (4, 8)


def test_eval_batch_is_the_forward_alone():
    fleet.init(is_collective=True, strategy=make_strategy(
        pipeline_configs={"accumulate_steps": 2}))
    model = fleet.distributed_model(build("mlp", local=True))
    x, y = feature_batch(0)
    before = [p.numpy().copy() for p in model.parameters()]
    outputs = model.eval_batch([x, y])
    loss = model.eval_batch([x, y], compute_loss=True)
    whole = model._layers(fleet.to_tensor(x))
    assert len(outputs) == 2 and not model._layers.training
    np.testing.assert_allclose(np.concatenate([o.numpy() for o in outputs]), whole.numpy(),
                               rtol=1e-13)
    halves = [float(nn.CrossEntropyLoss()(whole[k * 4:(k + 1) * 4], y[k * 4:(k + 1) * 4]))
              for k in range(2)]
    np.testing.assert_allclose(float(loss), np.mean(halves), rtol=1e-13)
    for a, p in zip(before, model.parameters()):
        np.testing.assert_array_equal(a, p.numpy())


def test_accumulate_steps_and_micro_batch_size_cut_the_batch_as_paddle():
    fleet.init(is_collective=True, strategy=fleet.DistributedStrategy())
    layer = build("mlp", local=True)
    calls = []
    layer.run_function[0].register_forward_pre_hook(lambda _, inputs: calls.append(
        inputs[0].shape[0]))
    model = fleet.distributed_model(layer)
    strategy = make_strategy(pipeline=True, pipeline_configs={"accumulate_steps": 2,
                                                              "micro_batch_size": 3})
    opt = fleet.distributed_optimizer(momentum(model.parameters()), strategy, local=True)
    model.train_batch(list(feature_batch(0, batch=6)), opt)
    assert calls == [3, 3]
    with pytest.raises(ValueError, match=r"a batch of 8 samples \(input\) is not "
                                         r"accumulate_steps x micro_batch_size = 2 x 3 = 6"):
        model.train_batch(list(feature_batch(0, batch=8)), opt)
    both = make_strategy(pipeline=True, pipeline_configs={"accumulate_steps": 2,
                                                          "micro_batch": 3})
    with pytest.raises(ValueError, match=r"pipeline_configs\['micro_batch'\]=3 and "
                                         r"pipeline_configs\['accumulate_steps'\]=2 both set"):
        fleet.distributed_optimizer(momentum(model.parameters()), both, local=True)


def test_train_batch_refuses_what_it_cannot_run():
    fleet.init(is_collective=True, strategy=fleet.DistributedStrategy())
    model = fleet.distributed_model(build("mlp", local=True))
    data = list(feature_batch(0))
    pipelined = fleet.distributed_optimizer(momentum(model.parameters()),
                                            make_strategy(pipeline=True), local=True)
    with pytest.raises(TypeError, match=r"scaler= takes a fleetmpi.amp.GradScaler .*not object"):
        model.train_batch(data, pipelined, scaler=object())
    with pytest.raises(TypeError, match="needs the optimizer fleet.distributed_optimizer "
                                        "returned, not Momentum"):
        model.train_batch(data, momentum(model.parameters()))
    plain = fleet.distributed_optimizer(momentum(model.parameters()), make_strategy(),
                                        local=True)
    with pytest.raises(ValueError, match=r"has no pipeline: set hybrid_configs\['pp_degree'\] "
                                         r"to the PipelineLayer's num_stages \(2\)"):
        model.train_batch(data, plain)
    with pytest.raises(ValueError, match=r"takes data as \[inputs, labels\]"):
        model.train_batch(data[0], pipelined)


def test_the_lr_scheduler_steps_once_per_batch():
    fleet.init(is_collective=True, strategy=fleet.DistributedStrategy())
    model = fleet.distributed_model(build("mlp", local=True))
    scheduler = optimizer.lr.StepDecay(learning_rate=0.1, step_size=1, gamma=0.5)
    opt = fleet.distributed_optimizer(
        optimizer.SGD(learning_rate=scheduler, parameters=model.parameters()),
        make_strategy(pipeline=True), local=True)
    for step in range(2):
        model.train_batch(list(feature_batch(step)), opt, lr_scheduler=scheduler)
    assert scheduler.last_epoch == 2


def test_the_hybrid_topology_answers_paddles_queries():
    topology = CommunicateTopology(["data", "pipe", "sharding", "model"], [2, 2, 1, 2])
    assert topology.world_size() == 8 and topology.get_dim("pipe") == 2
    assert topology.get_coord(5) == (1, 0, 0, 1) and topology.get_coord(5).pipe == 0
    assert topology.get_rank(data=1, pipe=1, sharding=0, model=0) == 6
    with pytest.raises(ValueError, match="the axes are"):
        CommunicateTopology(["pipe", "data"], [2, 2])


# -- several ranks --------------------------------------------------------------------------

def replica_share(kind, step, replica, replicas):
    x, y = MODELS[kind][1](step)
    share = len(x) // replicas
    return [x[replica * share:(replica + 1) * share], y[replica * share:(replica + 1) * share]]


def pipeline_place(layout):
    """``fleet.init`` with the layout ``layout`` (hybrid_configs; None: the plain world cut
    into two stages); returns ``(strategy, topology, replicas, replica)``: the topology a
    PipelineLayer reads its stage from, the data-parallel replicas and this rank's."""
    strategy = make_strategy(**({"hybrid_configs": layout} if layout else {"pipeline": True}))
    fleet.init(is_collective=True, strategy=strategy)
    if layout:
        group = fleet.get_hybrid_communicate_group()
        return (strategy, group.topology(), group.get_data_parallel_world_size(),
                group.get_data_parallel_rank())
    return strategy, None, fleet.worker_num() // 2, fleet.worker_index() // 2


def train_ranks(kind, layout=None, steps=STEPS, **kwargs):
    """Every rank: its stage of ``kind``'s PipelineLayer, trained by train_batch on its
    replica's share of the global batch; ``layout``: hybrid_configs (None: the plain world
    cut into two stages)."""
    strategy, topology, replicas, replica = pipeline_place(layout)
    layer = build(kind, local=False, topology=topology, **kwargs)
    model = fleet.distributed_model(layer)
    strategy.pipeline_configs = pipeline_configs(BATCH // replicas)
    opt = fleet.distributed_optimizer(momentum(model.parameters()), strategy)
    losses = [float(model.train_batch(replica_share(kind, step, replica, replicas), opt))
              for step in range(steps)]
    return layer, opt, losses


def check_stage_equals_one_process(layer, reference):
    """This rank's parameters are its stage's (and only those), each its part of the
    one-process model's."""
    from test_hybrid import expected_parts

    parts = expected_parts(layer, reference)
    names = {name for name, _ in layer.named_parameters()}
    stage_names = {name for name, p in reference.named_parameters()
                   if p.pipeline_stage == layer.stage_id
                   or name.startswith("shared_layers.") and bool(layer.shared_weight_attrs)}
    ok(names == stage_names, f"stage {layer.stage_id} holds {sorted(names)}")
    failures = []     # one verdict for every rank: the stages hold different counts
    for name, p in layer.named_parameters():
        try:
            np.testing.assert_allclose(p.numpy(), parts[name], rtol=1e-9, atol=1e-11,
                                       err_msg=name)
        except AssertionError as error:
            failures.append(str(error))
    ok(not failures, "\n".join(failures))


def check_shared_weight_equal_over_stages(layer):
    comm = layer.shared_comm.get("embed")
    ok((comm is not None) == (layer.stage_id in (0, layer.num_stages - 1)))
    if comm is not None:
        weight = layer.shared_layers["embed"].embedding_weight.data
        gathered = comm.allgather(weight, stack=True)
        ok(all(np.array_equal(backend.to_numpy(g), backend.to_numpy(weight))
               for g in gathered), "the tied weight differs between the stages")
    else:
        ok(True)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_pp2_over_the_plain_world_equals_one_process(kind):
    fleet.init(is_collective=True)
    if fleet.worker_num() != 2:
        pytest.skip("pp2 at two ranks")
    reference, reference_losses = train_one_process(kind)
    layer, opt, losses = train_ranks(kind)
    ok(opt.strategies["pipeline"].layout.stage == layer.stage_id == fleet.worker_index())
    check_stage_equals_one_process(layer, reference._layers)
    close(losses, reference_losses, rtol=1e-10)
    check_shared_weight_equal_over_stages(layer) if kind == "gpt" else ok(True)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("layout", [{"pp_degree": 2, "dp_degree": 2},
                                    {"pp_degree": 2, "mp_degree": 2}],
                         ids=["pp2-dp2", "pp2-mp2"])
def test_hybrid_layouts_of_four_ranks_equal_one_process(kind, layout):
    fleet.init(is_collective=True)
    if fleet.worker_num() != 4:
        pytest.skip("layouts of four ranks")
    parallel = {"parallel": True} if kind == "mlp" and "mp_degree" in layout else {}
    reference, reference_losses = train_one_process(kind, **parallel)
    layer, opt, losses = train_ranks(kind, layout, **parallel)
    group = fleet.get_hybrid_communicate_group()
    ok(layer.stage_id == group.get_stage_id() == opt.strategies["pipeline"].layout.stage)
    check_stage_equals_one_process(layer, reference._layers)
    check_shared_weight_equal_over_stages(layer) if kind == "gpt" else ok(True)
    # each replica's loss is its own share's; their mean is the global batch's
    mean = np.mean(group.get_data_parallel_group().allgather(np.array(losses), stack=True)
                   if group.get_data_parallel_group() is not None else [losses], axis=0)
    close(backend.to_numpy(mean), reference_losses, rtol=1e-10)


@pytest.mark.mpi(min_size=2)
def test_a_layer_and_optimizer_placed_apart_are_refused_on_every_rank():
    fleet.init(is_collective=True)
    if fleet.worker_num() != 2:
        pytest.skip("two ranks")
    fleet.init(is_collective=True, strategy=fleet.DistributedStrategy())
    backend.manual_seed(0)
    whole = PipelineLayer(mlp_descs(), num_stages=2, loss_fn=nn.CrossEntropyLoss(), local=True)
    with raises(ValueError, match="built with every stage in this process"):
        fleet.distributed_optimizer(momentum(whole.parameters()), make_strategy(pipeline=True))
    split = PipelineLayer(mlp_descs(), num_stages=2, loss_fn=nn.CrossEntropyLoss())
    ok(split.stages == [fleet.worker_index()])
    with raises(ValueError, match="holds stage .* of 2 only, but the optimizer runs every "
                                  "stage in this process"):
        fleet.distributed_optimizer(momentum(split.parameters()), make_strategy(pipeline=True),
                                    local=True)
    with raises(ValueError, match="num_stages=3 over a world of 2 ranks"):
        PipelineLayer(mlp_descs(), num_stages=3)
    fleet.init(is_collective=True, strategy=make_strategy(hybrid_configs={"pp_degree": 2}))
    with raises(ValueError, match="num_stages is 1 but the hybrid layout fleet.init built has "
                                  "pp_degree=2"):
        PipelineLayer(mlp_descs(), num_stages=1)

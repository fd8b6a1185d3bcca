"""Hybrid parallelism end to end: ``hybrid_configs`` layouts of four ranks (dp2 x mp2,
pp2 x mp2, dp2 x sharding2, mp4) and a tensor-parallel GPT at mp2, each trained several steps
and compared with one process training the serial model on the global batch: every rank's
parameters equal its part of the serial model's. Composed with amp and recompute; degree
products that do not make the world and strategies that cannot combine with tensor_parallel
are refused at distributed_optimizer, naming why."""
import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.core import backend
from fleetmpi import nn, optimizer
from fleetmpi.optimizer.clip import ClipGradByGlobalNorm
from comm_support import close, ok, raises
from strategy_support import make_strategy

STEPS = 3
BATCH, SEQ, VOCAB = 8, 6, 12
FEATURES, CLASSES = 6, 4


def tiny_gpt(dtype="float64"):
    return nn.GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=8, dtype=dtype)


def token_batch(step):
    tokens = np.random.default_rng(300 + step).integers(0, VOCAB, (BATCH, SEQ + 1))
    return tokens[:, :-1], tokens[:, 1:]


def feature_batch(step):
    rng = np.random.default_rng(400 + step)
    return rng.standard_normal((BATCH, FEATURES)), rng.integers(0, CLASSES, BATCH)


def staged_mlp(parallel, dtype="float64"):
    """Two stages of Megatron's MLP pair (column then row), or their serial Linear layers."""
    layers = []
    sizes = [(FEATURES, 16, 12), (12, 16, CLASSES)]
    for stage, (width, hidden, out) in enumerate(sizes):
        with fleet.device_guard(f"stage:{stage}"):
            if parallel:
                first = nn.ColumnParallelLinear(width, hidden, has_bias=True,
                                                gather_output=False, dtype=dtype)
                second = nn.RowParallelLinear(hidden, out, input_is_parallel=True, dtype=dtype)
            else:
                first, second = nn.Linear(width, hidden, dtype=dtype), \
                    nn.Linear(hidden, out, dtype=dtype)
            layers += [(f"fc{stage}", first), (f"act{stage}", nn.Tanh()),
                       (f"proj{stage}", second)]
    return nn.Sequential(*layers)


def adamw(parameters):
    return optimizer.AdamW(learning_rate=0.01, parameters=parameters)


def momentum(parameters):
    return optimizer.Momentum(learning_rate=0.05, momentum=0.9, parameters=parameters)


def train_serial(make_model, batch, steps=STEPS, strategy=None, make_optimizer=adamw):
    """One process, the serial model, the whole global batch."""
    fleet.init(is_collective=True, strategy=fleet.DistributedStrategy())
    backend.manual_seed(0)
    model = make_model()
    opt = fleet.distributed_optimizer(make_optimizer(model.parameters()),
                                      strategy or fleet.DistributedStrategy(), local=True)
    losses = [float(opt.minimize(model, nn.CrossEntropyLoss(), *batch(step)))
              for step in range(steps)]
    return model, losses


def mean_parallel_cross_entropy():
    return nn.ParallelCrossEntropy(reduction="mean")


def train_hybrid(layout, make_model, batch, steps=STEPS, loss=mean_parallel_cross_entropy,
                 make_optimizer=adamw, **fields):
    """Every rank in the layout ``layout`` (hybrid_configs), on its data replica's share;
    ``loss``: of the vocabulary-split GPT logits, or of whole logits."""
    strategy = make_strategy(hybrid_configs=layout, **fields)
    fleet.init(is_collective=True, strategy=strategy)
    group = fleet.get_hybrid_communicate_group()
    backend.manual_seed(0)
    model = fleet.distributed_model(make_model())
    opt = fleet.distributed_optimizer(make_optimizer(model.parameters()), strategy)
    replicas = group.get_data_parallel_world_size() * group.get_sharding_parallel_world_size()
    replica = (group.get_data_parallel_rank() * group.get_sharding_parallel_world_size()
               + group.get_sharding_parallel_rank())
    share = BATCH // replicas
    losses = []
    for step in range(steps):
        x, y = (a[replica * share:(replica + 1) * share] for a in batch(step))
        losses.append(float(opt.minimize(model, loss(), x, y)))
    return model, opt, losses


def expected_parts(model, serial):
    """``{name: the serial parameter's part this rank holds}`` for ``model``'s parameters."""
    state = serial.state_dict()
    layers = dict(model.named_sublayers())
    parts = {}
    for name, _ in model.named_parameters():
        layer_name, attr = name.rsplit(".", 1)
        layer = layers[layer_name]
        part = ...
        if attr == "weight" and hasattr(layer, "weight_part"):
            part = layer.weight_part
        elif isinstance(layer, nn.ColumnParallelLinear):
            part = layer.weight_part[1]
        parts[name] = state[name][part]
    return parts


def check_equals_serial(model, serial, stage=None, rtol=1e-9, atol=1e-11):
    """Every parameter this rank trains (its stage's, under pipeline) equals its part of the
    serial model's; one verdict shared by every rank, whose stages hold different counts."""
    parts = expected_parts(model, serial)
    state = model.state_dict()
    failures = []
    for name, parameter in model.named_parameters():
        if stage is not None and parameter.pipeline_stage != stage:
            continue
        try:
            np.testing.assert_allclose(state[name], parts[name], rtol=rtol, atol=atol,
                                       err_msg=name)
        except AssertionError as error:
            failures.append(str(error))
    ok(not failures, "\n".join(failures))


def four_ranks():
    fleet.init(is_collective=True)
    if fleet.worker_num() != 4:
        pytest.skip("layouts of four ranks")


@pytest.mark.mpi(min_size=2)
def test_tensor_parallel_gpt_at_mp2_equals_the_serial_gpt():
    fleet.init(is_collective=True)
    if fleet.worker_num() % 2:
        pytest.skip("mp_degree 2 needs an even world")
    serial, serial_losses = train_serial(tiny_gpt, token_batch)
    model, _, losses = train_hybrid({"mp_degree": 2}, tiny_gpt, token_batch)
    ok(model.mp_group is not None and model.mp_group.size == 2)
    ok(model.blocks[0].attn.qkv.weight.shape == [8, 12], "each rank holds half the heads")
    check_equals_serial(model, serial)
    if fleet.worker_num() == 2:
        close(losses, serial_losses, rtol=1e-10)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout, fields", [
    ({"dp_degree": 2, "mp_degree": 2}, {}),
    ({"mp_degree": 4}, {}),
    ({"dp_degree": 2, "sharding_degree": 2}, {}),
    ({"sharding_degree": 2, "mp_degree": 2}, {}),
    ({"dp_degree": 2, "sharding_degree": 2}, {"sharding_configs": {"stage": 3}}),
], ids=["dp2-mp2", "mp4", "dp2-sharding2", "sharding2-mp2", "dp2-sharding2-stage3"])
def test_gpt_layouts_of_four_ranks_equal_one_process(layout, fields):
    four_ranks()
    serial, _ = train_serial(tiny_gpt, token_batch)
    model, opt, _ = train_hybrid(layout, tiny_gpt, token_batch, **fields)
    check_equals_serial(model, serial)
    if layout.get("sharding_degree", 1) > 1:
        sharding = opt.strategies["sharding"]
        ok(sharding.group_size == 2 and sharding.replicas_num == layout.get("dp_degree", 1))
        ok(sharding.stage == fields.get("sharding_configs", {}).get("stage", 1))


@pytest.mark.mpi(min_size=4)
def test_pipeline_of_tensor_parallel_stages_pp2_mp2_equals_one_process():
    four_ranks()
    serial, _ = train_serial(lambda: staged_mlp(False), feature_batch)
    model, opt, _ = train_hybrid({"pp_degree": 2, "mp_degree": 2}, lambda: staged_mlp(True),
                                 feature_batch, loss=nn.CrossEntropyLoss,
                                 pipeline_configs={"micro_batch": 2})
    group = fleet.get_hybrid_communicate_group()
    ok(opt.strategies["pipeline"].layout.stage == group.get_stage_id())
    check_equals_serial(model, serial, stage=group.get_stage_id())


def gpt_in_stages(stages):
    return lambda: nn.gpt_pipeline(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4,
                                   n_embd=8, stages=stages, dtype="float64")


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", [{"pp_degree": 2, "mp_degree": 2},
                                    {"pp_degree": 2, "dp_degree": 2}],
                         ids=["pp2-mp2", "pp2-dp2"])
def test_gpt_in_pipeline_stages_equals_one_process(layout):
    four_ranks()
    serial, _ = train_serial(gpt_in_stages(1), token_batch)
    model, _, _ = train_hybrid(layout, gpt_in_stages(2), token_batch,
                               pipeline_configs={"micro_batch": 2})
    check_equals_serial(model, serial, stage=fleet.get_hybrid_communicate_group().get_stage_id())


@pytest.mark.mpi(min_size=4)
def test_dp2_mp2_with_recompute_equals_one_process():
    four_ranks()
    serial, _ = train_serial(tiny_gpt, token_batch)
    model, opt, _ = train_hybrid({"dp_degree": 2, "mp_degree": 2}, tiny_gpt, token_batch,
                                 recompute=True,
                                 recompute_configs={"checkpoints": ["blocks.0", "blocks.1"]})
    ok(opt.strategies["recompute"].peak_activation_bytes > 0)
    check_equals_serial(model, serial)


@pytest.mark.mpi(min_size=4)
def test_dp2_mp2_under_amp_follows_one_process_under_amp():
    """float16 arithmetic: the sums of the split matrix products run in another order, so
    the comparison is to float16's precision (with Momentum: Adam would blow the rounding
    noise of the key biases' gradients, zero in exact arithmetic, up to whole steps)."""
    four_ranks()
    amp = {"amp": True, "amp_configs": {"init_loss_scaling": 1024.0}}
    serial, serial_losses = train_serial(lambda: tiny_gpt("float32"), token_batch,
                                         strategy=make_strategy(**amp),
                                         make_optimizer=momentum)
    model, opt, losses = train_hybrid({"dp_degree": 2, "mp_degree": 2},
                                      lambda: tiny_gpt("float32"), token_batch,
                                      make_optimizer=momentum, **amp)
    ok(opt.strategies["amp"].communicator.size == 4, "the skip decision is every rank's")
    check_equals_serial(model, serial, rtol=1e-2, atol=1e-3)


@pytest.mark.mpi(min_size=4)
def test_degree_products_that_are_not_the_world_are_refused_at_distributed_optimizer():
    four_ranks()
    fleet.init(is_collective=True, strategy=fleet.DistributedStrategy())
    backend.manual_seed(0)
    model = staged_mlp(False)
    for layout in ({"dp_degree": 3, "mp_degree": 2}, {"mp_degree": 8},
                   {"dp_degree": 2, "mp_degree": 1}):
        strategy = make_strategy(hybrid_configs=layout)
        named = ", ".join(f"{key}={value}" for key, value in
                          {"dp_degree": layout.get("dp_degree", -1),
                           "pp_degree": 1, "sharding_degree": 1,
                           "mp_degree": layout["mp_degree"]}.items())
        with raises(ValueError, match=f"hybrid_configs {named}"):
            fleet.distributed_optimizer(adamw(model.parameters()), strategy)
    with raises(ValueError, match=r"pp_degree'\]=1 but the model has 2 pipeline stage"):
        fleet.distributed_optimizer(adamw(model.parameters()),
                                    make_strategy(hybrid_configs={"mp_degree": 2}))
    with raises(ValueError, match=r"strategy.sharding is on but "
                                  r"hybrid_configs\['sharding_degree'\] is 1"):
        fleet.distributed_optimizer(adamw(model.parameters()),
                                    make_strategy(hybrid_configs={"mp_degree": 2,
                                                                  "pp_degree": 2},
                                                  pipeline=True, sharding=True))


@pytest.mark.mpi(min_size=2)
def test_what_needs_whole_tensors_is_refused_with_tensor_parallel():
    fleet.init(is_collective=True)
    if fleet.worker_num() % 2:
        pytest.skip("mp_degree 2 needs an even world")
    strategy = make_strategy(hybrid_configs={"mp_degree": 2})
    fleet.init(is_collective=True, strategy=strategy)
    backend.manual_seed(0)
    model = tiny_gpt()
    with raises(ValueError, match="strategies lars and tensor_parallel cannot be combined"):
        fleet.distributed_optimizer(
            optimizer.Momentum(learning_rate=0.1, parameters=model.parameters()),
            make_strategy(hybrid_configs={"mp_degree": 2}, lars=True))
    with raises(ValueError, match="tensor_parallel: ClipGradByGlobalNorm"):
        fleet.distributed_optimizer(
            optimizer.AdamW(parameters=model.parameters(),
                            grad_clip=ClipGradByGlobalNorm(1.0)), strategy)
    with raises(ValueError, match="fleet.init laid the ranks out with .*mp_degree=2.* but "
                                  "this strategy has no hybrid degrees"):
        fleet.distributed_optimizer(optimizer.AdamW(parameters=model.parameters()),
                                    fleet.DistributedStrategy())


@pytest.mark.mpi(min_size=2)
def test_tensor_init_seed_reseeds_the_tensor_parallel_weights():
    """fleet.init(strategy=...) with a hybrid layout reseeds from tensor_init_seed: each
    rank's part of a column-parallel layer is its slice of the serial layer made from that
    seed, and another seed gives other weights."""
    from mpi4py import MPI

    size, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    weights = {}
    for seed in (11, 12):
        strategy = fleet.DistributedStrategy()
        strategy.hybrid_configs = {"mp_degree": size}
        strategy.tensor_parallel_configs = {"tensor_init_seed": seed}
        backend.manual_seed(0)
        fleet.init(is_collective=True, strategy=strategy)
        weights[seed] = nn.ColumnParallelLinear(FEATURES, 4 * size).weight.numpy().copy()
        backend.manual_seed(seed)
        serial = nn.Linear(FEATURES, 4 * size).weight.numpy()
        np.testing.assert_array_equal(weights[seed], serial[:, 4 * rank:4 * (rank + 1)])
    ok(not np.array_equal(weights[11], weights[12]))

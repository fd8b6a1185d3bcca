"""sharding stages 2 and 3 on a user's own model (a shared weight, an unused branch, a custom
Function) in both idioms: N ranks equal one process on the global batch with Momentum and Adam;
stage 3 frees what operations saved of a layer's parameters after its forward and gathers
them again for backward; evaluation under no_grad works; a layer used on some ranks only is a
reported error; the configuration is checked."""
import gc
import tracemalloc
import weakref

import numpy as np
import pytest

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from fleetmpi import autograd, nn, optimizer
from fleetmpi.core import backend
from comm_support import close, equal, ok, raises
from strategy_support import global_batch, make_mlp, make_strategy, shard, train, world_gather
from test_user_model import UserNet, train_user_model

STAGES = (1, 2, 3)
OPTIMIZERS = {
    "momentum": lambda ps: optimizer.Momentum(learning_rate=0.1, momentum=0.9, parameters=ps),
    "adam": lambda ps: optimizer.Adam(learning_rate=0.01, parameters=ps),
}


def sharding(stage, **configs):
    return make_strategy(sharding=True, sharding_configs=dict(configs, stage=stage))


# unit_size_MB below any layer's size: one layer a unit, for the tests of when a unit is freed.
LAYER_UNITS = {"unit_size_MB": 1e-6}


def assert_models_close(model, reference, rtol=1e-10, atol=1e-12):
    expected = reference.state_dict()
    for name, value in model.state_dict().items():
        close(value, expected[name], rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("idiom", ["dygraph", "minimize"])
def test_one_process_every_stage_is_the_plain_optimizer_bit_for_bit(stage, idiom):
    model, _, losses = train_user_model(sharding(stage), idiom=idiom, local=True, skip="all",
                                        make_optimizer=OPTIMIZERS["adam"])
    plain, _, plain_losses = train_user_model(idiom=idiom, local=True, skip="all",
                                              make_optimizer=OPTIMIZERS["adam"])
    assert losses == plain_losses
    expected = plain.state_dict()
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("idiom", ["dygraph", "minimize"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_n_ranks_equal_one_process_on_a_user_model(stage, idiom, name):
    model, opt, _ = train_user_model(sharding(stage), idiom=idiom, skip="all",
                                     make_optimizer=OPTIMIZERS[name])
    reference, _, _ = train_user_model(idiom=idiom, local=True, skip="all",
                                       make_optimizer=OPTIMIZERS[name])
    data_parallel, _, _ = train_user_model(idiom=idiom, skip="all",
                                           make_optimizer=OPTIMIZERS[name])
    assert_models_close(model, reference)
    assert_models_close(model, data_parallel)
    for key, value in model.state_dict().items():
        equal(world_gather(value)[0], value, err_msg=key)
    if stage >= 2:
        ok(all(p.grad is None for p in model.parameters()), "a gradient outlived its bucket")


@pytest.mark.mpi(min_size=2)
def test_stage_2_with_a_branch_taken_on_some_ranks_averages_as_data_parallel():
    strategy = sharding(2, hybrid_dp=False)
    model, _, _ = train_user_model(strategy, skip="odd", steps=2)
    data_parallel, _, _ = train_user_model(skip="odd", steps=2)
    assert_models_close(model, data_parallel)


@pytest.mark.mpi(min_size=2)
def test_stage_3_with_a_layer_run_on_some_ranks_only_is_an_error_on_every_rank():
    """The branch's gather is a collective the odd ranks never enter: every rank raises,
    naming the mismatch, instead of hanging or computing with the wrong values."""
    with raises(ValueError, match="allgatherv"):
        train_user_model(sharding(3), skip="odd", steps=1)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", STAGES)
def test_fp16_allreduce_reduce_scatters_in_float16_like_data_parallel(stage):
    model, opt, _ = train(make_strategy(fp16_allreduce=True, sharding=True,
                                        sharding_configs={"stage": stage}), steps=3)
    reference, _, _ = train(make_strategy(), steps=3, local=True)
    plain_fp16, _, _ = train(make_strategy(fp16_allreduce=True), steps=3)
    assert_models_close(model, reference, rtol=1e-2, atol=1e-3)
    assert_models_close(plain_fp16, reference, rtol=1e-2, atol=1e-3)
    ok(opt.strategies["sharding"].compression == "fp16")


def test_stage_3_frees_what_operations_saved_of_a_layer_after_its_forward():
    """After the forward of a deep model only the last layer used is whole: what each
    operation saved for backward was packed, and backward gathers it again (the gradients are
    those of one process without sharding, bit for bit)."""
    fleet.init(is_collective=True)
    sizes = (8, 32, 32, 32, 32, 4)
    backend.manual_seed(0)
    model = make_mlp(sizes=sizes)
    opt = fleet.distributed_optimizer(OPTIMIZERS["momentum"](model.parameters()),
                                      sharding(3, **LAYER_UNITS), local=True)
    gatherer = opt.strategies["sharding"].gatherer
    alive = []
    gathered = gatherer.gathered

    def recording(unit):
        values = gathered(unit)
        if not any(ref() is values for ref in alive):
            alive.append(weakref.ref(values))
        return values
    gatherer.gathered = recording
    x, y = global_batch(0, features=8, classes=4)
    loss = F.cross_entropy(model(x), y)
    gc.collect()
    whole = [ref for ref in alive if ref() is not None]
    ok(len(alive) >= len(sizes) - 1, f"{len(alive)} gathers")
    ok(len(whole) == 1, f"{len(whole)} gathered units still alive after forward")
    gathers_before = gatherer.gathers
    loss.backward()
    ok(gatherer.gathers - gathers_before >= len(sizes) - 2, "backward did not gather again")
    opt.step()
    backend.manual_seed(0)
    plain = make_mlp(sizes=sizes)
    plain_opt = OPTIMIZERS["momentum"](plain.parameters())
    F.cross_entropy(plain(x), y).backward()
    plain_opt.step()
    for name, value in plain.state_dict().items():
        np.testing.assert_array_equal(model.state_dict()[name], value, err_msg=name)


def test_stage_3_releases_a_unit_before_its_gradients_are_reduced():
    """In backward a layer's gathered values, and the views its operations saved, are freed
    as soon as the last backward that needs them is over: with one layer a unit, none is
    alive when a gradient becomes final, nor after backward."""
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = fleet.distributed_model(make_mlp(sizes=(8, 32, 32, 32, 4)))
    opt = fleet.distributed_optimizer(OPTIMIZERS["momentum"](model.parameters()),
                                      sharding(3, **LAYER_UNITS), local=True)
    gatherer, hook = opt.strategies["sharding"].gatherer, opt.strategies["sharding"]
    alive, at_gradients = [], []
    gathered, on_gradient = gatherer.gathered, hook.on_gradient

    def recording(unit):
        values = gathered(unit)
        if not any(ref() is values for ref in alive):
            alive.append(weakref.ref(values))
        return values

    def watching(ctx, parameters):
        at_gradients.append(sum(ref() is not None for ref in alive))
        return on_gradient(ctx, parameters)
    gatherer.gathered, hook.on_gradient = recording, watching
    for step in range(2):
        x, y = global_batch(step, features=8, classes=4)
        loss = F.cross_entropy(model(x), y)
        at_gradients.clear()
        loss.backward()
        ok(len(at_gradients) >= 4, f"{len(at_gradients)} gradient-ready calls")
        ok(max(at_gradients) == 0, f"gathered units alive when gradients were final: "
                                   f"{at_gradients}")
        ok(all(ref() is None for ref in alive), "a gathered unit is alive after backward")
        opt.step()
        opt.clear_grad()


class TiedNet(nn.Layer):
    """Linear layers whose first weight is used again at the end (a tied embedding): its
    gradient starts at the beginning of backward and is final only at its end."""

    def __init__(self, width=128, depth=6):
        super().__init__()
        self.embed = nn.Linear(width, width, dtype="float64")
        self.blocks = nn.LayerList([nn.Linear(width, width, dtype="float64")
                                    for _ in range(depth)])

    def forward(self, x):
        h = F.tanh(self.embed(x))
        for block in self.blocks:
            h = F.tanh(block(h))
        return h @ self.embed.weight


def traced_steps(strategy, steps=2):
    """``(whole-process peak from building on, the most one backward adds over what was
    alive before it, the distributed optimizer)`` of TiedNet with Adam, traced by
    tracemalloc."""
    fleet.init(is_collective=True)
    rank = fleet.worker_index()
    peaks, added = [], 0
    tracemalloc.start()
    try:
        backend.manual_seed(0)
        model = fleet.distributed_model(TiedNet())
        opt = fleet.distributed_optimizer(OPTIMIZERS["adam"](model.parameters()), strategy)
        for step in range(steps):
            x = np.random.default_rng([step, rank]).standard_normal((4, 128))
            loss = (model(x) ** 2).mean()
            before, peak = tracemalloc.get_traced_memory()
            peaks.append(peak)
            tracemalloc.reset_peak()
            loss.backward()
            added = max(added, tracemalloc.get_traced_memory()[1] - before)
            opt.step()
            opt.clear_grad()
            del loss
        peaks.append(tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()
    return max(peaks), added, opt


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fuse_grad_MB", (1, 64))
def test_stage_2_holds_its_shard_and_small_buckets_at_every_bucket_size(fuse_grad_MB):
    """Whatever fuse_grad_size_in_MB is, a stage-2 bucket holds at most a quarter of a shard
    (or one parameter), so backward adds at most two such buckets to what data parallel's
    backward adds, although a tied weight keeps its bucket alive through backward; and the
    whole-process peak stays below data parallel's."""
    stage_2 = sharding(2)
    stage_2.fuse_grad_size_in_MB = fuse_grad_MB
    whole, added, opt = traced_steps(stage_2)
    dp_whole, dp_added, _ = traced_steps(make_strategy(fuse_grad_size_in_MB=fuse_grad_MB))
    hook = opt.strategies["sharding"]
    itemsize = 8
    shard_bytes = -(-opt.inner.space_size // hook.group_size) * itemsize
    largest = max(p.size for p in opt.inner.parameters()) * itemsize
    for bucket in hook.buckets:
        nbytes = (bucket.stop - bucket.start) * itemsize
        ok(nbytes <= max(shard_bytes // 4, largest),
           f"bucket {bucket.index} holds {nbytes} bytes, a shard {shard_bytes}")
    allowed = 2 * max(shard_bytes // 4, largest) + 16384
    ok(added - dp_added <= allowed,
       f"stage 2's backward adds {added} bytes, data parallel's {dp_added}: more than two "
       f"buckets ({allowed} bytes) apart")
    ok(whole < dp_whole, f"stage 2 peaks at {whole} bytes, data parallel at {dp_whole}")


@pytest.mark.parametrize("stage", (2, 3))
def test_evaluation_under_no_grad_and_eval_gives_the_plain_outputs(stage):
    model, _, _ = train_user_model(sharding(stage), local=True, skip="all")
    plain, _, _ = train_user_model(local=True, skip="all")
    x, _ = global_batch(9)
    for m in (model, plain):
        m.eval()
    with autograd.no_grad():
        np.testing.assert_array_equal(model(x).numpy(), plain(x).numpy())


def test_stage_3_parameters_hold_nan_placeholders_outside_use():
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = make_mlp()
    opt = fleet.distributed_optimizer(OPTIMIZERS["adam"](model.parameters()), sharding(3),
                                      local=True)
    opt.strategies["sharding"].gatherer.forget()
    parameters = model.parameters()
    for p in parameters:
        assert p.data.strides == (0,) * p.data.ndim and np.isnan(p.data).all()
    for p in parameters:
        assert list(p.values().shape) == p.shape and np.isfinite(p.values()).all()


def test_a_stage_3_state_dict_loads_back_into_the_shard():
    model, opt, _ = train_user_model(sharding(3), local=True, skip="all", steps=1)
    state = model.state_dict()
    changed = {name: value + 1 for name, value in state.items()}
    model.set_state_dict(changed)
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value, changed[name], err_msg=name)


# -- configuration -----------------------------------------------------------------------------

def build(strategy, parameters=None):
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = make_mlp()
    return fleet.distributed_optimizer(
        OPTIMIZERS["adam"](parameters or model.parameters()), strategy, local=True)


@pytest.mark.parametrize("stage", [0, 4, 2.5, "2"])
def test_a_stage_outside_1_to_3_is_refused(stage):
    strategy = fleet.DistributedStrategy()
    with pytest.raises((TypeError, ValueError), match=r"\['stage'\] = .+allowed: an integer "
                                                      r"in \[1, 3\]"):
        strategy.sharding_configs = {"stage": stage}
    assert strategy.sharding_configs["stage"] == 1


def test_sharding_degree_is_the_group_size_and_conflicts_with_a_different_group_size():
    opt = build(sharding(1, hybrid_dp=True, sharding_degree=1))
    assert opt.strategies["sharding"].group_size == 1
    with pytest.raises(ValueError, match=r"sharding_group_size'\]=2 and .*sharding_degree'\]=4"):
        build(sharding(1, hybrid_dp=True, sharding_group_size=2, sharding_degree=4))


def test_an_optimizer_over_part_of_the_model_is_refused_at_stage_3():
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = make_mlp()
    part = model.parameters()[:2]
    with pytest.raises(ValueError, match="sharding stage 3 frees the model's flat values"):
        fleet.distributed_optimizer(OPTIMIZERS["adam"](part), sharding(3), local=True)


def test_at_stage_2_a_parameter_left_out_of_the_optimizer_keeps_its_own_gradient():
    """Stage 2 frees the whole flat gradient; a parameter the optimizer does not update gets
    gradient storage of its own when backward reaches it, and is not updated."""
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = make_mlp()
    params = model.parameters()
    left_out = params[-1]
    before = left_out.numpy().copy()
    opt = fleet.distributed_optimizer(OPTIMIZERS["adam"](params[:-1]), sharding(2),
                                      local=True)
    x, y = global_batch(0)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    ok(left_out.grad is not None and np.abs(left_out.grad.numpy()).sum() > 0, "no gradient")
    equal(left_out.numpy(), before)
    backend.manual_seed(0)
    plain = make_mlp()
    plain_opt = OPTIMIZERS["adam"](plain.parameters()[:-1])
    F.cross_entropy(plain(x), y).backward()
    plain_opt.step()
    equal(left_out.grad, plain.parameters()[-1].grad)
    for name, value in plain.state_dict().items():
        np.testing.assert_array_equal(model.state_dict()[name], value, err_msg=name)



@pytest.mark.parametrize("stage", (2, 3))
def test_a_checkpoint_inside_a_gradient_merge_window_keeps_the_merged_shard(stage, tmp_path):
    """From stage 2 the window's gradient lives in the shard: a checkpoint taken between two
    steps of a window carries it, and the resumed run ends as the uninterrupted one."""
    from fleetmpi.training import checkpoint
    from strategy_support import momentum

    merge = {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}}
    strategy = make_strategy(sharding=True, sharding_configs={"stage": stage}, **merge)
    uninterrupted, _, _ = train(strategy, momentum, steps=4, local=True)
    model, opt, _ = train(strategy, momentum, steps=3, local=True)
    ok(np.abs(opt.inner.shard_gradient).max() > 0, "no merged gradient at the checkpoint")
    checkpoint.save(str(tmp_path), model, opt, 3)
    backend.manual_seed(5)
    resumed = make_mlp()
    again = fleet.distributed_optimizer(momentum(resumed.parameters()), strategy, local=True)
    info = checkpoint.load(str(tmp_path), resumed, again)
    x, y = global_batch(info["step"])
    again.minimize(resumed, nn.CrossEntropyLoss(), x, y)
    expected = uninterrupted.state_dict()
    for name, value in resumed.state_dict().items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)

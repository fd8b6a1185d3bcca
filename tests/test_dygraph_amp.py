"""fleetmpi.amp: Paddle dygraph's auto_cast, GradScaler and decorate train as strategy.amp with
the same configs, skip exactly the overflowing steps, keep float32 masters at level O2, refuse
bad arguments; fleet.distributed_scaler makes every rank skip when one rank's gradients
overflow."""
import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi import amp, nn, optimizer
from fleetmpi.core import backend
from fleetmpi.autograd import Tensor
from fleetmpi.autograd.autocast import current_policy
from fleetmpi.config.schema_view import ConfigError

from comm_support import ok
from strategy_support import global_batch, make_mlp, make_strategy, shard, world_gather

F16, F32 = np.dtype("float16"), np.dtype("float32")
HUGE = 1e6   # beyond float16's range: a first layer fed this overflows
CONFIGS = {"init_loss_scaling": 1024.0, "incr_every_n_steps": 3, "decr_every_n_nan_or_inf": 1,
           "incr_ratio": 2.0, "decr_ratio": 0.5}
OVERFLOW_STEPS = {2, 5}
STEPS = 7
# N ranks round their float16 partial sums differently from one process on the whole batch.
FP16_ATOL = 2.0 ** -11


def mlp32():
    return make_mlp(dtype="float32")


def batch(step, overflow=OVERFLOW_STEPS):
    x, y = global_batch(step)
    return (x * HUGE if step in overflow else x), y


def momentum(parameters):
    return optimizer.Momentum(learning_rate=0.1, momentum=0.9, parameters=parameters)


def adam(parameters):
    return optimizer.Adam(learning_rate=0.01, parameters=parameters)


def parameters(model):
    return {name: value for name, value in model.state_dict().items()}


def assert_same_math(actual, want, err_msg=""):
    """Bit for bit on NumPy; float16 rounding allowed on a GPU, whose products round
    differently."""
    if backend.on_gpu():
        np.testing.assert_allclose(actual, want, rtol=2 ** -9, atol=FP16_ATOL, err_msg=err_msg)
    else:
        np.testing.assert_array_equal(actual, want, err_msg=err_msg)


def strategy_run(level, make_optimizer, steps=STEPS):
    """strategy.amp with CONFIGS at ``level``, one process: the parameters after each step
    and the strategy."""
    backend.manual_seed(0)
    model = mlp32()
    configs = dict(CONFIGS, level=level)
    opt = fleet.distributed_optimizer(make_optimizer(model.parameters()),
                                      make_strategy(amp=True, amp_configs=configs), local=True)
    after = []
    for step in range(steps):
        opt.minimize(model, nn.CrossEntropyLoss(), *batch(step))
        after.append(parameters(model))
    return after, opt.strategies["amp"]


def scaler_step(model, opt, scaler, x, y, level, idiom):
    with amp.auto_cast(level=level):
        loss = nn.CrossEntropyLoss()(model(x), y)
    scaled = scaler.scale(loss)
    scaled.backward()
    if idiom == "minimize":
        scaler.minimize(opt, scaled)
    elif idiom == "step":
        scaler.step(opt)
        scaler.update()
    else:
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    opt.clear_grad()
    return loss


def scaler_run(level, make_optimizer, idiom, distributed, steps=STEPS):
    """auto_cast and GradScaler with CONFIGS at ``level``, with a plain optimizer or one from
    ``fleet.distributed_optimizer`` (local, no amp): the parameters after each step and the
    scaler."""
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = mlp32()
    opt = make_optimizer(model.parameters())
    if distributed:
        model = fleet.distributed_model(model)
        opt = fleet.distributed_optimizer(opt, fleet.DistributedStrategy(), local=True)
    scaler = amp.GradScaler(**CONFIGS)
    after = []
    for step in range(steps):
        scaler_step(model, opt, scaler, *batch(step), level, idiom)
        after.append(parameters(model))
    return after, scaler


@pytest.mark.parametrize("distributed", [False, True], ids=["optimizer", "distributed"])
@pytest.mark.parametrize("idiom", ["minimize", "step", "unscale_"])
@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("make_optimizer", [momentum, adam], ids=["momentum", "adam"])
def test_auto_cast_and_grad_scaler_train_as_strategy_amp(make_optimizer, level, idiom,
                                                         distributed):
    want, amp_strategy = strategy_run(level, make_optimizer)
    got, scaler = scaler_run(level, make_optimizer, idiom, distributed)
    for step, (a, b) in enumerate(zip(got, want)):
        for name in b:
            assert_same_math(a[name], b[name], f"step {step}: {name}")
    assert amp_strategy.skipped_steps == len(OVERFLOW_STEPS)
    assert (scaler.loss_scaling, scaler.good_steps, scaler.bad_steps, scaler.skipped_steps) == \
        (amp_strategy.loss_scaling, amp_strategy.good_steps, amp_strategy.bad_steps,
         amp_strategy.skipped_steps)


@pytest.mark.parametrize("distributed", [False, True], ids=["optimizer", "distributed"])
def test_an_overflowing_step_is_skipped_and_the_scale_halved(distributed):
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = mlp32()
    opt = momentum(model.parameters())
    if distributed:
        model = fleet.distributed_model(model)
        opt = fleet.distributed_optimizer(opt, fleet.DistributedStrategy(), local=True)
    scaler = amp.GradScaler(init_loss_scaling=1024.0, decr_every_n_nan_or_inf=1)
    before = parameters(model)
    loss = scaler_step(model, opt, scaler, *batch(0, overflow={0}), "O1", "minimize")
    assert not np.isfinite(loss.item())
    for name, value in parameters(model).items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    inner = opt.inner if distributed else opt
    assert inner.step_count == 0
    assert (scaler.loss_scaling, scaler.skipped_steps, scaler.bad_steps) == (512.0, 1, 0)
    scaler_step(model, opt, scaler, *batch(1, overflow=set()), "O1", "minimize")
    assert inner.step_count == 1 and scaler.good_steps == 1
    assert any(not np.array_equal(value, before[name])
               for name, value in parameters(model).items())


def test_the_default_scale_rule_is_paddle_2_4s():
    scaler = amp.GradScaler()
    state = scaler.state_dict()
    assert float(state["scale"][0]) == 2.0 ** 15
    assert {key: state[key] for key in ("incr_ratio", "decr_ratio", "incr_every_n_steps",
                                        "decr_every_n_nan_or_inf", "use_dynamic_loss_scaling",
                                        "incr_count", "decr_count")} == {
        "incr_ratio": 2.0, "decr_ratio": 0.5, "incr_every_n_steps": 1000,
        "decr_every_n_nan_or_inf": 2, "use_dynamic_loss_scaling": True, "incr_count": 0,
        "decr_count": 0}


def test_unscale_divides_the_gradients_once_and_the_order_is_checked():
    backend.manual_seed(0)
    model = mlp32()
    opt = momentum(model.parameters())
    scaler = amp.GradScaler(init_loss_scaling=256.0)
    with amp.auto_cast():
        loss = nn.CrossEntropyLoss()(model(global_batch(0)[0]), global_batch(0)[1])
    scaler.scale(loss).backward()
    scaled = {name: p.grad.numpy().copy() for name, p in model.named_parameters()}
    scaler.unscale_(opt)
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(p.grad.numpy(),
                                      scaled[name] * np.float32(1 / 256.0), err_msg=name)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    scaler.update()
    assert opt.step_count == 1


def test_the_scaled_loss_seeds_the_scale_in_float32_outside_auto_cast():
    scaler = amp.GradScaler(init_loss_scaling=2.0 ** 15)
    loss = Tensor(backend.asarray(np.array(3.0, dtype=F16)), stop_gradient=False)
    with amp.auto_cast(level="O2"):
        scaled = scaler.scale(loss)
    assert scaled.dtype == F32 and scaled.shape == []
    assert float(scaled.item()) == 3.0 * 2 ** 15       # 98304 does not fit float16
    scaled.backward()
    assert loss.grad.dtype == F16 and float(loss.grad) == 2.0 ** 15


def test_state_dict_round_trip():
    backend.manual_seed(0)
    model = mlp32()
    opt = momentum(model.parameters())
    scaler = amp.GradScaler(**CONFIGS)
    for step in range(4):
        scaler_step(model, opt, scaler, *batch(step), "O1", "minimize")
    state = scaler.state_dict()
    other = amp.GradScaler()
    other.load_state_dict(state)
    assert other.state_dict().keys() == state.keys()
    for key, value in state.items():
        np.testing.assert_array_equal(other.state_dict()[key], value, err_msg=key)
    assert (other.loss_scaling, other.good_steps, other.bad_steps) == \
        (scaler.loss_scaling, scaler.good_steps, scaler.bad_steps)
    with pytest.raises(RuntimeError, match="empty"):
        other.load_state_dict({})
    assert amp.GradScaler(enable=False).state_dict() == {}


def test_a_disabled_scaler_is_the_optimizer_itself():
    backend.manual_seed(0)
    model = mlp32()
    opt = momentum(model.parameters())
    scaler = amp.GradScaler(enable=False)
    x, y = global_batch(0)
    loss = nn.CrossEntropyLoss()(model(x), y)
    assert scaler.scale(loss) is loss
    loss.backward()
    scaler.step(opt)
    assert opt.step_count == 1 and not scaler.is_enable()


def test_auto_cast_computes_as_the_strategys_lists():
    backend.manual_seed(0)
    model = mlp32()
    x = global_batch(0)[0].astype(F32)
    with amp.auto_cast():
        assert current_policy().white_list >= {"matmul"}
        assert model(x).dtype == F16                        # the last Linear: a matmul
        with amp.auto_cast(enable=False):
            assert current_policy() is None and model(x).dtype == F32
        with amp.auto_cast(custom_black_list={"matmul"}):
            assert model(x).dtype == F32
    with amp.auto_cast(level="O2", custom_white_list=["softmax_with_cross_entropy"]):
        assert current_policy().pure
        assert "softmax_with_cross_entropy" in current_policy().white_list
    with amp.auto_cast(level="o0"):
        assert current_policy() is None
    assert current_policy() is None


def test_decorate_o2_keeps_float32_master_weights():
    backend.manual_seed(0)
    model = mlp32()
    opt = momentum(model.parameters())
    decorated = amp.decorate(models=model, optimizers=opt, level="O2")
    assert decorated[0] is model and decorated[1] is opt
    assert amp.decorate(model, level="O2") is model
    scaler = amp.GradScaler()
    x, y = global_batch(0)
    with amp.auto_cast(level="O2"):
        logits = model(x.astype(F32))
        assert logits.dtype == F16
        loss = nn.CrossEntropyLoss()(logits, y)
    scaled = scaler.scale(loss)
    scaled.backward()
    scaler.minimize(opt, scaled)
    assert opt.step_count == 1
    assert {p.dtype for p in model.parameters()} == {F32}
    assert {state.dtype for run in opt.run_states for state in run.values()} == {F32}


@pytest.mark.parametrize("call, error, words", [
    (lambda: amp.GradScaler(incr_ratio=1.0), ConfigError, "GradScaler incr_ratio = 1.0"),
    (lambda: amp.GradScaler(decr_ratio=1.5), ConfigError, "GradScaler decr_ratio = 1.5"),
    (lambda: amp.GradScaler(incr_every_n_steps=0), ConfigError, "incr_every_n_steps = 0"),
    (lambda: amp.GradScaler(init_loss_scaling=-1.0), ConfigError, "init_loss_scaling = -1.0"),
    (lambda: amp.GradScaler(decr_every_n_nan_or_inf=1.5), TypeError, "an integer"),
    (lambda: amp.GradScaler(enable="yes"), TypeError, "True or False"),
    (lambda: amp.auto_cast(level="O3"), ValueError, "level='O3'; allowed: 'O0'"),
    (lambda: amp.auto_cast(dtype="float64"), ValueError, "dtype='float64'; allowed"),
    (lambda: amp.auto_cast(custom_white_list=["nope"]), ValueError,
     "auto_cast custom_white_list names 'nope'"),
    (lambda: amp.auto_cast(custom_white_list="matmul"), TypeError, "a set or list"),
    (lambda: amp.auto_cast(custom_white_list={"tanh"}, custom_black_list={"tanh"}),
     ValueError, "both name tanh"),
    (lambda: amp.decorate(mlp32(), level="O0"), ValueError, "level='O0'"),
    (lambda: amp.decorate(mlp32(), level="O2", master_weight=False), ValueError,
     "master_weight=False"),
    (lambda: amp.decorate(mlp32(), save_dtype="float16"), ValueError, "save_dtype='float16'"),
    (lambda: amp.decorate("model"), TypeError, "takes a Layer"),
    (lambda: amp.decorate(make_mlp(dtype="float64"), level="O2"), ValueError,
     "float64 parameters"),
    (lambda: amp.GradScaler().scale(3.0), TypeError, "the loss Tensor, not float"),
    (lambda: amp.GradScaler().step("opt"), TypeError, "not str"),
    (lambda: fleet.distributed_scaler(object()), TypeError, "not object"),
])
def test_bad_arguments_are_refused_with_what_is_allowed(call, error, words):
    backend.manual_seed(0)
    with pytest.raises(error) as refused:
        call()
    assert words in str(refused.value)


def test_a_scaler_on_an_optimizer_with_strategy_amp_is_refused():
    backend.manual_seed(0)
    model = mlp32()
    opt = fleet.distributed_optimizer(momentum(model.parameters()),
                                      make_strategy(amp=True), local=True)
    with pytest.raises(ValueError, match="use either strategy.amp or auto_cast"):
        amp.GradScaler().step(opt)


# -- several ranks ------------------------------------------------------------------------

def own_model_run(rank, victim, distributed, steps=4, overflow_step=1):
    """Each rank trains its own copy of the model (a plain optimizer: no gradient exchange) on
    the whole batch; on ``overflow_step`` only rank ``victim``'s inputs overflow."""
    backend.manual_seed(0)
    model = mlp32()
    opt = momentum(model.parameters())
    scaler = amp.GradScaler(**CONFIGS)
    if distributed:
        scaler = fleet.distributed_scaler(scaler)
    after = []
    for step in range(steps):
        overflow = {overflow_step} if rank == victim else set()
        scaler_step(model, opt, scaler, *batch(step, overflow), "O1", "minimize")
        after.append(parameters(model))
    return after, scaler, opt


@pytest.mark.mpi(min_size=2)
def test_distributed_scaler_skips_on_every_rank_when_one_rank_overflows():
    fleet.init(is_collective=True)
    size, rank = fleet.worker_num(), fleet.worker_index()
    victim = size - 1
    got, scaler, opt = own_model_run(rank, victim, distributed=True)
    # One process whose gradients overflow on that step: what every rank must do.
    want, reference, _ = own_model_run(0, 0, distributed=False)
    for step, (a, b) in enumerate(zip(got, want)):
        for name in b:
            ok(np.array_equal(a[name], b[name]), f"rank {rank} step {step}: {name}")
    ok(scaler.skipped_steps == 1 and opt.step_count == 3, f"rank {rank}: "
       f"{scaler.skipped_steps} skipped, {opt.step_count} updates")
    ok(scaler.state_dict()["incr_count"] == reference.state_dict()["incr_count"]
       and scaler.loss_scaling == reference.loss_scaling)
    # Without distributed_scaler the ranks whose gradients were finite would have stepped.
    _, alone, alone_opt = own_model_run(rank, victim, distributed=False)
    ok(alone.skipped_steps == (1 if rank == victim else 0), f"rank {rank}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("idiom", ["minimize", "unscale_"])
def test_data_parallel_grad_scaler_matches_one_process(idiom):
    fleet.init(is_collective=True)
    size, rank = fleet.worker_num(), fleet.worker_index()

    def run(local):
        backend.manual_seed(0)
        model = mlp32()
        if not local:
            model = fleet.distributed_model(model)
        opt = fleet.distributed_optimizer(momentum(model.parameters()),
                                          fleet.DistributedStrategy(), local=local)
        scaler = amp.GradScaler(**CONFIGS)
        for step in range(5):
            x, y = batch(step, overflow={2})
            if not local:
                x, y = shard(x, rank, size), shard(y, rank, size)
                if step == 2:         # only the last rank's shard overflows
                    x = global_batch(step)[0][rank * len(x):(rank + 1) * len(x)] * (
                        HUGE if rank == size - 1 else 1)
            scaler_step(model, opt, scaler, x, y, "O1", idiom)
        return model, scaler

    (model, scaler), (reference, ref_scaler) = run(False), run(True)
    ok(scaler.skipped_steps == ref_scaler.skipped_steps == 1)
    ok(scaler.loss_scaling == ref_scaler.loss_scaling)
    for name, value in reference.state_dict().items():
        ok(np.allclose(model.state_dict()[name], value, rtol=0, atol=FP16_ATOL), name)
    every = world_gather(np.concatenate([v.ravel() for v in model.state_dict().values()]))
    ok(all(np.array_equal(every[0], row) for row in every), "ranks differ")

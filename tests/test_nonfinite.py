"""No step trains on an inf or NaN without a word (docs/reliability.md).

A NaN injected into one rank's shard of the batch: by default every rank raises
``NonFiniteError`` naming that rank, the step and the first parameter affected, before any
update; with ``FLEETMPI_NONFINITE=skip`` every rank skips that step, parameters and optimizer
state untouched, and trains on; a finite run is bit for bit the run without the check.
``FLAGS_check_nan_inf`` names the operation and layer that made the first inf or NaN, forward
or backward. amp's skipped steps are logged on rank 0 with the new loss scale.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from fleetmpi.core import backend
from fleetmpi import nn, optimizer
from fleetmpi.autograd import nan_inf
from fleetmpi.core.log import RateLimited
from fleetmpi.strategies.loss_scaling import decreases_to_floor
from comm_support import ok
from strategy_support import global_batch, make_mlp, make_strategy, momentum, shard, train_step
from job_limits import HANG_SECONDS

BAD_STEP = 2
STEPS = 4


def run(monkeypatch, mode, culprit=None, idiom="minimize", strategy=None, steps=STEPS):
    """Train make_mlp for ``steps`` steps under ``FLEETMPI_NONFINITE=mode`` (None: unset),
    with a NaN in rank ``culprit``'s shard at ``BAD_STEP``. Returns ``(model, optimizer,
    parameters after each step, the NonFiniteError raised or None)``."""
    if mode is not None:
        monkeypatch.setenv("FLEETMPI_NONFINITE", mode)
    fleet.init(is_collective=True)
    size, rank = fleet.worker_num(), fleet.worker_index()
    backend.manual_seed(0)
    model = fleet.distributed_model(make_mlp())
    opt = fleet.distributed_optimizer(momentum(model.parameters()), strategy or make_strategy())
    history = []
    for step in range(steps):
        x, y = global_batch(step)
        x, y = shard(x, rank, size).copy(), shard(y, rank, size)
        if step == BAD_STEP and rank == culprit:
            x[1, 2] = np.nan
        try:
            train_step(opt, model, x, y, idiom)
        except fleet.NonFiniteError as error:
            return model, opt, history, error
        history.append({k: v.copy() for k, v in model.state_dict().items()})
    return model, opt, history, None


def _world():
    fleet.init(is_collective=True)
    return fleet.worker_num(), fleet.worker_index()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("idiom", ["minimize", "dygraph"])
def test_a_nan_in_one_ranks_batch_stops_every_rank_naming_that_rank_and_the_step(monkeypatch,
                                                                                  idiom):
    size, rank = _world()
    culprit = size - 1
    model, _, history, error = run(monkeypatch, None, culprit, idiom)
    ok(error is not None, f"rank {rank}: no NonFiniteError")
    text = str(error)
    ok(f"step {BAD_STEP}" in text, text)
    ok(f"rank {culprit} (loss and local gradient)" in text, text)
    ok(all(f"rank {r} (" not in text for r in range(size) if r != culprit), text)
    ok('"fc' in text and "gradient bucket" in text, text)
    ok(len(history) == BAD_STEP, f"steps done {len(history)}")
    for name, value in model.state_dict().items():
        ok(np.array_equal(value, history[-1][name]), f"{name} changed by the step that stopped")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("idiom", ["minimize", "dygraph"])
def test_skip_mode_skips_the_step_on_every_rank_and_trains_on(monkeypatch, idiom,
                                                              fleetmpi_warnings):
    size, rank = _world()
    culprit = size - 1
    model, opt, history, error = run(monkeypatch, "skip", culprit, idiom)
    ok(error is None, f"rank {rank}: {error}")
    for name in history[0]:
        ok(np.array_equal(history[BAD_STEP][name], history[BAD_STEP - 1][name]),
           f"{name} changed by the skipped step")
        ok(not np.array_equal(history[BAD_STEP + 1][name], history[BAD_STEP][name]),
           f"{name} did not train after the skipped step")
        ok(np.all(np.isfinite(history[-1][name])), f"{name} is not finite")
    ok(opt.strategies["nonfinite_check"].skipped_steps == 1, "skipped_steps")
    warnings = [w for w in fleetmpi_warnings() if "FLEETMPI_NONFINITE=skip" in w]
    if rank == 0:
        ok(len(warnings) == 1 and f"step {BAD_STEP}" in warnings[0]
           and f"rank {culprit} (" in warnings[0], f"warnings {warnings}")
    else:
        ok(warnings == [], f"rank {rank} logged {warnings}")


def test_skip_mode_leaves_optimizer_state_and_batch_norm_statistics_untouched(monkeypatch):
    monkeypatch.setenv("FLEETMPI_NONFINITE", "skip")
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = fleet.distributed_model(nn.Sequential(nn.Linear(6, 8, dtype="float64"),
                                                  nn.BatchNorm1D(8, dtype="float64"),
                                                  nn.Linear(8, 4, dtype="float64")))
    opt = fleet.distributed_optimizer(momentum(model.parameters()), make_strategy())
    x, y = global_batch(0)
    opt.minimize(model, nn.CrossEntropyLoss(), x, y)
    before = ({k: v.copy() for k, v in model.state_dict().items()},
              {k: np.copy(v) for k, v in opt.state_dict().items() if hasattr(v, "shape")})
    x = x.copy()
    x[0, 0] = np.inf
    opt.minimize(model, nn.CrossEntropyLoss(), x, y)
    after = (model.state_dict(), opt.state_dict())
    for saved, now in zip(before, after):
        for name, value in saved.items():
            assert np.array_equal(value, now[name]), name


@pytest.mark.mpi(min_size=2)
def test_a_nan_in_a_gradient_merge_window_stops_at_its_update(monkeypatch):
    size, rank = _world()
    strategy = make_strategy(gradient_merge=True, gradient_merge_configs={"k_steps": 4})
    _, _, history, error = run(monkeypatch, None, size - 1, strategy=strategy)
    ok(error is not None and "step 3" in str(error), f"rank {rank}: {error}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("idiom", ["minimize", "dygraph"])
def test_a_finite_run_is_bit_for_bit_the_run_without_the_check(monkeypatch, idiom):
    runs = {}
    for mode in ("off", "stop"):
        model, _, history, error = run(monkeypatch, mode, idiom=idiom)
        assert error is None
        runs[mode] = history
    for step, (off, checked) in enumerate(zip(runs["off"], runs["stop"])):
        for name in off:
            ok(np.array_equal(off[name], checked[name]), f"step {step}: {name}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fields", [{"fp16_allreduce": True}] + [
    {"sharding": True, "sharding_configs": {"stage": stage}} for stage in (1, 2, 3)],
    ids=["fp16_allreduce", "sharding stage 1", "sharding stage 2", "sharding stage 3"])
def test_a_nan_stops_every_rank_under_compression_and_sharding(monkeypatch, fields):
    """fp16 on the wire carries the NaN the reduction checks; sharding's reduce-scatter
    leaves each rank a shard, so there the verdicts are exchanged on every update."""
    size, rank = _world()
    _, opt, history, error = run(monkeypatch, None, size - 1, strategy=make_strategy(**fields))
    ok(error is not None and f"step {BAD_STEP}" in str(error), f"rank {rank}: {error}")
    ok(len(history) == BAD_STEP, f"rank {rank}: steps done {len(history)}")
    if "fp16_allreduce" in fields:
        ok(f"rank {size - 1} (loss and local gradient)" in str(error), str(error))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_a_non_finite_loss_with_finite_gradients_on_one_rank_reaches_every_rank(
        monkeypatch, mode, fleetmpi_warnings):
    """A NaN added to one rank's loss, not to anything its gradients depend on: the gradient
    reduction carries that rank's verdict to the others."""
    monkeypatch.setenv("FLEETMPI_NONFINITE", mode)
    size, rank = _world()
    backend.manual_seed(0)
    model = fleet.distributed_model(make_mlp())
    opt = fleet.distributed_optimizer(momentum(model.parameters()), make_strategy())
    error = None
    for step in range(3):
        x, y = global_batch(step)
        loss = F.cross_entropy(model(shard(x, rank, size)), shard(y, rank, size))
        if step == 1 and rank == size - 1:
            loss = loss + fleet.to_tensor(np.array(np.nan))
        before = {k: v.copy() for k, v in model.state_dict().items()}
        loss.backward()
        try:
            opt.step()
        except fleet.NonFiniteError as raised:
            error = raised
            break
        opt.clear_grad()
        if step == 1:
            for name, value in model.state_dict().items():
                ok(np.array_equal(value, before[name]), f"{name} changed by the skipped step")
    check = opt.strategies["nonfinite_check"]
    if mode == "stop":
        ok(error is not None, f"rank {rank}: no NonFiniteError")
        ok(f"step 1: rank {size - 1} (loss) held an inf or NaN. " in str(error), str(error))
    else:
        ok(error is None and check.skipped_steps == 1, f"rank {rank}: {error}")
    ok(check.exchanged_bytes == check.verdict_bytes, f"exchanged {check.exchanged_bytes}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fields, exchanges", [({}, 0), ({"fp16_allreduce": True}, 0),
                                               ({"sharding": True}, STEPS)],
                         ids=["data parallel", "fp16_allreduce", "sharding"])
def test_finite_steps_exchange_verdicts_only_where_the_reduction_cannot_carry_them(
        monkeypatch, fields, exchanges):
    size, rank = _world()
    _, opt, history, error = run(monkeypatch, None, strategy=make_strategy(**fields))
    ok(error is None and len(history) == STEPS, f"rank {rank}: {error}")
    check = opt.strategies["nonfinite_check"]
    ok(check.exchanged_bytes == exchanges * check.verdict_bytes,
       f"exchanged {check.exchanged_bytes} bytes")


def test_the_mode_is_checked(monkeypatch):
    monkeypatch.setenv("FLEETMPI_NONFINITE", "warn")
    fleet.init(is_collective=True)
    model = make_mlp()
    with pytest.raises(ValueError, match="FLEETMPI_NONFINITE='warn' must be stop, skip or off"):
        fleet.distributed_optimizer(momentum(model.parameters()), make_strategy())


# -- FLAGS_check_nan_inf ---------------------------------------------------------------------

class Root(nn.Layer):
    """A layer whose sqrt is finite forward at 0 and infinite backward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3, dtype="float64")

    def forward(self, x):
        return fleet.autograd.sqrt(self.fc(x) * 0.0)


class Net(nn.Layer):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 3, dtype="float64"), nn.Tanh())
        self.root = Root()

    def forward(self, x):
        return self.root(self.body(x))


def test_check_nan_inf_names_the_operation_and_layer_in_forward(monkeypatch):
    monkeypatch.setattr(nan_inf, "enabled", True)
    x = np.ones((2, 3))
    x[1, 1] = np.inf
    with pytest.raises(fleet.NonFiniteError) as raised:
        Net()(fleet.to_tensor(x))
    text = str(raised.value)
    assert "forward of operator matmul" in text and 'layer "body.0" (Linear) of Net' in text, text


def test_check_nan_inf_names_the_operation_and_layer_in_backward(monkeypatch):
    monkeypatch.setattr(nan_inf, "enabled", True)
    out = Net()(fleet.to_tensor(np.ones((2, 3))))
    with pytest.raises(fleet.NonFiniteError) as raised:
        out.sum().backward()
    text = str(raised.value)
    assert "backward of operator sqrt" in text and 'layer "root" (Root) of Net' in text, text


def test_the_flag_is_read_from_the_environment():
    script = ("import numpy as np, fleetmpi as fleet\n"
              "from test_nonfinite import Net\n"
              "x = np.ones((2, 3)); x[0, 0] = np.nan\n"
              "try:\n    Net()(fleet.to_tensor(x))\n"
              "except fleet.NonFiniteError as e:\n    print(e)\n")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, FLAGS_check_nan_inf="1", PYTHONPATH=here)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=HANG_SECONDS)
    assert 'FLAGS_check_nan_inf: the forward of operator matmul' in done.stdout, done


# -- amp --------------------------------------------------------------------------------------

def test_an_amp_skipped_step_is_logged_on_rank_0_with_the_new_scale(fleetmpi_warnings):
    backend.manual_seed(0)
    model = fleet.distributed_model(make_mlp(dtype="float32"))
    strategy = make_strategy(amp=True, amp_configs={"init_loss_scaling": 2.0 ** 20,
                                                    "decr_every_n_nan_or_inf": 1})
    opt = fleet.distributed_optimizer(momentum(model.parameters()), strategy)
    x, y = global_batch(0)
    opt.minimize(model, nn.CrossEntropyLoss(), x.astype(np.float32) * 1e6, y)
    amp = opt.strategies["amp"]
    assert amp.skipped_steps == 1
    warnings = fleetmpi_warnings()
    assert warnings == [f"amp: step 0 skipped: the gradients held an inf or NaN on some rank; "
                        f"the loss scale is now {amp.loss_scaling:g}"], warnings
    assert amp.loss_scaling == 2.0 ** 19


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "fixed"])
def test_amp_overflowing_at_its_lowest_scale_stops_naming_the_step_and_the_scale(dynamic):
    """Every batch holds a NaN: with dynamic scaling from 8, steps 0-5 take the scale to 1
    (two overflowing steps per halving), steps 6 and 7 overflow there, and step 7 raises; a
    fixed scale of 8 stops at the same step. Nothing was trained; a finite step starts the
    count again."""
    backend.manual_seed(0)
    model = fleet.distributed_model(make_mlp(dtype="float32"))
    strategy = make_strategy(amp=True, amp_configs={"init_loss_scaling": 8.0,
                                                    "use_dynamic_loss_scaling": dynamic})
    opt = fleet.distributed_optimizer(momentum(model.parameters()), strategy)
    before = {k: v.copy() for k, v in model.state_dict().items()}
    amp, last = opt.strategies["amp"], 7

    def step(number, finite=False):
        x, y = global_batch(number)
        x = x.astype(np.float32)
        if not finite:
            x[0, 0] = np.nan
        opt.minimize(model, nn.CrossEntropyLoss(), x, y)

    for number in range(last):
        step(number)
    with pytest.raises(fleet.NonFiniteError) as raised:
        step(last)
    where = ("the last 2 at a loss scale of 1, the lowest it goes (the floor of dynamic loss "
             "scaling)" if dynamic else "at the fixed loss scale of 8 (use_dynamic_loss_scaling "
             "is False), as many as dynamic scaling from init_loss_scaling skips before it "
             "stops at its floor of 1")
    assert str(raised.value).startswith(
        f"amp: step {last}: the gradients held an inf or NaN on some rank at {last + 1} "
        f"consecutive steps, {where}; "), raised.value
    assert amp.skipped_steps == last + 1
    for name, value in model.state_dict().items():
        assert np.array_equal(value, before[name]), f"{name} changed by a skipped step"
    step(last + 1, finite=True)
    step(last + 2)  # one overflow after a finite step: skipped again
    assert amp.skipped_steps == last + 2


def test_the_steps_to_the_floor_follow_the_rule():
    assert [decreases_to_floor(s, 0.5) for s in (1, 1.5, 2, 8, 9, 32768)] == [0, 1, 1, 3, 4, 15]
    assert decreases_to_floor(1000, 0.1) == 3


def test_a_grad_scaler_skipping_every_step_stops_too():
    """Paddle's dygraph idiom with a plain optimizer: the step named is the scaler's count of
    the steps it checked."""
    backend.manual_seed(0)
    model = make_mlp(dtype="float32")
    opt = optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    scaler = fleet.amp.GradScaler(init_loss_scaling=2.0)
    x, y = global_batch(0)
    x = x.astype(np.float32)
    x[0, 0] = np.nan
    with pytest.raises(fleet.NonFiniteError, match=r"^amp: step 3: the gradients held an inf "
                                                   r"or NaN on some rank at 4 consecutive "
                                                   r"steps, the last 2 at a loss scale of 1, "):
        for _ in range(10):
            loss = F.cross_entropy(model(fleet.to_tensor(x)), fleet.to_tensor(y))
            scaled = scaler.scale(loss)
            scaled.backward()
            scaler.minimize(opt, scaled)
            opt.clear_grad()
    assert scaler.skipped_steps == 4


def test_skip_lines_are_rate_limited_and_count_what_they_held_back(fleetmpi_warnings):
    now = [0.0]
    log = RateLimited(10.0, clock=lambda: now[0])
    for second in (0.0, 1.0, 2.0, 12.0, 13.0):
        now[0] = second
        log.warning("skipped %d", int(second))
    assert fleetmpi_warnings() == ["skipped 0", "skipped 12 (2 more since the last such line, "
                                   "not written)"]

"""strategy.auto (calibration in the job, one choice on every rank, training that of the chosen
strategy set by hand) and fleet.applied_strategy (what runs and why a requested field does not)."""
import logging
import time

import numpy as np
import pytest

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from fleetmpi.core import backend
from fleetmpi import nn, optimizer, parallel
from fleetmpi.core.log import logger
from fleetmpi.strategies import inert_fields
from fleetmpi.strategies.auto import recompute_checkpoints
from fleetmpi.core import knobs
from strategy_support import make_mlp, make_strategy, momentum, shard

STEPS = 3
ARITHMETIC = knobs.AUTO_ALLOWABLE


def world_gather(value):
    from mpi4py import MPI

    return MPI.COMM_WORLD.allgather(value)


def batch(step, size=24, features=6, classes=4):
    rng = np.random.default_rng(300 + step)
    return (rng.standard_normal((size, features)).astype(np.float32),
            rng.integers(0, classes, size))


class Block(nn.Layer):
    """``tanh(fc(x)) + x``."""

    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return F.tanh(self.fc(x)) + x


class BlockNet(nn.Layer):
    """A user's model: ``inp``, three ``Block`` layers in the LayerList ``blocks``, ``head``."""

    def __init__(self, sizes):
        super().__init__()
        self.inp = nn.Linear(sizes[0], sizes[1])
        self.blocks = nn.LayerList([Block(sizes[1]) for _ in range(3)])
        self.head = nn.Linear(sizes[1], sizes[-1])

    def forward(self, x):
        x = F.relu(self.inp(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def train(strategy, steps=STEPS, sizes=(6, 16, 12, 4), global_batch=24, local=False,
          loss_fn=None, make_model=None, **knobs):
    """Train a float32 MLP (``make_model(sizes)`` when given; same seed everywhere) for
    ``steps`` steps, each rank on its shard (on the whole batch when ``local``); returns
    ``(model, distributed optimizer)``."""
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = make_mlp(sizes, dtype="float32") if make_model is None else make_model(sizes)
    model = model if local else fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(momentum(model.parameters()), strategy, local=local,
                                      **knobs)
    rank, size = (0, 1) if local else (fleet.worker_index(), fleet.worker_num())
    for step in range(steps):
        x, y = batch(step, global_batch, sizes[0], sizes[-1])
        opt.minimize(model, loss_fn or nn.CrossEntropyLoss(), shard(x, rank, size),
                     shard(y, rank, size))
    return model, opt


def auto_strategy():
    return make_strategy(auto=True)


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def log_messages():
    """Every message of the fleetmpi logger down to INFO, which the rank's own stderr
    handler does not print meanwhile."""
    handler = _Collect()
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    quiet = [(h, h.level) for h in logger.handlers if getattr(h, "fleetmpi_rank_handler", 0)]
    for h, _ in quiet:
        h.setLevel(logging.CRITICAL + 1)
    inert_fields._reported.clear()
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        for h, old in quiet:
            h.setLevel(old)


# -- knobs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("knob, value, message", [
    ("auto_seconds", 0, "auto_seconds=0 must be a positive number"),
    ("auto_seconds", -1.5, "auto_seconds=-1.5 must be a positive number"),
    ("auto_seconds", float("nan"), "auto_seconds=nan must be a positive number"),
    ("auto_seconds", True, "auto_seconds=True must be a positive number"),
    ("auto_seconds", "soon", "auto_seconds='soon' must be a positive number"),
    ("auto_allow", "dgc,warp", "'warp' cannot be allowed; allowed: fp16_allreduce, amp, "
                               "gradient_merge, dgc, localsgd, adaptive_localsgd, or 'none'"),
    ("auto_allow", 3, "auto_allow=3 must be a comma-separated string or a list"),
    ("auto_memory_MB", -4, "auto_memory_MB=-4 must be a positive number"),
])
def test_bad_knob_values_are_refused_by_name(knob, value, message):
    fleet.init(is_collective=True)
    model = make_mlp(dtype="float32")
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fleet.distributed_optimizer(momentum(model.parameters()), auto_strategy(),
                                    **{knob: value})


@pytest.mark.parametrize("env, value", [(knobs.AUTO_SECONDS.name, "0"),
                                        (knobs.AUTO_SECONDS.name, "3s"),
                                        (knobs.AUTO_ALLOW.name, "localsgd,everything"),
                                        (knobs.AUTO_MEMORY_MB.name, "lots")])
def test_bad_environment_values_are_refused_by_name(monkeypatch, env, value):
    fleet.init(is_collective=True)
    monkeypatch.setenv(env, value)
    model = make_mlp(dtype="float32")
    with pytest.raises(ValueError, match=env):
        fleet.distributed_optimizer(momentum(model.parameters()), auto_strategy())


@pytest.mark.parametrize("name", ["pipeline", "sharding"])
def test_auto_with_a_strategy_that_narrows_the_optimizer_is_refused(name):
    fleet.init(is_collective=True)
    model = make_mlp(dtype="float32")
    with pytest.raises(ValueError, match=f"strategy.auto cannot be combined with {name}"):
        fleet.distributed_optimizer(momentum(model.parameters()),
                                    make_strategy(auto=True, **{name: True}))


def test_auto_knobs_without_auto_are_refused():
    fleet.init(is_collective=True)
    model = make_mlp(dtype="float32")
    with pytest.raises(ValueError, match="configure strategy.auto, which is off"):
        fleet.distributed_optimizer(momentum(model.parameters()), make_strategy(),
                                    auto_seconds=1)


# -- applied strategy, one process ------------------------------------------------------------

def test_fields_without_effect_in_one_process_are_reported(log_messages):
    strategy = make_strategy(fp16_allreduce=True, fuse_grad_size_in_MB=8,
                             sync_nccl_allreduce=False,
                             gradient_merge_configs={"k_steps": 4})
    strategy.recompute = True
    strategy.recompute_configs = {"checkpoints": ["act0"], "enable_offload": True,
                                  "checkpoint_shape": [24, 16]}
    train(strategy, steps=1, local=True)
    applied = fleet.applied_strategy()
    assert applied == strategy
    assert applied.active == ("recompute",)
    reasons = dict(applied.not_applied)
    # Offload moves checkpoints from device to host memory: nothing to move on CPU.
    offload = set() if backend.on_gpu() else {"recompute_configs.enable_offload"}
    assert set(reasons) == {"fp16_allreduce", "fuse_grad_size_in_MB", "sync_nccl_allreduce",
                            "gradient_merge_configs"} | offload
    assert "no gradients to exchange" in reasons["fp16_allreduce"]
    assert reasons["gradient_merge_configs"] == ("strategy gradient_merge is off, so its "
                                                 "configs are not used")
    if offload:
        assert "host and device memory are the same" in \
            reasons["recompute_configs.enable_offload"]
    assert "strategies active: recompute" in log_messages
    for path, why in reasons.items():
        assert f"DistributedStrategy.{path} is set but has no effect in fleetmpi: {why}" \
            in log_messages
    text = str(applied)
    assert "active: recompute" in text and "not applied: fp16_allreduce: " in text


def test_applied_strategy_before_auto_has_calibrated_is_refused(monkeypatch):
    fleet.init(is_collective=True)
    monkeypatch.setattr(parallel, "_applied", None)
    model = make_mlp(dtype="float32")
    fleet.distributed_optimizer(momentum(model.parameters()), auto_strategy(), auto_seconds=1)
    with pytest.raises(RuntimeError, match="one minimize call, which calibrates"):
        fleet.applied_strategy()


def test_auto_in_one_process_recomputes_over_budget_and_trains_as_set_by_hand(tmp_path):
    model, opt = train(auto_strategy(), auto_seconds=1, auto_memory_MB=0.001)
    applied = fleet.applied_strategy()
    report = applied.calibration
    assert report is not None and report.seconds > 0
    assert applied.auto is False
    assert applied.recompute and list(applied.recompute_configs["checkpoints"]) == ["act0", "act1"]
    assert applied.active == ("recompute",)
    assert any("exceed the memory budget" in note for note in report.notes)
    path = tmp_path / "auto.prototxt"
    applied.save_to_prototxt(str(path))
    loaded = fleet.DistributedStrategy().load_from_prototxt(str(path))
    assert loaded == applied
    by_hand, opt_by_hand = train(loaded)
    assert opt_by_hand.applied_strategy.calibration is None
    for (name, value), (_, expected) in zip(model.state_dict().items(),
                                            by_hand.state_dict().items()):
        np.testing.assert_array_equal(value, expected, err_msg=name)
    assert opt.inner.state_dict()["step_count"] == STEPS


def test_auto_recomputes_the_blocks_of_a_user_defined_layer_over_budget():
    model, _ = train(auto_strategy(), auto_seconds=1, auto_memory_MB=0.001,
                     make_model=BlockNet)
    applied = fleet.applied_strategy()
    assert applied.active == ("recompute",)
    assert list(applied.recompute_configs["checkpoints"]) == ["blocks.0", "blocks.1",
                                                              "blocks.2"]
    by_hand, _ = train(applied, make_model=BlockNet)
    for (name, value), (_, expected) in zip(model.state_dict().items(),
                                            by_hand.state_dict().items()):
        np.testing.assert_array_equal(value, expected, err_msg=name)


def test_recompute_checkpoints_by_kind_of_model():
    """Sequential: every ~sqrt(n)-th top-level layer; a LayerList's called blocks; else the
    called top-level sublayers with parameters but the last; None when too few."""
    assert recompute_checkpoints(make_mlp((6, 8, 8, 8, 4)), []) == ["fc1", "act2"]
    assert recompute_checkpoints(nn.Sequential(nn.Linear(2, 2), nn.Tanh()), []) is None
    blocks = BlockNet((6, 8, 4))
    called = ["inp", "blocks.0.fc", "blocks.0", "blocks.1.fc", "blocks.1", "head"]
    assert recompute_checkpoints(blocks, called) == ["blocks.0", "blocks.1"]
    assert recompute_checkpoints(blocks, ["inp", "blocks.2", "head"]) is None

    class Flat(nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc0, self.act, self.fc1, self.fc2 = (nn.Linear(2, 2), nn.Tanh(),
                                                      nn.Linear(2, 2), nn.Linear(2, 2))

    assert recompute_checkpoints(Flat(), ["fc0", "act", "fc1", "fc2"]) == ["fc0", "fc1"]
    assert recompute_checkpoints(Flat(), ["fc0", "act", "fc1"]) is None


def test_calibration_leaves_the_training_where_it_was():
    """One auto step equals one step of the chosen strategy from the same start, so the
    calibration's trial steps left no trace (parameters, optimizer state, dropout draws)."""
    def dropout_mlp():
        return nn.Sequential(("fc0", nn.Linear(6, 16)), ("act0", nn.ReLU()),
                             ("drop", nn.Dropout(0.5)), ("fc1", nn.Linear(16, 4)))

    runs = []
    for strategy in (auto_strategy(), None):
        fleet.init(is_collective=True)
        backend.manual_seed(0)
        model = dropout_mlp()
        strategy = strategy or fleet.applied_strategy()
        opt = fleet.distributed_optimizer(momentum(model.parameters()), strategy,
                                          **({"auto_seconds": 1} if strategy.auto else {}))
        x, y = batch(0)
        for _ in range(2):
            opt.minimize(model, nn.CrossEntropyLoss(), x, y)
        runs.append((model.state_dict(), opt.inner.state_dict()))
    (params, state), (params_by_hand, state_by_hand) = runs
    for name in params:
        np.testing.assert_array_equal(params[name], params_by_hand[name], err_msg=name)
    for key in state:
        np.testing.assert_array_equal(state[key], state_by_hand[key], err_msg=key)


# -- several ranks ----------------------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
def test_auto_picks_the_same_strategy_on_every_rank(capsys):
    model, opt = train(auto_strategy(), sizes=(32, 64, 64, 8), global_batch=48,
                       auto_seconds=1.5, auto_allow="fp16_allreduce,gradient_merge,dgc")
    applied = fleet.applied_strategy()
    report = applied.calibration
    texts = world_gather(str(applied))
    choices = world_gather(report.chosen.name)
    assert all(text == texts[0] for text in texts), texts
    assert all(choice == choices[0] for choice in choices), choices
    assert report.chosen in report.candidates and report.chosen.seconds is not None
    assert not applied.auto
    assert not any(getattr(applied, name) for name in ("amp", "localsgd", "adaptive_localsgd"))
    names = [c.name for c in report.candidates]
    assert names[0] == "default" and len(names) >= 2, names
    assert "gradient_allreduce" in applied.active or "fp16_allreduce" in applied.active
    printed = capsys.readouterr().out
    if fleet.worker_index() == 0:
        assert report.text() in printed and "chosen: " in printed
    else:
        assert "fleetmpi auto" not in printed
    params = world_gather({k: v.tobytes() for k, v in model.state_dict().items()})
    assert all(p == params[0] for p in params[1:])


class _SlowerOnSomeSteps(nn.CrossEntropyLoss):
    """The loss, after a pause drawn from a generator seeded by the rank: every rank measures
    other step times."""

    def __init__(self, rank):
        super().__init__()
        self.rng = np.random.default_rng(rank)

    def forward(self, logits, labels):
        time.sleep(self.rng.uniform(0, 0.004))
        return super().forward(logits, labels)


@pytest.mark.mpi(min_size=2)
def test_ranks_that_measure_differently_still_apply_one_choice():
    fleet.init(is_collective=True)
    train(auto_strategy(), sizes=(32, 64, 64, 8), global_batch=48, auto_seconds=1,
          loss_fn=_SlowerOnSomeSteps(fleet.worker_index()))
    report = fleet.applied_strategy().calibration
    measured = [(c.name, c.seconds) for c in report.candidates]
    assert world_gather(measured) == [measured] * fleet.worker_num()
    assert world_gather(report.chosen.name) == [report.chosen.name] * fleet.worker_num()


@pytest.mark.mpi(min_size=2)
def test_auto_never_chooses_what_changes_the_arithmetic_unless_allowed():
    _, opt = train(auto_strategy(), sizes=(32, 64, 8), global_batch=48, auto_seconds=1,
                   auto_allow="none")
    applied = fleet.applied_strategy()
    assert not any(getattr(applied, name) for name in ARITHMETIC), str(applied)
    skipped = dict(applied.calibration.skipped)
    for name in ARITHMETIC:
        assert "auto_allow / FLEETMPI_AUTO_ALLOW" in skipped[name], skipped
    assert world_gather(str(applied)) == [str(applied)] * fleet.worker_num()


@pytest.mark.mpi(min_size=2)
def test_a_candidate_the_optimizer_refuses_is_reported_with_the_reason():
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = fleet.distributed_model(make_mlp(dtype="float32"))
    opt = fleet.distributed_optimizer(optimizer.Adam(parameters=model.parameters()),
                                      auto_strategy(), auto_seconds=1, auto_allow="dgc")
    x, y = batch(0)
    rank, size = fleet.worker_index(), fleet.worker_num()
    opt.minimize(model, nn.CrossEntropyLoss(), shard(x, rank, size), shard(y, rank, size))
    applied = fleet.applied_strategy()
    skipped = dict(applied.calibration.skipped)
    assert skipped["dgc=True"] == "strategy dgc works with a Momentum optimizer, not Adam"
    assert not applied.dgc and "not a candidate: dgc=True: strategy dgc works" in \
        applied.calibration.text()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("make_model, checkpoints", [
    (None, ["act0", "act1"]), (BlockNet, ["blocks.0", "blocks.1", "blocks.2"])],
    ids=["sequential", "user_layer"])
def test_auto_result_round_trips_and_trains_like_the_strategy_set_by_hand(tmp_path, make_model,
                                                                          checkpoints):
    model, _ = train(auto_strategy(), auto_seconds=1, auto_memory_MB=0.001,
                     make_model=make_model)
    applied = fleet.applied_strategy()
    assert applied.recompute and list(applied.recompute_configs["checkpoints"]) == checkpoints
    path = tmp_path / f"auto-{fleet.worker_index()}.prototxt"
    applied.save_to_prototxt(str(path))
    loaded = fleet.DistributedStrategy().load_from_prototxt(str(path))
    assert loaded == applied and not loaded.auto
    by_hand, opt = train(loaded, make_model=make_model)
    assert opt.applied_strategy.calibration is None
    for (name, value), (_, expected) in zip(model.state_dict().items(),
                                            by_hand.state_dict().items()):
        np.testing.assert_array_equal(value, expected,
                                      err_msg=f"{name} on rank {fleet.worker_index()}")
    assert world_gather(path.read_text()) == [path.read_text()] * fleet.worker_num()


@pytest.mark.mpi(min_size=2)
def test_calibration_keeps_to_its_time_bound():
    """Steps of ~10 ms or more against a 0.02 s bound: the default is measured, every other
    candidate is left unmeasured, and calibration ends well within bound + 2 s."""
    bound = 0.02
    train(auto_strategy(), steps=1, sizes=(256, 512, 512, 10), global_batch=240,
          auto_seconds=bound)
    report = fleet.applied_strategy().calibration
    assert report.candidates[0].seconds is not None
    rest = report.candidates[1:]
    assert rest and all(c.seconds is None and "bound was reached" in c.note for c in rest)
    assert report.chosen is report.candidates[0]
    assert report.seconds < bound + 2.0, report.seconds
    assert len(set(world_gather(report.text()))) == 1


@pytest.mark.mpi(min_size=2)
def test_fields_without_effect_on_several_ranks_are_reported(log_messages):
    fleet.init(is_collective=True)
    strategy = make_strategy(fuse_all_reduce_ops=False, fuse_grad_size_in_MB=8,
                             hierarchical_allreduce_inter_nranks=fleet.worker_num(),
                             cudnn_exhaustive_search=False, localsgd_configs={"k_steps": 2})
    train(strategy, steps=1)
    applied = fleet.applied_strategy()
    reasons = dict(applied.not_applied)
    assert set(reasons) == {"fuse_grad_size_in_MB", "hierarchical_allreduce_inter_nranks",
                            "cudnn_exhaustive_search", "localsgd_configs"}, reasons
    assert reasons["fuse_grad_size_in_MB"] == ("fuse_all_reduce_ops is off: one allreduce "
                                               "per parameter")
    assert applied.active == ("gradient_allreduce",)
    warned = [m for m in log_messages if "has no effect in fleetmpi" in m]
    if fleet.worker_index() == 0:
        assert len(warned) == 4 and "strategies active: gradient_allreduce" in log_messages
    else:
        assert warned == []
    pairs = sorted(reasons.items())
    assert world_gather(pairs) == [pairs] * fleet.worker_num()

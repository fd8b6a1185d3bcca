"""sharding, every stage: N ranks holding 1/N of the optimizer state (from stage 2 of the
gradients, at stage 3 of the parameters too) each train exactly as plain data parallelism does
(float64, 1e-10), with hybrid_dp, amp, recompute, gradient_merge and grad_clip; shards cut
parameters anywhere; parameters travel back in fuse_broadcast_MB messages; sharded checkpoints
load into jobs of other sizes."""
import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.core import backend
from fleetmpi.training import checkpoint
from fleetmpi import nn, optimizer
from fleetmpi.comm import dispatch
from fleetmpi.launch.mpi_command import local_command
from comm_support import close, equal, ok, raises
from strategy_support import (global_batch, make_mlp, make_strategy, momentum, shard, train,
                              world_gather)
from job_limits import HANG_SECONDS

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 4


def adam(parameters):
    return optimizer.Adam(learning_rate=0.01, parameters=parameters)


OPTIMIZERS = {"momentum": momentum, "adam": adam}


STAGES = (1, 2, 3)


def sharding(**configs):
    return make_strategy(sharding=True, sharding_configs=configs)


def assert_close_everywhere(model, expected, rtol=1e-10, atol=1e-13):
    for name, value in model.state_dict().items():
        close(value, expected[name], rtol=rtol, atol=atol, err_msg=name)


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


# -- the optimizer on a shard (one process) -----------------------------------------------------

def optimizer_pair(make):
    """Two copies of one model, one optimizer over each (``make(parameters)``)."""
    models = []
    for _ in range(2):
        backend.manual_seed(0)
        models.append(make_mlp())
    return models, [make(m.parameters()) for m in models]


def set_gradients(models, step):
    """The same random gradients in every model of ``models``."""
    for model in models:
        rng = np.random.default_rng(step)
        for p in model.parameters():
            p.grad[...] = rng.standard_normal(p.shape)


SHARDED_OPTIMIZERS = {
    "sgd": lambda ps: optimizer.SGD(learning_rate=0.1, parameters=ps, weight_decay=0.01),
    "nesterov": lambda ps: optimizer.Momentum(learning_rate=0.1, parameters=ps,
                                              use_nesterov=True, weight_decay=0.01),
    "adam": lambda ps: optimizer.Adam(learning_rate=0.01, parameters=ps, weight_decay=0.01),
    "adamw": lambda ps: optimizer.AdamW(learning_rate=0.01, parameters=ps),
}


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("name", sorted(SHARDED_OPTIMIZERS))
def test_shards_stepped_in_turn_are_the_whole_optimizer_bit_for_bit(name, fused):
    """Shards cut through parameters (the cuts below fall inside fc0.weight and fc1.weight);
    updating every shard equals updating everything."""
    make = SHARDED_OPTIMIZERS[name]
    (whole_model, shards_model), (whole, first) = optimizer_pair(make)
    total = whole.space_size
    cuts = [0, 37, 250, total]
    shards = [first] + [make(shards_model.parameters()) for _ in cuts[2:]]
    for opt, start, stop in zip(shards, cuts[:-1], cuts[1:]):
        opt.shard(start, stop)
        assert opt.shard_range == (start, stop)
    for opt in [whole] + shards:
        opt.fuse_all_optimizer_ops = fused
    for step in range(3):
        set_gradients([whole_model, shards_model], step)
        whole.step()
        for opt in shards:
            opt.step()
    for key, value in whole_model.state_dict().items():
        np.testing.assert_array_equal(shards_model.state_dict()[key], value, err_msg=key)
    assert sum(opt.state_nbytes() for opt in shards) == whole.state_nbytes()


def test_shard_state_dict_round_trips_and_loads_from_a_covering_range():
    (model, _), (whole, part) = optimizer_pair(adam)
    set_gradients([model], 0)
    whole.step()
    part.shard(10, 90)
    full_state = whole.state_dict()
    part.set_state_dict(full_state)
    state = part.state_dict()
    assert state["shard"] == [10, 90, whole.space_size]
    joined = np.concatenate([full_state[f"moment1.{i}"] for i in range(len(whole.runs))])
    np.testing.assert_array_equal(state["moment1.shard"], joined[10:90])
    assert part.state_nbytes() == 2 * 80 * 8
    wider = dict(state, shard=[0, 100, whole.space_size])
    wider["moment1.shard"] = wider["moment2.shard"] = np.arange(100.0)
    part.set_state_dict(wider)
    np.testing.assert_array_equal(part.state_dict()["moment2.shard"], np.arange(10.0, 90.0))


def test_shard_refusals():
    _, (opt, _) = optimizer_pair(adam)
    total = opt.space_size
    for bad in [(-1, 5), (5, 4), (0, total + 1), (0.5, 3)]:
        with pytest.raises(ValueError, match="must be integers with 0 <= start <= stop"):
            opt.shard(*bad)
    opt.shard(0, 50)
    with pytest.raises(RuntimeError, match="already sharded"):
        opt.shard(0, 20)
    narrow = dict(opt.state_dict(), shard=[10, 50, total])
    narrow["moment1.shard"] = narrow["moment2.shard"] = np.zeros(40)
    with pytest.raises(ValueError, match=r"covers elements \[10, 50\).+updates \[0, 50\)"):
        opt.set_state_dict(narrow)
    with pytest.raises(ValueError, match="parameter space of 7 elements"):
        opt.set_state_dict(dict(narrow, shard=[0, 7, 7]))


# -- the strategy in one process ----------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_one_process_sharding_is_the_plain_optimizer_bit_for_bit(name):
    model, opt, losses = train(sharding(), OPTIMIZERS[name], steps=STEPS, local=True)
    plain, _, plain_losses = train(make_strategy(), OPTIMIZERS[name], steps=STEPS, local=True)
    assert losses == plain_losses
    for key, value in plain.state_dict().items():
        np.testing.assert_array_equal(model.state_dict()[key], value, err_msg=key)
    assert opt.inner.shard_range == (0, opt.inner.space_size)


def test_mixed_dtypes_are_refused():
    fleet.init(is_collective=True)
    model = nn.Sequential(("fc0", nn.Linear(3, 4, dtype="float64")),
                          ("fc1", nn.Linear(4, 2, dtype="float32")))
    with pytest.raises(ValueError, match="float32, float64"):
        fleet.distributed_optimizer(momentum(model.parameters()), sharding(), local=True)


def test_group_size_that_does_not_divide_one_process_is_refused():
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = make_mlp()
    with pytest.raises(ValueError, match=r"sharding_group_size'\]=8 must divide the world "
                                         r"size 1.+allowed here: 1"):
        fleet.distributed_optimizer(momentum(model.parameters()), sharding(hybrid_dp=True),
                                    local=True)


# -- N ranks ------------------------------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", STAGES)
def test_the_ring_reduce_scatter_in_place_equals_data_parallel(stage, monkeypatch):
    """Gradients of any size go through the library's ring, which reduces in the gradient's
    own storage and returns this rank's block as a view of it (large models take this path;
    the small ones of the other tests the native one)."""
    from fleetmpi.comm import Communicator

    monkeypatch.setattr(Communicator, "prefers_native", lambda self, nbytes, compression=None:
                        False)
    model, _, _ = train(sharding(stage=stage), OPTIMIZERS["adam"], steps=STEPS)
    expected, _, _ = train(make_strategy(), OPTIMIZERS["adam"], steps=STEPS, local=True)
    assert_close_everywhere(model, expected.state_dict())


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_n_ranks_equal_data_parallel_with_1_over_n_of_the_state(name, stage):
    model, opt, _ = train(sharding(stage=stage), OPTIMIZERS[name], steps=STEPS)
    expected, plain, _ = train(make_strategy(), OPTIMIZERS[name], steps=STEPS, local=True)
    assert_close_everywhere(model, expected.state_dict())
    size = fleet.worker_num()
    mine, whole = opt.inner.state_nbytes(), plain.inner.state_nbytes()
    every = world_gather(np.array([mine]))[:, 0]
    equal(every.sum(), whole)
    per_element = whole // opt.inner.space_size
    ok(every.max() <= -(-opt.inner.space_size // size) * per_element,
       f"state bytes per rank {every} for {whole} in all")
    start, stop = opt.strategies["sharding"].shard
    ok((start, stop) == opt.inner.shard_range)
    buffers = model.flat_buffers()
    # From stage 2 the gradient is this rank's shard alone, at stage 3 the parameters too.
    ok((opt.inner.shard_gradient is None) == (stage == 1))
    ok(all((b.grad is None) == (stage >= 2) for b in buffers))
    if stage >= 2:
        equal(opt.inner.shard_gradient.size, stop - start)
    ok(all((b.data is None) == (stage == 3) for b in buffers))
    if stage == 3:
        equal(opt.inner.shard_parameters.size, stop - start)
        whole = [unit for unit in opt.strategies["sharding"].gatherer.units
                 if unit.values is not None]
        ok(len(whole) <= 1, f"{len(whole)} units whole at once")
        held = {id(p) for unit in whole for p in unit.parameters}
        ok(all((p.data.strides == (0,) * p.data.ndim) == (id(p) not in held)
               for p in model.parameters()), "stage 3 keeps whole parameters beyond one unit")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", STAGES)
def test_hybrid_dp_equals_data_parallel_for_every_group_size(stage):
    fleet.init(is_collective=True)
    size = fleet.worker_num()
    expected, plain, _ = train(make_strategy(), adam, steps=STEPS, local=True)
    for group in divisors(size):
        model, opt, _ = train(sharding(hybrid_dp=True, sharding_degree=group, stage=stage),
                              adam, steps=STEPS)
        assert_close_everywhere(model, expected.state_dict())
        hook = opt.strategies["sharding"]
        ok((hook.group_size, hook.replicas_num) == (group, size // group))
        # Each rank holds 1/group of the state; the replicas hold the same shard.
        ok(abs(opt.inner.state_nbytes() * group - plain.inner.state_nbytes())
           <= group * 2 * 8, f"group {group}: {opt.inner.state_nbytes()} bytes")


@pytest.mark.mpi(min_size=2)
def test_group_size_that_does_not_divide_the_world_is_refused_on_every_rank():
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = make_mlp()
    size = fleet.worker_num()
    with raises(ValueError, match=rf"sharding_group_size'\]={size + 1} must divide the world "
                                  rf"size {size}"):
        fleet.distributed_optimizer(momentum(model.parameters()),
                                    sharding(hybrid_dp=True, sharding_group_size=size + 1))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("clip", [optimizer.ClipGradByNorm, optimizer.ClipGradByGlobalNorm])
def test_grad_clip_norms_are_of_whole_tensors_across_shards(clip, stage):
    def clipped(parameters):
        return optimizer.Momentum(learning_rate=0.1, momentum=0.9, parameters=parameters,
                                  grad_clip=clip(0.05))
    model, _, _ = train(sharding(stage=stage), clipped, steps=STEPS)
    expected, _, _ = train(make_strategy(), clipped, steps=STEPS, local=True)
    unclipped, _, _ = train(make_strategy(), steps=STEPS, local=True)
    ok(not np.allclose(unclipped.state_dict()["fc0.weight"], expected.state_dict()["fc0.weight"]),
       "the clip never acted")
    assert_close_everywhere(model, expected.state_dict())


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", STAGES)
def test_gradient_merge_with_sharding(stage):
    """Stage 1 merges whole gradients locally and communicates only on updates; from stage 2
    every step's gradients are reduce-scattered and the window is merged in the shard."""
    configs = {"k_steps": 2, "avg": True}
    fleet.init(is_collective=True)
    size, rank = fleet.worker_num(), fleet.worker_index()
    backend.manual_seed(0)
    model = fleet.distributed_model(make_mlp())
    strategy = make_strategy(sharding=True, sharding_configs={"stage": stage},
                             gradient_merge=True, gradient_merge_configs=configs)
    opt = fleet.distributed_optimizer(adam(model.parameters()), strategy)
    group = opt.strategies["sharding"].group
    for step in range(2 * STEPS):
        sent = group.payload_bytes
        x, y = global_batch(step)
        opt.minimize(model, nn.CrossEntropyLoss(), shard(x, rank, size), shard(y, rank, size))
        ok((group.payload_bytes > sent) == (stage >= 2 or step % 2 == 1), f"step {step}")
    expected, _, _ = train(make_strategy(gradient_merge=True, gradient_merge_configs=configs),
                           adam, steps=2 * STEPS, local=True)
    assert_close_everywhere(model, expected.state_dict())


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", STAGES)
def test_recompute_with_sharding_is_bit_for_bit_sharding_alone(stage):
    configs = {"checkpoints": ["act0", "act1"]}
    model, _, losses = train(make_strategy(sharding=True, sharding_configs={"stage": stage},
                                           recompute=True, recompute_configs=configs),
                             steps=STEPS)
    alone, _, alone_losses = train(sharding(stage=stage), steps=STEPS)
    equal(np.array(losses), np.array(alone_losses))
    for key, value in alone.state_dict().items():
        equal(model.state_dict()[key], value, err_msg=key)


def overflowing_on_rank_0(size):
    """``global_batch`` whose step 1 overflows float16 on rank 0's shard only."""
    def batch(step):
        x, y = global_batch(step)
        if step == 1:
            x = x.copy()
            x[:len(x) // size] *= 1e6
        return x, y
    return batch


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", STAGES)
def test_amp_with_sharding_matches_amp_data_parallel_and_skips_the_same_step(stage):
    fleet.init(is_collective=True)
    size = fleet.worker_num()
    amp = {"init_loss_scaling": 1024.0, "decr_every_n_nan_or_inf": 1}
    runs = {}
    for name, strategy in {"sharded": make_strategy(sharding=True, amp=True, amp_configs=amp,
                                                    sharding_configs={"stage": stage}),
                           "plain": make_strategy(amp=True, amp_configs=amp)}.items():
        runs[name] = train(strategy, adam, steps=STEPS, batch=overflowing_on_rank_0(size),
                           make_model=lambda: make_mlp(dtype="float32"))
    (model, opt, losses), (plain, plain_opt, plain_losses) = runs["sharded"], runs["plain"]
    hooks = opt.strategies["amp"], plain_opt.strategies["amp"]
    ok([(h.skipped_steps, h.loss_scaling) for h in hooks] == [(1, 512.0)] * 2,
       f"{[(h.skipped_steps, h.loss_scaling) for h in hooks]}")
    ok(opt.inner.step_count == plain_opt.inner.step_count == STEPS - 1)
    assert_close_everywhere(model, plain.state_dict(), rtol=1e-5, atol=1e-6)


@pytest.mark.mpi(min_size=2)
def test_parameters_travel_back_in_messages_of_at_most_fuse_broadcast_mb(monkeypatch):
    fleet.init(is_collective=True)
    size, rank = fleet.worker_num(), fleet.worker_index()
    backend.manual_seed(0)
    model = fleet.distributed_model(make_mlp())
    megabytes = 200 / 2 ** 20
    opt = fleet.distributed_optimizer(momentum(model.parameters()),
                                      sharding(fuse_broadcast_MB=megabytes))
    group = opt.strategies["sharding"].group
    messages = []
    broadcast = dispatch.broadcast_flat

    def recording(ctx, buf, root, algorithm, index):
        if ctx is group.context:
            messages.append((root, buf.nbytes))
        return broadcast(ctx, buf, root, algorithm, index)
    monkeypatch.setattr(dispatch, "broadcast_flat", recording)
    x, y = global_batch(0)
    opt.minimize(model, nn.CrossEntropyLoss(), shard(x, rank, size), shard(y, rank, size))
    ok(max(nbytes for _, nbytes in messages) <= 200, f"messages {messages}")
    offsets = opt.strategies["sharding"].offsets
    for owner in range(size):
        sent = sum(nbytes for root, nbytes in messages if root == owner)
        ok(sent == (offsets[owner + 1] - offsets[owner]) * 8, f"owner {owner}: {sent} bytes")


# -- checkpoints --------------------------------------------------------------------------------

def train_from(model, opt, steps, rank=0, size=1):
    for step in steps:
        x, y = global_batch(step)
        opt.minimize(model, nn.CrossEntropyLoss(), shard(x, rank, size), shard(y, rank, size))


@pytest.mark.mpi(min_size=2)
def test_a_sharded_checkpoint_loads_into_one_process_and_continues(tmp_path_factory):
    from mpi4py import MPI

    fleet.init(is_collective=True)
    world = MPI.COMM_WORLD
    directory = world.bcast(str(tmp_path_factory.mktemp("shards")) if world.rank == 0 else None)
    model, opt, _ = train(sharding(), adam, steps=STEPS // 2)
    checkpoint.save(directory, model, opt, STEPS // 2)
    expected, _, _ = train(make_strategy(), adam, steps=STEPS, local=True)
    for strategy in (sharding(), make_strategy()):
        backend.manual_seed(7)
        resumed = make_mlp()
        again = fleet.distributed_optimizer(adam(resumed.parameters()), strategy, local=True)
        info = checkpoint.load(directory, resumed, again)
        train_from(resumed, again, range(info["step"], STEPS))
        assert_close_everywhere(resumed, expected.state_dict())


def run_job(size, *arguments):
    command = local_command(size) + [sys.executable,
                                     os.path.join(HERE, "sharding_checkpoint_job.py"), *arguments]
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(command, capture_output=True, text=True, timeout=HANG_SECONDS, env=env)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("stage", STAGES)
def test_a_checkpoint_of_2_sharded_ranks_continues_identically_on_3_and_on_1(tmp_path, stage):
    from sharding_checkpoint_job import HALF, STEPS as JOB_STEPS, adam as job_adam

    directory, out = str(tmp_path / "ckpt"), str(tmp_path / "final.npz")
    run_job(2, str(stage), "save", directory)
    assert checkpoint.read_manifest(directory)["world_size"] == 2
    run_job(3, str(stage), "resume", directory, out)
    expected, plain, _ = train(make_strategy(), job_adam, steps=JOB_STEPS, local=True)
    with np.load(out, allow_pickle=False) as final:
        for key, value in expected.state_dict().items():
            np.testing.assert_allclose(final[key], value, rtol=1e-10, atol=1e-13, err_msg=key)
        state_bytes = final["state_bytes"]
    assert state_bytes.sum() == plain.inner.state_nbytes() and len(state_bytes) == 3
    backend.manual_seed(7)
    model = make_mlp()
    opt = job_adam(model.parameters())
    info = checkpoint.load(directory, model, opt)
    train_from(model, opt, range(info["step"], JOB_STEPS))
    assert info["step"] == HALF
    for key, value in expected.state_dict().items():
        np.testing.assert_allclose(model.state_dict()[key], value, rtol=1e-10, atol=1e-13,
                                   err_msg=key)


@pytest.mark.parametrize("ranks", [1, 3, 4])
def test_a_lazy_stage_3_checkpoint_of_2_ranks_loads_at_other_counts(tmp_path, ranks):
    """Saved at 2 ranks from a model built under LazyGuard, loaded at 1, 3 and 4 into one built
    under the guard: the loaded values are the saved ones (checked in the job on every rank),
    and training ends where the uninterrupted run does."""
    from sharding_checkpoint_job import LAZY_SIZES, STEPS as JOB_STEPS, adam as job_adam

    directory, out = str(tmp_path / "ckpt"), str(tmp_path / "final.npz")
    run_job(2, "3", "save", directory, "--lazy")
    run_job(ranks, "3", "resume", directory, out, "--lazy")
    expected, _, _ = train(make_strategy(), job_adam, steps=JOB_STEPS, local=True,
                           make_model=lambda: make_mlp(sizes=LAZY_SIZES))
    with np.load(out, allow_pickle=False) as final:
        for key, value in expected.state_dict().items():
            np.testing.assert_allclose(final[key], value, rtol=1e-10, atol=1e-13, err_msg=key)
        assert len(final["state_bytes"]) == ranks


def lazy_stage_3(seed):
    """16 Linear 256 x 256 layers (float64, 8.4 MB of parameters) built under LazyGuard,
    trained with Adam under sharding stage 3."""
    backend.manual_seed(seed)
    with fleet.LazyGuard():
        model = nn.Sequential(*[nn.Linear(256, 256, dtype="float64") for _ in range(16)])
    model = fleet.distributed_model(model)
    return model, fleet.distributed_optimizer(adam(model.parameters()), sharding(stage=3))


@pytest.mark.mpi(min_size=2)
def test_loading_a_lazy_stage_3_checkpoint_holds_this_ranks_share_not_the_model(tmp_path_factory):
    """While loading, a rank holds at most its own state twice over (the values read, and the
    copy put back if loading fails) plus a parameter's worth of reading, so the peak falls as
    1/N of the whole model; every rank ends with the saved values."""
    from mpi4py import MPI

    fleet.init(is_collective=True)
    world = MPI.COMM_WORLD
    directory = world.bcast(str(tmp_path_factory.mktemp("lazy")) if world.rank == 0 else None)
    model, opt = lazy_stage_3(0)
    x = np.random.default_rng(world.rank).standard_normal((4, 256))
    for _ in range(2):
        loss = (model(x) ** 2).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
    checkpoint.save(directory, model, opt, 2)
    saved = model.state_dict()
    resumed, again = lazy_stage_3(7)
    parameters = list(resumed.parameters())
    own = again.inner.shard_parameters.nbytes + again.inner.state_nbytes() + \
        again.inner.shard_gradient.nbytes
    largest = max(p.size for p in parameters) * 8
    whole = sum(p.size for p in parameters) * 8
    tracemalloc.start()
    try:
        checkpoint.load(directory, resumed, again)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    bound = 2 * own + 2 * largest + 2 ** 20
    ok(peak <= bound, f"loading peaked at {peak} bytes, above twice this rank's state {own} "
                      f"plus reading ({bound}); the whole model's parameters are {whole}")
    for name, value in resumed.state_dict().items():
        equal(value, saved[name], err_msg=name)


def test_a_sharded_checkpoint_of_another_model_is_refused(tmp_path):
    fleet.init(is_collective=True)
    model, opt, _ = train(sharding(), adam, steps=1, local=True)
    checkpoint.save(str(tmp_path), model, opt, 1)
    backend.manual_seed(0)
    wider = make_mlp(sizes=(6, 20, 12, 4))
    with pytest.raises(ValueError, match=r"parameter space of \d+ elements; this optimizer "
                                         r"updates \[0, \d+\)"):
        checkpoint.load(str(tmp_path), wider, adam(wider.parameters()))


def test_a_checkpoint_without_sharding_still_needs_the_same_world_size(tmp_path):
    import json

    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = make_mlp()
    opt = adam(model.parameters())
    checkpoint.save(str(tmp_path), model, opt, 1)
    manifest_path = tmp_path / checkpoint.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["world_size"] = 2
    manifest["files"].append(dict(manifest["files"][0], rank=1))
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="written by 2 rank.+only the optimizer state of a "
                                         "sharding run is re-sharded"):
        checkpoint.load(str(tmp_path), model, opt)

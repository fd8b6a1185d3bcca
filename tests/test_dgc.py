"""dgc (Deep Gradient Compression) and the optimizers' gradient clipping.

dgc with sparsity [0] against data-parallel Momentum, the sparsity schedule of the seed's
example, top-k selection, residual accumulation and momentum factor masking against a NumPy
simulation of every rank's state, the bytes each rank sends, checkpoints, and what dgc refuses.
Every test runs alone (``local=True``: one process, no communication) and, marked ``mpi``, on
N ranks, each rank checked with a verdict all ranks share.
"""
import math
from fractions import Fraction

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.core import backend
from fleetmpi import nn, optimizer
from fleetmpi.optimizer import ClipGradByGlobalNorm, ClipGradByNorm, StepHook
from fleetmpi.strategies.dgc import keep_count, sparsity_at
from comm_support import close, equal, ok, raises
from strategy_support import (FEATURES, global_batch, make_mlp, make_strategy, shard, train,
                              world_gather)

LR, MU = 0.1, 0.9
WIDE = (FEATURES, 256, 128, 4)


def momentum(weight_decay=None, nesterov=False, grad_clip=None):
    return lambda ps: optimizer.Momentum(learning_rate=LR, momentum=MU, parameters=ps,
                                         use_nesterov=nesterov, weight_decay=weight_decay,
                                         grad_clip=grad_clip)


def dgc_strategy(fuse=False, **configs):
    strategy = make_strategy(dgc=True, dgc_configs=configs)
    strategy.build_strategy = {"fuse_all_optimizer_ops": fuse}
    return strategy


def in_buffer_order(parameters, arrays):
    """``arrays`` (one per parameter) laid out as the parameters lie in their flat buffer."""
    flat = np.empty(sum(p.size for p in parameters))
    for p, a in zip(parameters, arrays):
        flat[p.offset:p.offset + p.size] = a
    return flat


def flat_parameters(model):
    return np.concatenate([p.data.reshape(-1) for p in model.parameters()])


# one process alone (no communication), or N ranks under mpiexec
ALONE_AND_RANKS = pytest.mark.parametrize("local", [
    pytest.param(True, id="alone"),
    pytest.param(False, id="ranks", marks=pytest.mark.mpi(min_size=2))])


# -- the sparsity schedule -------------------------------------------------------------------

SEED_SPARSITY = [0.75, 0.9375, 0.984375, 0.996, 0.999]


def test_schedule_of_the_seed_example():
    """001: sparsity [0.75, 0.9375, 0.984375, 0.996, 0.999] with rampup_step 100 uses 0.75 at
    steps 0-19, 0.9375 at 20-39, and so on; after the list the last value stays."""
    expected = [SEED_SPARSITY[t // 20] for t in range(100)] + [0.999] * 50
    assert [sparsity_at(t, 0, 100, SEED_SPARSITY) for t in range(150)] == expected
    assert sparsity_at(19, 0, 100, SEED_SPARSITY) == 0.75
    assert sparsity_at(20, 0, 100, SEED_SPARSITY) == 0.9375
    assert sparsity_at(79, 0, 100, SEED_SPARSITY) == 0.996
    assert sparsity_at(80, 0, 100, SEED_SPARSITY) == 0.999


def test_schedule_counts_from_rampup_begin_step():
    assert [sparsity_at(t, 1252, 100, SEED_SPARSITY) for t in (0, 1251)] == [None, None]
    assert [sparsity_at(t, 1252, 100, SEED_SPARSITY) for t in (1252, 1271, 1272, 1332, 9999)] \
        == [0.75, 0.75, 0.9375, 0.999, 0.999]
    assert [sparsity_at(t, 0, 1, [0.999]) for t in (0, 1, 7)] == [0.999] * 3


def test_training_follows_the_schedule():
    strategy = dgc_strategy(rampup_begin_step=2, rampup_step=4, sparsity=[0.5, 0.75])
    fleet.init(is_collective=True)
    model = make_mlp()
    opt = fleet.distributed_optimizer(momentum()(model.parameters()), strategy, local=True)
    dgc = opt.strategies["dgc"]
    sizes = [p.size for p in model.parameters()]
    loss_fn = nn.CrossEntropyLoss()
    seen, sent = [], []
    for step in range(8):
        opt.minimize(model, loss_fn, *global_batch(step))
        seen.append(dgc.current_sparsity)
        sent.append(dgc.bytes_sent_last_step)
    assert seen == [None, None, 0.5, 0.5, 0.75, 0.75, 0.75, 0.75]
    assert dgc.updates == 8
    for sparsity, nbytes in zip(seen[2:], sent[2:]):
        assert nbytes == 12 * sum(math.ceil(n * (1 - sparsity)) for n in sizes)


def test_keep_count():
    assert keep_count(1000, 0.999) == 1  # 1000 * (1 - 0.999) is 1.0000000000000009
    assert keep_count(1001, 0.999) == 2
    assert keep_count(32768, 0.999) == 33
    assert keep_count(4, 0.999) == 1
    assert keep_count(96, 0.0) == 96
    assert keep_count(96, 0.75) == 24
    assert keep_count(97, 0.75) == 25


# -- sparsity [0] is data-parallel Momentum --------------------------------------------------

DENSE_CASES = {
    "plain": ({}, {}),
    "late_start": ({"rampup_begin_step": 2}, {}),
    "weight_decay": ({}, {"weight_decay": 0.01}),
    "late_start_weight_decay_nesterov": ({"rampup_begin_step": 3},
                                         {"weight_decay": 0.01, "nesterov": True}),
    "nesterov": ({}, {"nesterov": True}),
}


@ALONE_AND_RANKS
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("case", sorted(DENSE_CASES))
def test_sparsity_zero_is_momentum(case, fuse, local):
    configs, opt_args = DENSE_CASES[case]
    strategy = dgc_strategy(fuse=fuse, sparsity=[0.0], **configs)
    model, opt, losses = train(strategy, momentum(**opt_args), steps=6, local=local)
    reference = make_strategy()
    reference.build_strategy = {"fuse_all_optimizer_ops": fuse}
    dense_model, _, dense_losses = train(reference, momentum(**opt_args), steps=6, local=local)
    ok(opt.strategies["dgc"].current_sparsity == 0.0, "dgc never compressed")
    close(flat_parameters(model), flat_parameters(dense_model), rtol=1e-10, atol=1e-12)
    close(losses, dense_losses, rtol=1e-10)
    if not local:
        parameters = world_gather(flat_parameters(model))
        equal(parameters, np.broadcast_to(parameters[0], parameters.shape))


# -- top-k, residuals and masking against a NumPy simulation of every rank ------------------

class LocalGradients(StepHook):
    """Outermost hook: this rank's own gradients and parameters as the reduce stage starts."""

    def __init__(self):
        self.grads, self.params = [], []

    def reduce(self, ctx, proceed):
        parameters = ctx.optimizer.parameters()
        self.grads.append([p.grad.data.reshape(-1).copy() for p in parameters])
        self.params.append([p.data.reshape(-1).copy() for p in parameters])
        return proceed(ctx)


def clip(g, clip_norm):
    """``g`` scaled to norm ``clip_norm`` when it is longer (None: unchanged)."""
    norm = np.linalg.norm(g)
    return g * (clip_norm / norm) if clip_norm is not None and norm > clip_norm else g


def simulate(grads, params, begin, sparsity, weight_decay, nesterov, clip_norm):
    """Every rank's DGC, written out: ``grads[t][r][i]`` is rank r's gradient of tensor i at
    update t, ``params[t][i]`` the parameters. Returns the parameters after each update, the
    exchanged gradients and every rank's final (u, v)."""
    steps, size, count = len(grads), len(grads[0]), len(params[0])
    velocity = [np.zeros_like(p) for p in params[0]]
    u = [[np.zeros_like(p) for p in params[0]] for _ in range(size)]
    v = [[np.zeros_like(p) for p in params[0]] for _ in range(size)]
    after, exchanged = [], []
    for t in range(steps):
        p_t = params[t]
        if t < begin:  # dense Momentum on the averaged gradient, clipped to clip_norm
            new, G = [], []
            for i in range(count):
                g = clip(np.mean([grads[t][r][i] for r in range(size)], axis=0), clip_norm)
                g = g + weight_decay * p_t[i]
                velocity[i] = MU * velocity[i] + g
                step = g + MU * velocity[i] if nesterov else velocity[i]
                new.append(p_t[i] - LR * step)
                G.append(None)
            after.append(new)
            exchanged.append(G)
            continue
        if t == begin:
            for r in range(size):
                u[r] = [(MU if nesterov else 1.0) * vel for vel in velocity]
        sums = [np.zeros_like(p) for p in p_t]
        for r in range(size):
            for i in range(count):
                local = None if clip_norm is None else clip_norm / math.sqrt(size)
                g = clip(grads[t][r][i], local) + weight_decay * p_t[i]
                delayed = v[r][i] != 0
                if nesterov:
                    u[r][i] = MU * (u[r][i] + g)
                    v[r][i] = v[r][i] + u[r][i] + g
                else:
                    u[r][i] = MU * u[r][i] + g
                    v[r][i] = v[r][i] + u[r][i]
                k = max(1, math.ceil(g.size * (1 - Fraction(str(sparsity)))))
                chosen = np.argsort(-np.abs(v[r][i]), kind="stable")[:k]
                sums[i][chosen] += v[r][i][chosen]
                v[r][i][chosen] = 0
                masked = chosen[delayed[chosen]]
                u[r][i][masked] = 0
        G = [s / size for s in sums]
        after.append([p - LR * g for p, g in zip(p_t, G)])
        exchanged.append(G)
    return after, exchanged, u, v


SIM_CASES = {
    "momentum": {},
    "late_start": {"begin": 2},
    "weight_decay_clip": {"weight_decay": 0.02, "clip_norm": 0.05},
    "late_start_clip": {"begin": 2, "clip_norm": 0.05},
    "nesterov_late_start": {"begin": 1, "nesterov": True, "weight_decay": 0.01},
}


@ALONE_AND_RANKS
@pytest.mark.parametrize("case", sorted(SIM_CASES))
def test_matches_simulation(case, local):
    settings = {"begin": 0, "weight_decay": 0.0, "nesterov": False, "clip_norm": None}
    settings.update(SIM_CASES[case])
    sparsity, steps = 0.9, 5
    fleet.init(is_collective=True)
    size, rank = (1, 0) if local else (fleet.worker_num(), fleet.worker_index())
    backend.manual_seed(0)
    model = make_mlp()
    if not local:
        model = fleet.distributed_model(model)
    clip = None if settings["clip_norm"] is None else ClipGradByNorm(settings["clip_norm"])
    make = momentum(settings["weight_decay"] or None, settings["nesterov"], clip)
    strategy = dgc_strategy(sparsity=[sparsity], rampup_begin_step=settings["begin"])
    opt = fleet.distributed_optimizer(make(model.parameters()), strategy, local=local)
    recorder = LocalGradients()
    opt.add_hook(recorder, first=True)
    loss_fn = nn.CrossEntropyLoss()
    params_after, grads_after = [], []
    for step in range(steps):
        x, y = global_batch(step)
        opt.minimize(model, loss_fn, shard(x, rank, size), shard(y, rank, size))
        params_after.append([p.data.reshape(-1).copy() for p in model.parameters()])
        grads_after.append([p.grad.data.reshape(-1).copy() for p in model.parameters()])

    gather = (lambda a: a[None]) if local else world_gather
    grads = [[[gather(g)[r] for g in recorder.grads[t]] for r in range(size)]
             for t in range(steps)]
    if settings["clip_norm"] is not None:
        longest = max(np.linalg.norm(g) for grads_t in grads for g_r in grads_t for g in g_r)
        ok(longest > settings["clip_norm"], f"no gradient is longer than the clip: {longest}")
    after, exchanged, u, v = simulate(grads, recorder.params, settings["begin"], sparsity,
                                      settings["weight_decay"], settings["nesterov"],
                                      settings["clip_norm"])
    for t in range(steps):
        close(np.concatenate(params_after[t]), np.concatenate(after[t]), rtol=1e-12,
              atol=1e-14)
        if t >= settings["begin"]:
            close(np.concatenate(grads_after[t]), np.concatenate(exchanged[t]), rtol=1e-12,
                  atol=1e-14)
    state = opt.strategies["dgc"].state_dict()
    ok(sorted(state) == ["u.0", "updates", "v.0"], f"dgc state keys {sorted(state)}")
    ok(state["updates"] == steps)
    parameters = model.parameters()
    close(state["u.0"], in_buffer_order(parameters, u[rank]), rtol=1e-12, atol=1e-14)
    close(state["v.0"], in_buffer_order(parameters, v[rank]), rtol=1e-12, atol=1e-14)
    # the residual holds what was not sent: most of each tensor at sparsity 0.9
    held = np.count_nonzero(state["v.0"])
    ok(held > 0.5 * state["v.0"].size, f"only {held} residual entries are nonzero")


class SkipOddSteps(StepHook):
    """Outermost: no update on odd steps (as gradient merging does between its updates)."""

    def forward(self, ctx, proceed):
        if ctx.step % 2:
            ctx.apply_update = False
            ctx.sync_gradients = False
        return proceed(ctx)


def test_only_updates_count():
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = make_mlp()
    strategy = dgc_strategy(rampup_begin_step=1, rampup_step=2, sparsity=[0.5, 0.9])
    opt = fleet.distributed_optimizer(momentum()(model.parameters()), strategy, local=True)
    opt.add_hook(SkipOddSteps(), first=True)
    dgc = opt.strategies["dgc"]
    loss_fn = nn.CrossEntropyLoss()
    seen = []
    for step in range(8):
        before = (flat_parameters(model), dgc.state_dict())
        opt.minimize(model, loss_fn, *global_batch(step))
        if step % 2:
            np.testing.assert_array_equal(flat_parameters(model), before[0])
            for key in ("u.0", "v.0", "updates"):
                np.testing.assert_array_equal(dgc.state_dict()[key], before[1][key])
        else:
            seen.append(dgc.current_sparsity)
    assert dgc.updates == 4
    assert opt.inner.step_count == 4
    assert seen == [None, 0.5, 0.9, 0.9]


# -- bytes sent per step ---------------------------------------------------------------------

@ALONE_AND_RANKS
def test_bytes_per_step_against_dense(local):
    """At sparsity 0.999 each tensor sends ceil(numel / 1000) (int32 index, float64 value)
    pairs; before rampup_begin_step the dense gradient travels."""
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = make_mlp(WIDE)
    if not local:
        model = fleet.distributed_model(model)
    strategy = dgc_strategy(rampup_begin_step=1, sparsity=[0.999])
    opt = fleet.distributed_optimizer(momentum()(model.parameters()), strategy, local=local)
    dgc = opt.strategies["dgc"]
    sizes = [p.size for p in model.parameters()]
    dense = 8 * sum(sizes)
    sparse = (4 + 8) * sum(-(-n // 1000) for n in sizes)
    assert (dense, sparse) == (281632, 468)  # 35204 float64 values; 39 pairs
    ok(dgc.dense_bytes == dense, f"dense_bytes {dgc.dense_bytes}")
    size, rank = (1, 0) if local else (fleet.worker_num(), fleet.worker_index())
    loss_fn = nn.CrossEntropyLoss()
    for step in range(3):
        counted = None if local else opt.communicator.payload_bytes
        verdicts = opt.strategies["nonfinite_check"].exchanged_bytes
        x, y = global_batch(step)
        opt.minimize(model, loss_fn, shard(x, rank, size), shard(y, rank, size))
        expected = dense if step == 0 else sparse
        ok(dgc.bytes_sent_last_step == expected,
           f"step {step}: bytes_sent_last_step {dgc.bytes_sent_last_step}, expected {expected}")
        if not local:
            # Besides dgc's, the non-finite check's verdicts where they were exchanged (the
            # compressed steps; the dense one's reduction carries them).
            verdicts = opt.strategies["nonfinite_check"].exchanged_bytes - verdicts
            ok(verdicts == (0 if step == 0 else
                            opt.strategies["nonfinite_check"].verdict_bytes),
               f"step {step}: verdicts {verdicts}")
            counted = opt.communicator.payload_bytes - counted - verdicts
            ok(counted == expected, f"step {step}: the communicator counted {counted} bytes, "
                                    f"expected {expected}")


# -- checkpoints -----------------------------------------------------------------------------

@ALONE_AND_RANKS
def test_checkpoint_resumes_bit_for_bit(local):
    fleet.init(is_collective=True)
    size, rank = (1, 0) if local else (fleet.worker_num(), fleet.worker_index())
    loss_fn = nn.CrossEntropyLoss()

    def build():
        backend.manual_seed(0)
        model = make_mlp()
        if not local:
            model = fleet.distributed_model(model)
        strategy = dgc_strategy(rampup_begin_step=2, sparsity=[0.9])
        return model, fleet.distributed_optimizer(momentum(weight_decay=0.01)(
            model.parameters()), strategy, local=local)

    def run(model, opt, steps):
        for step in steps:
            x, y = global_batch(step)
            opt.minimize(model, loss_fn, shard(x, rank, size), shard(y, rank, size))

    model, opt = build()
    run(model, opt, range(6))
    straight = flat_parameters(model)

    model, opt = build()
    run(model, opt, range(3))
    saved_model, saved_opt = model.state_dict(), opt.state_dict()
    ok(saved_opt["strategy.dgc.updates"] == 3)
    model, opt = build()
    model.set_state_dict(saved_model)
    opt.set_state_dict(saved_opt)
    run(model, opt, range(3, 6))
    equal(flat_parameters(model), straight)


def test_checkpoint_without_dgc_state_is_refused():
    fleet.init(is_collective=True)
    model = make_mlp()
    opt = fleet.distributed_optimizer(momentum()(model.parameters()), dgc_strategy(),
                                      local=True)
    plain = fleet.distributed_optimizer(momentum()(model.parameters()), make_strategy(),
                                        local=True)
    with pytest.raises(KeyError, match="strategy dgc state has no 'u.0'"):
        opt.set_state_dict(plain.state_dict())


# -- what dgc refuses ------------------------------------------------------------------------

@pytest.mark.parametrize("make, name", [
    (lambda ps: optimizer.SGD(learning_rate=0.1, parameters=ps), "SGD"),
    (lambda ps: optimizer.Adam(parameters=ps), "Adam"),
    (lambda ps: optimizer.AdamW(parameters=ps), "AdamW"),
])
@ALONE_AND_RANKS
def test_dgc_needs_momentum(make, name, local):
    fleet.init(is_collective=True)
    model = make_mlp()
    with raises(ValueError, match=f"strategy dgc works with a Momentum optimizer, not {name}$"):
        fleet.distributed_optimizer(make(model.parameters()), dgc_strategy(), local=local)


def test_dgc_refuses_global_norm_clipping():
    fleet.init(is_collective=True)
    model = make_mlp()
    make = momentum(grad_clip=ClipGradByGlobalNorm(1.0))
    with pytest.raises(ValueError, match=r"grad_clip=None or ClipGradByNorm, not "
                                         r"ClipGradByGlobalNorm\(clip_norm=1.0\)"):
        fleet.distributed_optimizer(make(model.parameters()), dgc_strategy(), local=True)


# -- gradient clipping of the optimizers -----------------------------------------------------

def model_with_grads(scale, seed=1):
    backend.manual_seed(seed)
    model = make_mlp()
    rng = np.random.default_rng(seed)
    for p in model.parameters():
        p.grad[...] = rng.standard_normal(p.shape) * scale
    return model


OPTIMIZERS = {
    "sgd": lambda ps, clip: optimizer.SGD(0.1, ps, weight_decay=0.01, grad_clip=clip),
    "momentum": lambda ps, clip: optimizer.Momentum(0.1, 0.9, ps, use_nesterov=True,
                                                    weight_decay=0.01, grad_clip=clip),
    "adam": lambda ps, clip: optimizer.Adam(0.01, parameters=ps, weight_decay=0.01,
                                            grad_clip=clip),
    "adamw": lambda ps, clip: optimizer.AdamW(0.01, parameters=ps, grad_clip=clip),
}


def by_norm(grads, clip_norm):
    return [clip(g, clip_norm) for g in grads]


def by_global_norm(grads, clip_norm):
    norm = math.sqrt(sum(np.sum(g * g) for g in grads))
    return [g * (clip_norm / max(norm, clip_norm)) for g in grads]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("clip_class, formula", [(ClipGradByNorm, by_norm),
                                                 (ClipGradByGlobalNorm, by_global_norm)])
def test_clipping_matches_formula(clip_class, formula, opt_name, fused):
    """Two steps with the clip equal two steps without it on gradients clipped by hand; the
    gradient buffers are left as they were."""
    clip_norm = 5.0  # between the norms of the tensors: some are clipped, some are not
    clipped, by_hand = model_with_grads(1.0), model_with_grads(1.0)
    norms = [np.linalg.norm(p.grad) for p in clipped.parameters()]
    assert min(norms) < clip_norm < max(norms)
    opt = OPTIMIZERS[opt_name](clipped.parameters(), clip_class(clip_norm))
    reference = OPTIMIZERS[opt_name](by_hand.parameters(), None)
    opt.fuse_all_optimizer_ops = reference.fuse_all_optimizer_ops = fused
    for _ in range(2):
        grads = [p.grad.numpy().copy() for p in clipped.parameters()]
        for p, g in zip(by_hand.parameters(), formula(grads, clip_norm)):
            p.grad[...] = g
        opt.step()
        reference.step()
        for p, g in zip(clipped.parameters(), grads):
            np.testing.assert_array_equal(p.grad, g)
        np.testing.assert_allclose(flat_parameters(clipped), flat_parameters(by_hand),
                                   rtol=1e-14, atol=1e-15)
    assert not np.allclose(flat_parameters(clipped), flat_parameters(model_with_grads(1.0)))


@pytest.mark.parametrize("clip_class", [ClipGradByNorm, ClipGradByGlobalNorm])
def test_gradients_inside_the_bound_are_not_touched(clip_class):
    clipped, plain = model_with_grads(1e-3), model_with_grads(1e-3)
    optimizer.Momentum(0.1, 0.9, clipped.parameters(), grad_clip=clip_class(10.0)).step()
    optimizer.Momentum(0.1, 0.9, plain.parameters()).step()
    np.testing.assert_array_equal(flat_parameters(clipped), flat_parameters(plain))


def test_clip_scales():
    grads = [np.array([3.0, 4.0]), np.array([0.6, 0.8]), np.zeros(3)]
    assert [float(s) for s in ClipGradByNorm(1.0).scales(grads)] == [0.2, 1.0, 1.0]
    global_norm = math.sqrt(25 + 1)
    np.testing.assert_allclose([float(s) for s in ClipGradByGlobalNorm(1.0).scales(grads)],
                               [1 / global_norm] * 3, rtol=1e-15)
    clipped = ClipGradByGlobalNorm(1.0)(grads)
    np.testing.assert_allclose(math.sqrt(sum(np.sum(g * g) for g in clipped)), 1.0,
                               rtol=1e-15)


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), "1", True, None])
def test_bad_clip_norm_is_named(value):
    with pytest.raises(ValueError, match="clip_norm must be a positive finite number, not"):
        ClipGradByNorm(value)


def test_bad_grad_clip_is_named():
    with pytest.raises(ValueError, match="grad_clip must be None, fleetmpi.optimizer."
                                         "ClipGradByNorm or ClipGradByGlobalNorm, not 1.0"):
        optimizer.SGD(parameters=make_mlp().parameters(), grad_clip=1.0)


@ALONE_AND_RANKS
def test_data_parallel_clips_the_averaged_gradient(local):
    """Without dgc the clip acts on the gradient averaged over the ranks, so N ranks match one
    process on the global batch; and it does clip."""
    clip = ClipGradByGlobalNorm(0.05)
    model, _, _ = train(make_strategy(), momentum(grad_clip=clip), local=local)
    single, _, _ = train(make_strategy(), momentum(grad_clip=clip), local=True)
    unclipped, _, _ = train(make_strategy(), momentum(), local=True)
    close(flat_parameters(model), flat_parameters(single), rtol=1e-10, atol=1e-12)
    ok(not np.allclose(flat_parameters(single), flat_parameters(unclipped)), "nothing clipped")

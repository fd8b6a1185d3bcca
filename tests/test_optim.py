"""Optimizers against hand-written update rules, learning-rate schedules, state, errors."""
import math

import numpy as np
import pytest

from fleetmpi.core import backend
from fleetmpi import nn, optimizer
from fleetmpi.optimizer import lr
from comm_support import host


pytestmark = pytest.mark.usefixtures("float64_layers")


def model_with_grads(seed=1):
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    rng = np.random.default_rng(seed)
    for p in model.parameters():
        p.grad[...] = backend.asarray(rng.standard_normal(p.shape))
    return model


def snapshot(model):
    return [(host(p.data).copy(), host(p.grad).copy()) for p in model.parameters()]


def expected_sgd(p, g, lr_, wd):
    return p - lr_ * (g + wd * p)


@pytest.mark.parametrize("fused", [False, True])
def test_sgd_matches_formula(fused):
    model = model_with_grads()
    before = snapshot(model)
    opt = optimizer.SGD(learning_rate=0.1, parameters=model.parameters(), weight_decay=0.01)
    opt.fuse_all_optimizer_ops = fused
    opt.step()
    for (p0, g), p in zip(before, model.parameters()):
        np.testing.assert_allclose(host(p.data), expected_sgd(p0, g, 0.1, 0.01), rtol=1e-14)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_matches_formula_over_steps(fused, nesterov):
    model = model_with_grads()
    params = model.parameters()
    opt = optimizer.Momentum(learning_rate=0.05, momentum=0.9, parameters=params,
                             use_nesterov=nesterov, weight_decay=0.001)
    opt.fuse_all_optimizer_ops = fused
    state = [(host(p.data).copy(), np.zeros(p.shape)) for p in params]
    for step in range(3):
        grads = [host(p.grad).copy() for p in params]
        opt.step()
        for i, ((p, v), g) in enumerate(zip(state, grads)):
            g = g + 0.001 * p
            v = 0.9 * v + g
            p = p - 0.05 * (g + 0.9 * v if nesterov else v)
            state[i] = (p, v)
            np.testing.assert_allclose(host(params[i].data), p, rtol=1e-13)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("cls, decay", [(optimizer.Adam, None), (optimizer.Adam, 0.01),
                                        (optimizer.AdamW, 0.05)])
def test_adam_matches_formula_over_steps(fused, cls, decay):
    model = model_with_grads()
    params = model.parameters()
    opt = cls(learning_rate=0.01, beta1=0.8, beta2=0.95, epsilon=1e-6, parameters=params,
              weight_decay=decay)
    opt.fuse_all_optimizer_ops = fused
    state = [(host(p.data).copy(), np.zeros(p.shape), np.zeros(p.shape)) for p in params]
    for t in range(1, 4):
        grads = [host(p.grad).copy() for p in params]
        opt.step()
        for i, ((p, m, v), g) in enumerate(zip(state, grads)):
            if cls is optimizer.AdamW:
                p = p * (1 - 0.01 * decay)
            elif decay:
                g = g + decay * p
            m = 0.8 * m + 0.2 * g
            v = 0.95 * v + 0.05 * g * g
            m_hat, v_hat = m / (1 - 0.8 ** t), v / (1 - 0.95 ** t)
            p = p - 0.01 * m_hat / (np.sqrt(v_hat) + 1e-6)
            state[i] = (p, m, v)
            np.testing.assert_allclose(host(params[i].data), p, rtol=1e-12)


def test_fused_and_unfused_updates_are_identical():
    results = []
    for fused in (False, True):
        backend.manual_seed(0)
        model = model_with_grads()
        opt = optimizer.Adam(learning_rate=0.01, parameters=model.parameters(),
                             weight_decay=0.1)
        opt.fuse_all_optimizer_ops = fused
        for _ in range(3):
            opt.step()
        results.append(host(model.flat_buffers()[0].data).copy())
    if backend.on_gpu():    # the CUDA kernel contracts products into FMAs; CuPy's ops do not
        np.testing.assert_allclose(results[0], results[1], rtol=1e-14, atol=1e-16)
    else:
        np.testing.assert_array_equal(results[0], results[1])


def test_run_views_are_each_parameters_view_whole_or_cut():
    """``BufferRun.views`` (the per-parameter update's) gives what ``view`` gives for each
    parameter: shaped like it when the run holds all of it, the 1-d piece a shard cut."""
    model = model_with_grads()
    opt = optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    opt.shard(5, 20)    # cuts both weights (the buffer holds the last layer first)
    for run in opt._update_runs:
        flat = np.arange(run.stop - run.start, dtype=np.float64)
        views = run.views(flat)
        assert len(views) == len(run.parameters)
        for view, p in zip(views, run.parameters):
            expected = run.view(flat, p)
            assert view.shape == expected.shape
            np.testing.assert_array_equal(view, expected)
            whole = run.start <= p.offset and p.offset + p.size <= run.stop
            assert view.shape == (tuple(p.shape) if whole else (view.size,))


def test_minimize_trains_and_returns_a_0d_loss():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 5))
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    model = nn.MLP([5, 16, 2])
    opt = optimizer.Momentum(learning_rate=0.2, momentum=0.9, parameters=model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    losses = [float(opt.minimize(model, loss_fn, x, y)) for _ in range(60)]
    first = opt.minimize(model, loss_fn, x, y)
    assert first.shape == ()
    assert losses[-1] < 0.2 * losses[0]


def test_schedules():
    step = lr.StepDecay(0.1, step_size=2, gamma=0.5)
    cosine = lr.CosineAnnealingDecay(0.1, T_max=4, eta_min=0.01)
    warm = lr.LinearWarmup(lr.StepDecay(0.2, step_size=1, gamma=0.5), warmup_steps=2,
                           start_lr=0.0, end_lr=0.2)
    seen = {"step": [], "cosine": [], "warm": []}
    for _ in range(6):
        seen["step"].append(step())
        seen["cosine"].append(cosine())
        seen["warm"].append(warm())
        for s in (step, cosine, warm):
            s.step()
    np.testing.assert_allclose(seen["step"], [0.1, 0.1, 0.05, 0.05, 0.025, 0.025])
    np.testing.assert_allclose(
        seen["cosine"], [0.01 + 0.09 * (1 + math.cos(math.pi * min(t, 4) / 4)) / 2
                         for t in range(6)])
    np.testing.assert_allclose(seen["warm"], [0.0, 0.1, 0.2, 0.1, 0.05, 0.025])


def test_scheduler_drives_the_optimizer_and_survives_state_dict():
    model = model_with_grads()
    schedule = lr.StepDecay(1.0, step_size=1, gamma=0.5)
    opt = optimizer.SGD(learning_rate=schedule, parameters=model.parameters())
    schedule.step()
    schedule.step()
    assert opt.get_lr() == 0.25
    state = opt.state_dict()
    other_schedule = lr.StepDecay(1.0, step_size=1, gamma=0.5)
    other = optimizer.SGD(learning_rate=other_schedule, parameters=model.parameters())
    other.set_state_dict(state)
    assert other.get_lr() == 0.25
    with pytest.raises(RuntimeError, match="LRScheduler"):
        opt.set_lr(0.1)


def test_state_dict_resumes_exactly():
    def run(split):
        backend.manual_seed(0)
        model = model_with_grads()
        opt = optimizer.Adam(learning_rate=0.01, parameters=model.parameters())
        for _ in range(split):
            opt.step()
        if split < 4:
            state, weights = opt.state_dict(), model.state_dict()
            backend.manual_seed(9)
            model = model_with_grads()
            opt = optimizer.Adam(learning_rate=0.01, parameters=model.parameters())
            opt.set_state_dict(state)
            model.set_state_dict(weights)
            for _ in range(4 - split):
                opt.step()
        return host(model.flat_buffers()[0].data).copy()

    np.testing.assert_array_equal(run(4), run(2))


@pytest.mark.parametrize("make, message", [
    (lambda ps: optimizer.SGD(learning_rate=-1, parameters=ps), r"learning_rate must lie in"),
    (lambda ps: optimizer.Momentum(momentum=1.5, parameters=ps), r"momentum must lie in \[0, 1\]"),
    (lambda ps: optimizer.Adam(beta1=1.0, parameters=ps), r"beta1 must lie in \[0, 1\)"),
    (lambda ps: optimizer.Adam(epsilon=0, parameters=ps), "epsilon must be a positive"),
    (lambda ps: optimizer.SGD(), "needs parameters=model.parameters()"),
    (lambda ps: optimizer.SGD(parameters=[]), "empty parameter list"),
    (lambda ps: lr.StepDecay(0.1, step_size=0), "step_size must be a positive integer"),
])
def test_bad_arguments_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make(model_with_grads().parameters())

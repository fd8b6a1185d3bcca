"""RMSProp, Adagrad and Adamax against NumPy forms of Paddle 2.5's update rules, per
parameter and fused over the flat runs; Momentum's multi_precision."""
import numpy as np
import pytest

import fleetmpi as paddle
from fleetmpi import nn, optimizer

STEPS = 3


def numpy_rmsprop(p, grads, lr, rho=0.95, eps=1e-6, momentum=0.0, centered=False):
    square, mean, velocity = (np.zeros_like(p) for _ in range(3))
    for g in grads:
        square = rho * square + (1 - rho) * g * g
        if centered:
            mean = rho * mean + (1 - rho) * g
            velocity = momentum * velocity + lr * g / np.sqrt(square - mean * mean + eps)
        else:
            velocity = momentum * velocity + lr * g / np.sqrt(square + eps)
        p = p - velocity
    return p


def numpy_adagrad(p, grads, lr, eps=1e-6, initial=0.0):
    moment = np.full_like(p, initial)
    for g in grads:
        moment = moment + g * g
        p = p - lr * g / (np.sqrt(moment) + eps)
    return p


def numpy_adamax(p, grads, lr, beta1=0.9, beta2=0.999, eps=1e-8):
    moment, norm = np.zeros_like(p), np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        moment = beta1 * moment + (1 - beta1) * g
        norm = np.maximum(beta2 * norm + eps, np.abs(g))
        p = p - lr / (1 - beta1 ** t) * moment / norm
    return p


CASES = {
    "rmsprop": (lambda ps: optimizer.RMSProp(0.01, parameters=ps),
                lambda p, gs: numpy_rmsprop(p, gs, 0.01)),
    "rmsprop_centered": (
        lambda ps: optimizer.RMSProp(0.01, rho=0.9, momentum=0.5, centered=True, parameters=ps),
        lambda p, gs: numpy_rmsprop(p, gs, 0.01, rho=0.9, momentum=0.5, centered=True)),
    "adagrad": (lambda ps: optimizer.Adagrad(0.1, parameters=ps, initial_accumulator_value=0.1),
                lambda p, gs: numpy_adagrad(p, gs, 0.1, initial=0.1)),
    "adamax": (lambda ps: optimizer.Adamax(0.01, parameters=ps),
               lambda p, gs: numpy_adamax(p, gs, 0.01)),
}


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_update_equals_paddles_rule(case, fused):
    make, reference = CASES[case]
    paddle.seed(3)
    model = nn.Sequential(nn.Linear(3, 2, dtype="float64"), nn.Linear(2, 1, dtype="float64"))
    start = [p.numpy().copy() for p in model.parameters()]
    opt = make(model.parameters())
    opt.fuse_all_optimizer_ops = fused
    rng = np.random.default_rng(1)
    grads = [[rng.standard_normal(p.shape) for p in model.parameters()] for _ in range(STEPS)]
    for step in grads:
        for p, g in zip(model.parameters(), step):
            p.grad[...] = g
        opt.step()
    for index, p in enumerate(model.parameters()):
        expected = reference(start[index], [step[index] for step in grads])
        np.testing.assert_allclose(p.numpy(), expected, rtol=1e-12, atol=1e-14)


def test_state_round_trips_through_state_dict():
    model = nn.Linear(3, 2, dtype="float64")
    opt = optimizer.Adagrad(0.1, parameters=model.parameters(), initial_accumulator_value=0.5)
    model(np.ones((1, 3))).sum().backward()
    opt.step()
    again = optimizer.Adagrad(0.1, parameters=model.parameters())
    again.set_state_dict(opt.state_dict())
    for mine, theirs in zip(again.run_states, opt.run_states):
        np.testing.assert_array_equal(mine["moment"], theirs["moment"])


def test_multi_precision_is_accepted_for_float32_masters_and_refused_otherwise():
    model = nn.Linear(2, 2)
    optimizer.Momentum(0.1, parameters=model.parameters(), multi_precision=True)
    optimizer.Adam(parameters=model.parameters(), multi_precision=True)
    half = nn.Linear(2, 2, dtype="float16")
    with pytest.raises(ValueError, match="keeps float32 master weights, but the parameters are "
                                         "float16"):
        optimizer.Momentum(0.1, parameters=half.parameters(), multi_precision=True)
    with pytest.raises(ValueError, match="rho must lie in"):
        optimizer.RMSProp(0.1, rho=2.0, parameters=model.parameters())
    with pytest.raises(ValueError, match="epsilon must be a positive number, not 0"):
        optimizer.Adagrad(0.1, epsilon=0, parameters=model.parameters())

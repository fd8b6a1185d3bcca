"""Paddle's common learning-rate schedules, at hand-worked points of Paddle's formulas."""
import math

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi import nn, optimizer
from fleetmpi.optimizer import lr


def rates(schedule, steps):
    found = []
    for _ in range(steps):
        found.append(schedule())
        schedule.step()
    return found


def test_multi_step_exponential_and_lambda_decay():
    assert rates(lr.MultiStepDecay(0.5, [2, 4], 0.1), 6) == pytest.approx(
        [0.5, 0.5, 0.05, 0.05, 0.005, 0.005])
    assert rates(lr.ExponentialDecay(0.5, 0.9), 4) == pytest.approx(
        [0.5, 0.45, 0.405, 0.3645])
    assert rates(lr.LambdaDecay(0.5, lambda epoch: 0.95 ** epoch), 3) == pytest.approx(
        [0.5, 0.475, 0.45125])


def test_polynomial_decay_stops_at_end_lr_or_cycles():
    # (1.0 - 0.1) * (1 - t/4) ** 2 + 0.1 for t = 0..4, then end_lr
    assert rates(lr.PolynomialDecay(1.0, 4, end_lr=0.1, power=2), 6) == pytest.approx(
        [1.0, 0.60625, 0.325, 0.15625, 0.1, 0.1])
    # cycle: at t = 5 the decay runs over 8 steps: 0.9 * (1 - 5/8) + 0.1
    cycled = rates(lr.PolynomialDecay(1.0, 4, end_lr=0.1, cycle=True), 6)
    assert cycled[4] == pytest.approx(0.1) and cycled[5] == pytest.approx(0.9 * 3 / 8 + 0.1)


def test_noam_decay_warms_up_then_decays_as_inverse_square_root():
    got = rates(lr.NoamDecay(d_model=64, warmup_steps=4, learning_rate=2.0), 9)
    scale = 2.0 / 8
    assert got[0] == 0.0
    assert got[1:5] == pytest.approx([scale * t / 8 for t in (1, 2, 3, 4)])  # t * 4 ** -1.5
    assert got[5:] == pytest.approx([scale / math.sqrt(t) for t in (5, 6, 7, 8)])


@pytest.mark.parametrize("anneal", ["cos", "linear"])
def test_one_cycle_rises_to_the_peak_then_falls_to_the_end(anneal):
    schedule = lr.OneCycleLR(1.0, total_steps=21, divide_factor=10, end_learning_rate=0.001,
                             phase_pct=0.5, anneal_strategy=anneal)
    got = rates(schedule, 21)
    assert got[0] == pytest.approx(0.1) and got[-1] == pytest.approx(0.001)
    peak = 0.5 * 21 - 1  # 9.5: the rise ends between steps 9 and 10
    assert all(a < b for a, b in zip(got[:10], got[1:10]))
    assert all(a > b for a, b in zip(got[10:], got[11:]))
    fraction = 3 / peak
    want = (0.1 + 0.9 * fraction if anneal == "linear"
            else 1.0 + (0.1 - 1.0) * (math.cos(math.pi * fraction) + 1) / 2)
    assert got[3] == pytest.approx(want)
    with pytest.raises(ValueError, match="stepped 21 times, past its total_steps=21"):
        schedule()


def test_one_cycle_in_three_phases_comes_back_to_the_start_first():
    got = rates(lr.OneCycleLR(1.0, total_steps=22, divide_factor=4, end_learning_rate=0.0,
                              phase_pct=0.25, three_phase=True), 22)
    up = 0.25 * 22 - 1  # 4.5
    assert got[0] == pytest.approx(0.25) and got[-1] == pytest.approx(0.0)
    assert max(got) == got[4] or max(got) == got[5]
    assert got[9] == pytest.approx(0.25 + (1.0 - 0.25) * (math.cos(math.pi * (9 - up) / up)
                                                          + 1) / 2)


def test_reduce_on_plateau_lowers_after_patience_and_cools_down():
    schedule = lr.ReduceOnPlateau(1.0, factor=0.5, patience=2, cooldown=1, min_lr=0.2)
    seen = []
    for loss in [5, 4] + [4] * 12:
        schedule.step(loss)
        seen.append(schedule())
    # best 4 at call 2; calls 3, 4, 5 do not improve: more than patience at call 5 -> 0.5;
    # call 6 is the cooldown; calls 7, 8, 9 -> 0.25; cooldown; 11, 12, 13 -> 0.2, the min_lr
    assert seen == [1.0] * 4 + [0.5] * 4 + [0.25] * 4 + [0.2] * 2
    state = schedule.state_dict()
    again = lr.ReduceOnPlateau(1.0, factor=0.5, patience=2, cooldown=1, min_lr=0.2)
    again.set_state_dict(state)
    assert again() == 0.2 and again.best == 4 and again.num_bad_epochs == state["num_bad_epochs"]
    maximising = lr.ReduceOnPlateau(1.0, mode="max", patience=0, threshold=0.1,
                                    threshold_mode="abs")
    for accuracy in (0.5, 0.55, fleet.to_tensor(np.array([0.7]))):
        maximising.step(accuracy)
    assert maximising() == pytest.approx(0.1)  # 0.55 is not 0.1 above 0.5; 0.7 is


def test_a_schedule_drives_an_optimizer():
    layer = nn.Linear(2, 1)
    schedule = lr.MultiStepDecay(0.5, [1], 0.1)
    opt = optimizer.SGD(learning_rate=schedule, parameters=layer.parameters())
    assert opt.get_lr() == 0.5
    schedule.step()
    assert opt.get_lr() == pytest.approx(0.05)


@pytest.mark.parametrize("make, message", [
    (lambda: lr.MultiStepDecay(0.1, [3, 2]), "milestones must be increasing positive integers"),
    (lambda: lr.ExponentialDecay(0.1, 0), "gamma must be positive, not 0"),
    (lambda: lr.LambdaDecay(0.1, 3), "lr_lambda must be callable, not int"),
    (lambda: lr.PolynomialDecay(0.1, 0), "decay_steps must be a positive integer, not 0"),
    (lambda: lr.NoamDecay(0, 10), "d_model must be positive, not 0"),
    (lambda: lr.OneCycleLR(0.1, 10, phase_pct=1.5), r"phase_pct must lie in \(0, 1\), not 1.5"),
    (lambda: lr.OneCycleLR(0.1, 10, anneal_strategy="exp"), "anneal_strategy='exp' is not"),
    (lambda: lr.ReduceOnPlateau(0.1, mode="best"), "mode='best' is not allowed"),
    (lambda: lr.ReduceOnPlateau(0.1, factor=1.0), "factor must be below 1, not 1.0"),
    (lambda: lr.ReduceOnPlateau(0.1).step("low"), "takes the metric as a number"),
])
def test_bad_arguments_are_refused_by_name(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def test_piecewise_natural_exp_inverse_time_and_multiplicative_decay():
    assert rates(lr.PiecewiseDecay([2, 4], [1.0, 0.5, 0.1]), 6) == pytest.approx(
        [1.0, 1.0, 0.5, 0.5, 0.1, 0.1])
    assert rates(lr.NaturalExpDecay(0.5, 0.1), 3) == pytest.approx(
        [0.5 * math.exp(-0.1 * t) for t in range(3)])
    assert rates(lr.InverseTimeDecay(0.5, 0.5), 3) == pytest.approx([0.5, 0.5 / 1.5, 0.25])
    # each step multiplies by the factor of its epoch: 0.5, 0.5 * 0.9, 0.5 * 0.9 * 0.8
    assert rates(lr.MultiplicativeDecay(0.5, lambda e: 1 - e / 10), 3) == pytest.approx(
        [0.5, 0.45, 0.36])
    with pytest.raises(ValueError, match="one more value than boundaries, got 2 boundaries "
                                         "and 2 values"):
        lr.PiecewiseDecay([2, 4], [1.0, 0.5])


def test_cyclic_lr_modes_at_hand_worked_points():
    # up over 2 steps, down over 4: 0.1, 0.3, 0.5, 0.4, 0.3, 0.2, then again from 0.1
    assert rates(lr.CyclicLR(0.1, 0.5, 2, 4), 8) == pytest.approx(
        [0.1, 0.3, 0.5, 0.4, 0.3, 0.2, 0.1, 0.3])
    # triangular2 halves the height of the second cycle
    assert rates(lr.CyclicLR(0.1, 0.5, 2, mode="triangular2"), 7)[4:] == pytest.approx(
        [0.1, 0.2, 0.3])
    exp_range = rates(lr.CyclicLR(0.1, 0.5, 2, mode="exp_range", exp_gamma=0.5), 3)
    assert exp_range == pytest.approx([0.1, 0.1 + 0.4 * 0.5 * 0.5, 0.1 + 0.4 * 0.25])
    custom = lr.CyclicLR(0.0, 1.0, 1, scale_fn=lambda step: 1 / (step + 1),
                         scale_mode="iterations")
    assert rates(custom, 2) == pytest.approx([0.0, 0.5])
    with pytest.raises(ValueError, match="mode='zigzag' is not allowed"):
        lr.CyclicLR(0.1, 0.5, 2, mode="zigzag")

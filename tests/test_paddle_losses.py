"""Paddle's losses L1Loss, SmoothL1Loss, BCEWithLogitsLoss and NLLLoss against NumPy forms of
Paddle 2.5's formulas, and their gradients against finite differences."""
import numpy as np
import pytest

import fleetmpi as paddle
import fleetmpi.nn.functional as F
from fleetmpi import nn
from fleetmpi.nn.gradcheck import check_gradients

RNG = np.random.default_rng(0)
X = RNG.standard_normal((4, 3)) * 2
Y = RNG.standard_normal((4, 3))
PROBS = RNG.uniform(0, 1, (4, 3))


def reduce(loss, reduction):
    return {"mean": loss.mean(), "sum": loss.sum(), "none": loss}[reduction]


def huber(x, y, delta):
    d = np.abs(x - y)
    return np.where(d < delta, 0.5 * d * d, delta * d - 0.5 * delta * delta)


def bce(x, y, weight=None, pos_weight=None):
    loss = np.maximum(x, 0) - x * y + np.log1p(np.exp(-np.abs(x)))
    if pos_weight is not None:
        loss = loss * (1 + (pos_weight - 1) * y)
    return loss if weight is None else loss * weight


def nll(logp, labels, weight, ignore_index, reduction):
    w = np.ones(logp.shape[1]) if weight is None else weight
    kept = labels != ignore_index
    taken = np.where(kept, w[np.where(kept, labels, 0)], 0.0)
    loss = -logp[np.arange(len(labels)), np.where(kept, labels, 0)] * taken
    if reduction == "mean":
        return loss.sum() / taken.sum()
    return loss.sum() if reduction == "sum" else loss


def value(tensor):
    return tensor.numpy()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_l1_and_smooth_l1_equal_paddles_formulas(reduction):
    np.testing.assert_allclose(value(nn.L1Loss(reduction)(paddle.to_tensor(X), Y)),
                               reduce(np.abs(X - Y), reduction), rtol=1e-12)
    for delta in (1.0, 0.5):
        got = nn.SmoothL1Loss(reduction, delta=delta)(paddle.to_tensor(X), Y)
        np.testing.assert_allclose(value(got), reduce(huber(X, Y, delta), reduction),
                                   rtol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_bce_with_logits_equals_paddles_formula(reduction):
    weight, pos_weight = RNG.uniform(0.5, 2, (3,)), np.array([1.0, 2.0, 3.0])
    for kwargs in ({}, {"weight": weight}, {"pos_weight": pos_weight},
                   {"weight": weight, "pos_weight": pos_weight}):
        got = nn.BCEWithLogitsLoss(reduction=reduction, **kwargs)(paddle.to_tensor(X), PROBS)
        np.testing.assert_allclose(value(got), reduce(bce(X, PROBS, **kwargs), reduction),
                                   rtol=1e-12)
    big = np.array([[800.0, -800.0]])  # the stable form: no overflow far out
    np.testing.assert_allclose(value(F.binary_cross_entropy_with_logits(
        paddle.to_tensor(big), np.array([[0.0, 1.0]]), reduction="none")), [[800.0, 800.0]])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_nll_equals_the_weighted_pick_with_ignored_labels(reduction):
    logp = np.log(np.exp(X) / np.exp(X).sum(1, keepdims=True))
    labels = np.array([0, 2, -100, 1])
    weight = np.array([0.5, 1.0, 2.0])
    for w in (None, weight):
        got = nn.NLLLoss(weight=None if w is None else paddle.to_tensor(w),
                         reduction=reduction)(paddle.to_tensor(logp), labels)
        np.testing.assert_allclose(value(got), nll(logp, labels, w, -100, reduction),
                                   rtol=1e-12)


def test_nll_over_positions_equals_nll_of_the_rows():
    logp = RNG.standard_normal((2, 3, 4))          # (N, C, d1)
    labels = RNG.integers(0, 3, (2, 4))
    rows = logp.transpose(0, 2, 1).reshape(-1, 3)
    np.testing.assert_allclose(value(F.nll_loss(paddle.to_tensor(logp), labels)),
                               nll(rows, labels.reshape(-1), None, -100, "mean"), rtol=1e-12)
    assert F.nll_loss(paddle.to_tensor(logp), labels, reduction="none").shape == [2, 4]


def test_gradients_match_finite_differences():
    labels = np.array([0, 2, 1, 1])
    weight = np.array([0.5, 1.0, 2.0])
    cases = {
        "l1": lambda x: F.l1_loss(x, Y + 0.01),
        "smooth_l1": lambda x: F.smooth_l1_loss(x, Y, delta=0.7),
        "bce": lambda x: F.binary_cross_entropy_with_logits(
            x, PROBS, weight=weight, pos_weight=np.array([1.0, 2.0, 3.0])),
        "nll": lambda x: F.nll_loss(x, labels, weight=weight, reduction="sum"),
    }
    for name, loss in cases.items():
        errors = check_gradients(loss, X)
        assert errors["input0"] < 1e-6, (name, errors)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"input and label of one shape, got \(4, 3\) and "
                                         r"\(3,\)"):
        F.l1_loss(paddle.to_tensor(X), np.zeros(3))
    with pytest.raises(ValueError, match="delta must be a positive number, not -1"):
        nn.SmoothL1Loss(delta=-1)(paddle.to_tensor(X), Y)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\) or equal "
                                         r"ignore_index=-100, got 5"):
        F.nll_loss(paddle.to_tensor(X), np.array([0, 1, 5, 2]))
    with pytest.raises(ValueError, match=r"weight must have one value per class, shape "
                                         r"\(3,\), not \(2,\)"):
        F.nll_loss(paddle.to_tensor(X), np.array([0, 1, 2, 2]), weight=np.ones(2))
    with pytest.raises(ValueError, match="reduction 'avg' is not allowed"):
        nn.BCEWithLogitsLoss(reduction="avg")

"""``fleetmpi.metric`` against scikit-learn on the same predictions, alone and summed over the
ranks."""
import numpy as np
import pytest
from sklearn import metrics as sk

import fleetmpi as fleet
from fleetmpi.metric import Accuracy, Auc, Precision, Recall

from comm_support import ok


def _scores(rows, classes, seed):
    rng = np.random.default_rng(seed)
    return rng.random((rows, classes)), rng.integers(0, classes, rows)


@pytest.mark.parametrize("topk", [(1,), (1, 3), (2, 5)])
def test_accuracy_is_top_k_accuracy_over_all_updates(topk):
    metric = Accuracy(topk=topk)
    batches = [_scores(rows, 6, seed) for seed, rows in enumerate((7, 1, 12))]
    for scores, labels in batches:
        batch_acc = metric.update(metric.compute(fleet.to_tensor(scores), labels[:, None]))
        want = [sk.top_k_accuracy_score(labels, scores, k=k, labels=range(6)) for k in topk]
        assert batch_acc == (want[0] if len(topk) == 1 else pytest.approx(want))
    scores = np.concatenate([s for s, _ in batches])
    labels = np.concatenate([y for _, y in batches])
    want = [sk.top_k_accuracy_score(labels, scores, k=k, labels=range(6)) for k in topk]
    assert metric.accumulate() == (pytest.approx(want[0]) if len(topk) == 1
                                   else pytest.approx(want))
    assert metric.name() == (["acc"] if len(topk) == 1 else [f"acc_top{k}" for k in topk])
    metric.reset()
    assert metric.accumulate() == (0.0 if len(topk) == 1 else [0.0] * len(topk))


def test_accuracy_takes_one_hot_labels():
    scores, labels = _scores(9, 4, 3)
    metric = Accuracy()
    metric.update(metric.compute(scores, np.eye(4)[labels]))
    assert metric.accumulate() == pytest.approx(sk.accuracy_score(labels, scores.argmax(1)))


def test_precision_and_recall_are_scikit_learns():
    rng = np.random.default_rng(4)
    probabilities, labels = rng.random(50), rng.integers(0, 2, 50)
    probabilities[:3] = 0.5  # the boundary counts as positive
    precision, recall = Precision(), Recall()
    for part in np.array_split(np.arange(50), 3):
        precision.update(probabilities[part, None], labels[part, None])
        recall.update(probabilities[part], labels[part])
    decided = (probabilities >= 0.5).astype(int)
    assert precision.accumulate() == pytest.approx(sk.precision_score(labels, decided))
    assert recall.accumulate() == pytest.approx(sk.recall_score(labels, decided))
    assert (precision.name(), recall.name()) == ("precision", "recall")
    precision.reset()
    assert precision.accumulate() == 0.0


@pytest.mark.parametrize("num_thresholds", [1024, 256])  # edges exact in binary
def test_auc_is_scikit_learns_for_predictions_on_the_bin_edges(num_thresholds):
    rng = np.random.default_rng(5)
    positive = rng.integers(0, num_thresholds + 1, 300) / num_thresholds  # ties included
    labels = (rng.random(300) < positive * 0.8 + 0.1).astype(int)
    metric = Auc(num_thresholds=num_thresholds)
    for part in np.array_split(np.arange(300), 4):
        metric.update(np.stack([1 - positive[part], positive[part]], axis=1), labels[part])
    assert metric.accumulate() == pytest.approx(sk.roc_auc_score(labels, positive), abs=1e-12)


def test_auc_within_a_bin_width_of_scikit_learns_elsewhere():
    rng = np.random.default_rng(6)
    positive = rng.random(500)
    labels = (rng.random(500) < positive).astype(int)
    metric = Auc(num_thresholds=4095)
    metric.update(positive, labels)
    assert abs(metric.accumulate() - sk.roc_auc_score(labels, positive)) < 1e-3


@pytest.mark.parametrize("make, message", [
    (lambda: Accuracy(topk=(0,)), "topk must be positive integers"),
    (lambda: Auc(curve="PR"), "curve='PR' is not supported; allowed: 'ROC'"),
    (lambda: Auc(num_thresholds=0), "num_thresholds must be an integer >= 1, not 0"),
    (lambda: Accuracy(topk=5).compute(np.ones((2, 3)), [0, 1]), "top-5 accuracy needs at least 5"),
    (lambda: Auc().update(np.array([1.5]), [1]), r"probabilities in \[0, 1\]"),
    (lambda: Precision().update(np.ones(3), [1, 0]), "2 labels for 3 predictions"),
])
def test_bad_input_is_refused_by_name(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.mpi(min_size=2)
def test_distributed_accumulate_is_the_metric_of_every_ranks_predictions():
    from mpi4py import MPI

    fleet.init(is_collective=True)
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    scores, labels = _scores(40 * size, 5, 8)  # the same global data on every rank
    mine = slice(rank * 40 + rank, (rank + 1) * 40)  # uneven shares: rank r skips r rows
    kept = np.concatenate([np.arange(r * 40 + r, (r + 1) * 40) for r in range(size)])
    accuracy, auc = Accuracy(topk=(1, 2)), Auc(num_thresholds=128)
    accuracy.update(accuracy.compute(scores[mine], labels[mine]))
    binary = (labels == 0).astype(int)
    edges = np.round(scores[:, 0] * 128) / 128
    auc.update(edges[mine], binary[mine])
    local = accuracy.accumulate()
    want = [sk.top_k_accuracy_score(labels[kept], scores[kept], k=k, labels=range(5))
            for k in (1, 2)]
    got = accuracy.accumulate(distributed=True)
    ok(np.allclose(got, want), f"rank {rank}: {got} != {want}")
    ok(accuracy.accumulate() == local, "the local value is unchanged by the distributed one")
    got_auc = auc.accumulate(distributed=True)
    want_auc = sk.roc_auc_score(binary[kept], edges[kept])
    ok(abs(got_auc - want_auc) < 1e-12, f"rank {rank}: auc {got_auc} != {want_auc}")


def test_accuracy_function_and_compute_return_tensors():
    scores = np.array([[0.1, 0.7, 0.2], [0.5, 0.3, 0.2], [0.2, 0.3, 0.5], [0.6, 0.3, 0.1]])
    labels = np.array([[1], [1], [2], [2]])
    top1 = fleet.metric.accuracy(fleet.to_tensor(scores), fleet.to_tensor(labels))
    assert isinstance(top1, fleet.Tensor) and top1.shape == [1]
    assert top1.numpy()[0] == pytest.approx(0.5)
    correct, total = fleet.to_tensor(np.zeros(1, np.int64)), fleet.to_tensor(np.zeros(1, np.int64))
    top2 = fleet.metric.accuracy(fleet.to_tensor(scores), labels, k=2, correct=correct,
                                 total=total)
    assert top2.numpy()[0] == pytest.approx(0.75) and (correct.item(), total.item()) == (3, 4)
    metric = Accuracy(topk=(1, 2))
    hits = metric.compute(fleet.to_tensor(scores), labels)
    assert isinstance(hits, fleet.Tensor) and hits.shape == [4, 2]
    assert metric.update(hits.numpy()) == pytest.approx([0.5, 0.75])


def test_accuracy_takes_predictions_of_any_leading_shape():
    """Scores over the last axis of (N, ..., C), labels of the leading shape or one-hot."""
    scores = np.array([[[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]])  # (1, 3, 2)
    m = Accuracy()
    correct = m.compute(scores, np.array([[[1], [1], [1]]]))
    assert correct.shape == [1, 3, 1] and m.update(correct) == pytest.approx(2 / 3)
    one_hot = np.eye(2)[[[1, 0, 1]]]
    assert m.compute(scores, one_hot).numpy().ravel().tolist() == [1.0, 1.0, 1.0]

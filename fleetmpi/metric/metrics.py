"""Paddle's metrics (``paddle.metric``): ``Accuracy`` (top-k), ``Precision``, ``Recall`` and
``Auc``, each with ``update`` / ``accumulate`` / ``reset`` / ``name``.

Each keeps its state as counts, so the metric of the whole job is the metric of the summed
counts: ``accumulate(distributed=True)``, called on every worker, sums them over the workers
(``fleet.util.all_reduce``) first; without it the value is this rank's, as Paddle's is.
"""
import numpy as np

from ..autograd.tensor import Tensor, to_tensor
from ..fleet_util import util


def _host(value, what):
    if isinstance(value, Tensor):
        return value.numpy()
    if hasattr(value, "get") and not isinstance(value, (np.ndarray, dict)):
        return value.get()  # a CuPy array
    try:
        return np.asarray(value)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a Tensor or an array, not {type(value).__name__}") \
            from None


def _labels(label, lead):
    """Integer class labels, one per prediction of the leading shape ``lead``, from labels of
    that shape (with or without a trailing axis of 1) or one-hot labels (``lead + (C,)``)."""
    label = _host(label, "label")
    if label.ndim == len(lead) + 1 and label.shape[-1] > 1:
        label = label.argmax(axis=-1)
    if label.size != int(np.prod(lead)):
        raise ValueError(f"{label.size} labels for {int(np.prod(lead))} predictions")
    return label.reshape(lead).astype(np.int64)


def _hits(scores, label, k):
    """``scores.shape[:-1] + (k,)`` float32: whether each prediction's label is its 1st,
    2nd... highest score."""
    top = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
    return (top == _labels(label, scores.shape[:-1])[..., None]).astype(np.float32)


def accuracy(input, label, k=1, correct=None, total=None, name=None):  # noqa: A002
    """Paddle's ``paddle.metric.accuracy``: the share of the rows of ``input`` (scores ``(N,
    C)``) whose ``label`` (``(N,)`` or ``(N, 1)``) is among their top ``k``, a float32 Tensor of
    shape ``[1]``; ``correct`` and ``total``, where given, are Tensors set to the counts."""
    scores = _host(input, "input")
    if scores.ndim != 2 or scores.shape[1] < k:
        raise ValueError(f"accuracy needs input (N, C) with C >= k={k}, got shape "
                         f"{scores.shape}")
    hits = int(_hits(scores, label, k).sum())
    rows = scores.shape[0]
    for tensor, value in ((correct, hits), (total, rows)):
        if tensor is not None:
            tensor.set_value(np.full(tuple(tensor.shape), value, tensor.dtype))
    return to_tensor(np.array([hits / rows if rows else 0.0], np.float32))


class Metric:
    """The base of the metrics: a subclass keeps its counts in the NumPy arrays ``_counts``
    returns, fills them in ``update`` and turns them into its value in ``_value``."""

    def __init__(self, name):
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str or None, not {type(name).__name__}")
        self._name = name
        self.reset()

    def reset(self):
        raise NotImplementedError

    def update(self, *args):
        raise NotImplementedError

    def _counts(self):
        raise NotImplementedError

    def _value(self, counts):
        raise NotImplementedError

    def compute(self, *args):
        """What ``update`` takes, from the model's output and the labels (Paddle's hook for
        work done on the device); the inputs as they are by default."""
        return args

    def name(self):
        return self._name

    def accumulate(self, distributed=False):
        """The metric over every ``update`` since the last ``reset``: this rank's, or with
        ``distributed`` (a collective: every worker calls it) the whole job's."""
        counts = self._counts()
        if distributed:
            counts = [util.all_reduce(c, mode="sum") for c in counts]
        return self._value(counts)


class Accuracy(Metric):
    """The share of samples whose label is among the top ``k`` predictions, for each ``k`` of
    ``topk``. ``compute(pred, label)`` gives the hits that ``update`` takes, a float32 Tensor of
    the predictions' leading shape and ``max k`` (``pred`` holds scores over its last axis, as
    Paddle's); ``accumulate`` returns one float for one ``k``, a list otherwise."""

    def __init__(self, topk=(1,), name=None, *args, **kwargs):
        topk = (topk,) if isinstance(topk, int) else tuple(topk)
        if not topk or any(not isinstance(k, int) or isinstance(k, bool) or k < 1
                           for k in topk):
            raise ValueError(f"topk must be positive integers, not {topk!r}")
        self.topk, self.maxk = topk, max(topk)
        name = name or "acc"
        super().__init__(name)
        self._names = [name] if len(topk) == 1 else [f"{name}_top{k}" for k in topk]

    def reset(self):
        self.total = np.zeros(len(self.topk), np.float64)
        self.count = np.zeros(len(self.topk), np.float64)

    def compute(self, pred, label, *args):
        scores = _host(pred, "pred")
        if scores.ndim < 2:
            raise ValueError(f"pred must be (N, ..., classes), got shape {scores.shape}")
        if scores.shape[-1] < self.maxk:
            raise ValueError(f"top-{self.maxk} accuracy needs at least {self.maxk} classes, "
                             f"pred has {scores.shape[-1]}")
        return to_tensor(_hits(scores, label, self.maxk))

    def update(self, correct, *args):
        correct = _host(correct, "correct")
        rows = int(np.prod(correct.shape[:-1]))
        hits = [float(correct[..., :k].sum()) for k in self.topk]
        self.total += hits
        self.count += rows
        accs = [h / rows if rows else 0.0 for h in hits]
        return accs[0] if len(self.topk) == 1 else accs

    def _counts(self):
        return [self.total, self.count]

    def _value(self, counts):
        total, count = counts
        accs = [float(t / c) if c else 0.0 for t, c in zip(total, count)]
        return accs[0] if len(self.topk) == 1 else accs

    def name(self):
        return self._names


class _Binary(Metric):
    """Counts of a binary classifier's decisions: a prediction (a probability of the positive
    class, ``(N,)`` or ``(N, 1)``) is positive from 0.5 up, as Paddle rounds it."""

    def reset(self):
        self.tp = np.zeros(1, np.int64)
        self.fp = np.zeros(1, np.int64)
        self.fn = np.zeros(1, np.int64)

    def update(self, preds, labels):
        preds = _host(preds, "preds").reshape(-1)
        decided = np.floor(preds + 0.5).astype(np.int64)
        labels = _labels(labels, decided.shape[:1])
        self.tp += int(((decided == 1) & (labels == 1)).sum())
        self.fp += int(((decided == 1) & (labels != 1)).sum())
        self.fn += int(((decided != 1) & (labels == 1)).sum())

    def _counts(self):
        return [self.tp, self.fp, self.fn]


class Precision(_Binary):
    """True positives over predicted positives (0.0 when nothing was predicted positive)."""

    def __init__(self, name="precision", *args, **kwargs):
        super().__init__(name)

    def _value(self, counts):
        tp, fp, _ = (int(c[0]) for c in counts)
        return tp / (tp + fp) if tp + fp else 0.0


class Recall(_Binary):
    """True positives over actual positives (0.0 when there were none)."""

    def __init__(self, name="recall", *args, **kwargs):
        super().__init__(name)

    def _value(self, counts):
        tp, _, fn = (int(c[0]) for c in counts)
        return tp / (tp + fn) if tp + fn else 0.0


class Auc(Metric):
    """The area under the ROC curve, from the positive-class probabilities (column 1 of
    ``(N, 2)`` predictions, or ``(N,)`` / ``(N, 1)`` probabilities) binned into
    ``num_thresholds + 1`` bins, as Paddle computes it: exact for predictions on the bins'
    edges, within a bin's width otherwise."""

    def __init__(self, curve="ROC", num_thresholds=4095, name="auc", *args, **kwargs):
        if curve != "ROC":
            raise ValueError(f"curve={curve!r} is not supported; allowed: 'ROC'")
        if not isinstance(num_thresholds, int) or isinstance(num_thresholds, bool) or \
                num_thresholds < 1:
            raise ValueError(f"num_thresholds must be an integer >= 1, not {num_thresholds!r}")
        self.num_thresholds = num_thresholds
        super().__init__(name)

    def reset(self):
        self.positives = np.zeros(self.num_thresholds + 1, np.int64)
        self.negatives = np.zeros(self.num_thresholds + 1, np.int64)

    def update(self, preds, labels):
        preds = _host(preds, "preds")
        scores = preds[:, 1] if preds.ndim == 2 and preds.shape[1] == 2 else preds.reshape(-1)
        if np.any((scores < 0) | (scores > 1)):
            raise ValueError("Auc takes probabilities in [0, 1]")
        labels = _labels(labels, scores.shape[:1])
        bins = (scores * self.num_thresholds).astype(np.int64)
        self.positives += np.bincount(bins[labels == 1], minlength=self.num_thresholds + 1)
        self.negatives += np.bincount(bins[labels != 1], minlength=self.num_thresholds + 1)

    def _counts(self):
        return [self.positives, self.negatives]

    def _value(self, counts):
        positives, negatives = (c[::-1].astype(np.float64) for c in counts)
        true_positive = np.concatenate([[0.0], np.cumsum(positives)])
        false_positive = np.concatenate([[0.0], np.cumsum(negatives)])
        if true_positive[-1] == 0 or false_positive[-1] == 0:
            return 0.0
        area = np.sum(np.diff(false_positive) * (true_positive[1:] + true_positive[:-1]) / 2)
        return float(area / true_positive[-1] / false_positive[-1])

"""Losses: softmax cross entropy, negative log likelihood and mean squared error."""
import numpy as np

from ...core import backend
from ... import kernels
from ...autograd import Function, Tensor
from ...autograd.autocast import autocast, input_dtype


def _labels_2d(logits, labels):
    """The labels as a vector of class indices, one per row of the 2-d logits: Paddle's
    ``(N, 1)`` and PyTorch's ``(N,)`` both accepted. Their range is checked where they are
    host arrays; labels on a device are not read back, which would make the host wait for
    the device at every step (and cannot be captured in a CUDA graph): there the kernels
    give a label outside the classes a NaN loss and NaN gradients
    (``softmax_cross_entropy.cu``), which a step's non-finite check reports."""
    n = logits.shape[0]
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels.reshape(-1)
    if labels.ndim != 1 or labels.shape[0] != n:
        raise ValueError(f"cross_entropy expects labels of shape ({n},) or ({n}, 1) for logits "
                         f"of shape {tuple(logits.shape)}, got {tuple(labels.shape)}")
    if labels.dtype.kind not in "iu":
        raise ValueError(f"cross_entropy expects integer class labels, got dtype "
                         f"{labels.dtype}")
    classes = logits.shape[1]
    if isinstance(labels, np.ndarray) and labels.size and (
            int(labels.min()) < 0 or int(labels.max()) >= classes):
        raise ValueError(f"labels must lie in [0, {classes}), got values in "
                         f"[{int(labels.min())}, {int(labels.max())}]")
    return labels


class SoftmaxCrossEntropy(Function):
    """``mean_i(-log softmax(logits_i)[label_i])`` over the rows of 2-d ``logits``, computed in
    at least float32 (``fleetmpi.kernels.softmax_cross_entropy_forward``; one fused kernel per
    direction on a GPU). The loss comes in ``loss_dtype`` (by default the logits'), the logits'
    gradient in their dtype."""

    op_type = "softmax_with_cross_entropy"

    def forward(self, logits, labels, reduction, loss_dtype=None):
        xp = backend.array_module()
        if logits.ndim != 2:
            raise ValueError(f"cross_entropy expects 2-d logits (rows, classes), got shape "
                             f"{tuple(logits.shape)}")
        _check_not_empty("cross_entropy", logits, reduction)
        self.labels = xp.asarray(_labels_2d(logits, labels))
        picked, self.log_probs, self.row_max, self.row_logsum = \
            kernels.softmax_cross_entropy_forward(logits, self.labels)
        # the device kernel keeps no log-probabilities; backward forms them from the logits
        self.logits = logits if self.log_probs is None else None
        self.reduction, self.dtype = reduction, logits.dtype
        if reduction != "none":
            picked = picked.sum() if reduction == "sum" else picked.mean()
        return picked.astype(loss_dtype or logits.dtype, copy=False)

    def backward(self, dloss):
        if self.reduction == "none":
            scale = dloss[:, None]
        else:
            scale = dloss if self.reduction == "sum" else dloss / self.labels.shape[0]
        grad = kernels.softmax_cross_entropy_backward(self.logits, self.labels, self.log_probs,
                                                      self.row_max, self.row_logsum, scale,
                                                      self.dtype)
        return grad, None, None


def _softmax_cross_entropy(logits, labels, reduction):
    """``SoftmaxCrossEntropy`` of 2-d logits. Where amp computes this operator in float32 (its
    default black list) and the logits are float16, they go in as they are, with the policy
    set aside for the call: the operator computes in float32 whatever it is given, with the
    same results as on a float32 cast of the logits (float16 converts to float32 exactly), so
    the cast would only add a float32 copy of the logits."""
    wanted = input_dtype(SoftmaxCrossEntropy.op_type, logits.dtype)
    if logits.dtype == np.float16 and wanted == np.float32:
        with autocast(None):
            return SoftmaxCrossEntropy.apply(logits, labels, reduction, loss_dtype=wanted)
    return SoftmaxCrossEntropy.apply(logits, labels, reduction)


REDUCTIONS = ("mean", "sum", "none")


def _check_not_empty(name, values, reduction):
    """A mean over no samples has no value: an empty batch is an error naming its shape."""
    if reduction == "mean" and values.size == 0:
        raise ValueError(f"{name} with reduction='mean' got an empty batch (input shape "
                         f"{tuple(values.shape)}); a mean over no samples is undefined. Give "
                         "every step at least one sample (data.DistributedSampler pads each "
                         "rank's share), or use reduction='sum'")


def _check_reduction(reduction):
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction {reduction!r} is not allowed; use one of {REDUCTIONS}")


def cross_entropy(input, label, reduction="mean"):  # noqa: A002 - Paddle's argument name
    """Softmax cross entropy of integer class labels. ``input``: logits ``(N, C)``, or
    ``(..., C)`` with labels of shape ``(...)`` or ``(..., 1)``."""
    _check_reduction(reduction)
    if input.ndim <= 2:
        return _softmax_cross_entropy(input, label, reduction)
    if not isinstance(input, Tensor):
        input = Tensor(backend.asarray(input))
    label_array = label.data if isinstance(label, Tensor) else label
    if label_array.ndim == input.ndim:
        label_array = label_array.reshape(label_array.shape[:-1])
    lead = input.shape[:-1]
    loss = _softmax_cross_entropy(input.reshape(-1, input.shape[-1]), label_array.reshape(-1),
                                  reduction)
    return loss.reshape(lead) if reduction == "none" else loss


def mse_loss(input, label, reduction="mean"):  # noqa: A002 - Paddle's argument name
    """``(input - label) ** 2``, averaged (or summed, or kept) over every element."""
    _check_reduction(reduction)
    if not isinstance(input, Tensor):
        input = Tensor(backend.asarray(input))
    _check_not_empty("mse_loss", input, reduction)
    squared = (input - label) ** 2
    if reduction == "none":
        return squared
    return squared.sum() if reduction == "sum" else squared.mean()


class NegativeLogLikelihood(Function):
    """``-input[i, label_i]`` (log-probabilities ``(N, C)``) times ``weight[label_i]``; a
    label equal to ``ignore_index`` gives 0. ``reduction="mean"`` divides the sum by the
    weights of the labels taken (Paddle's weighted mean)."""

    op_type = "nll_loss"

    def forward(self, logp, labels, weight, ignore_index, reduction):
        xp = backend.array_module()
        kept = labels != ignore_index
        safe = xp.where(kept, labels, 0)
        rows = xp.arange(logp.shape[0])
        taken = (weight[safe] if weight is not None else xp.ones(labels.shape, logp.dtype))
        taken = xp.where(kept, taken, 0).astype(logp.dtype)
        self.shape, self.rows, self.safe, self.reduction = logp.shape, rows, safe, reduction
        loss = -logp[rows, safe] * taken
        if reduction == "sum":
            loss = loss.sum()
        elif reduction == "mean":
            self.total = taken.sum()
            loss = loss.sum() / self.total
        self.taken = taken
        return loss.astype(logp.dtype, copy=False)

    def backward(self, dloss):
        xp = backend.array_module()
        scale = dloss / self.total if self.reduction == "mean" else dloss
        grad = xp.zeros(self.shape, dtype=self.taken.dtype)
        grad[self.rows, self.safe] = -self.taken * scale
        return grad, None, None, None, None


def nll_loss(input, label, weight=None, ignore_index=-100, reduction="mean",  # noqa: A002
             name=None):
    """Paddle's ``nll_loss``: ``input`` holds log-probabilities ``(N, C)`` or ``(N, C, d1,
    ...)``, ``label`` class indices ``(N,)`` or ``(N, d1, ...)``; ``weight`` one per class;
    labels equal to ``ignore_index`` count for nothing."""
    _check_reduction(reduction)
    if not isinstance(input, Tensor):
        input = Tensor(backend.asarray(input))
    labels = backend.asarray(label.data if isinstance(label, Tensor) else label)
    if input.ndim < 2 or tuple(labels.shape) != (input.shape[0], *input.shape[2:]):
        raise ValueError(f"nll_loss needs input (N, C, ...) and label (N, ...), got shapes "
                         f"{tuple(input.shape)} and {tuple(labels.shape)}")
    if labels.dtype.kind not in "iu":
        raise ValueError(f"nll_loss expects integer class labels, got dtype {labels.dtype}")
    classes = input.shape[1]
    if isinstance(labels, np.ndarray):
        wrong = labels[(labels != ignore_index) & ((labels < 0) | (labels >= classes))]
        if wrong.size:
            raise ValueError(f"nll_loss labels must lie in [0, {classes}) or equal "
                             f"ignore_index={ignore_index}, got {int(wrong[0])}")
    if weight is not None:
        weight = backend.asarray(weight.data if isinstance(weight, Tensor) else weight)
        if tuple(weight.shape) != (classes,):
            raise ValueError(f"nll_loss weight must have one value per class, shape "
                             f"({classes},), not {tuple(weight.shape)}")
    _check_not_empty("nll_loss", labels, reduction)
    if input.ndim > 2:  # classes last, then one row per position
        order = [0, *range(2, input.ndim), 1]
        input = input.transpose(order).reshape(-1, classes)
    loss = NegativeLogLikelihood.apply(input, labels.reshape(-1), weight, ignore_index,
                                       reduction)
    return loss.reshape(list(labels.shape)) if reduction == "none" else loss

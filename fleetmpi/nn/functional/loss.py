"""Losses: softmax cross entropy and mean squared error."""
from ... import backend
from ...autograd import Function, Tensor


def _labels_2d(logits, labels):
    """The labels as a vector of class indices, one per row of the 2-d logits: Paddle's
    ``(N, 1)`` and PyTorch's ``(N,)`` both accepted."""
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
    if labels.size and (int(labels.min()) < 0 or int(labels.max()) >= classes):
        raise ValueError(f"labels must lie in [0, {classes}), got values in "
                         f"[{int(labels.min())}, {int(labels.max())}]")
    return labels


class SoftmaxCrossEntropy(Function):
    """``mean_i(-log softmax(logits_i)[label_i])`` over the rows of 2-d ``logits``."""

    op_type = "softmax_with_cross_entropy"

    def forward(self, logits, labels, reduction):
        xp = backend.array_module()
        if logits.ndim != 2:
            raise ValueError(f"cross_entropy expects 2-d logits (rows, classes), got shape "
                             f"{tuple(logits.shape)}")
        _check_not_empty("cross_entropy", logits, reduction)
        labels = xp.asarray(_labels_2d(logits, labels))
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_probs = shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
        self.rows = xp.arange(logits.shape[0])
        self.labels, self.log_probs, self.reduction = labels, log_probs, reduction
        picked = -log_probs[self.rows, labels]
        if reduction == "none":
            return picked
        return picked.sum() if reduction == "sum" else picked.mean()

    def backward(self, dloss):
        xp = backend.array_module()
        grad = xp.exp(self.log_probs)
        grad[self.rows, self.labels] -= 1
        if self.reduction == "none":
            grad *= dloss[:, None]
        else:
            scale = dloss if self.reduction == "sum" else dloss / self.log_probs.shape[0]
            grad *= scale
        return grad, None, None


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
        return SoftmaxCrossEntropy.apply(input, label, reduction)
    if not isinstance(input, Tensor):
        input = Tensor(backend.asarray(input))
    label_array = label.data if isinstance(label, Tensor) else label
    if label_array.ndim == input.ndim:
        label_array = label_array.reshape(label_array.shape[:-1])
    lead = input.shape[:-1]
    loss = SoftmaxCrossEntropy.apply(input.reshape(-1, input.shape[-1]),
                                     label_array.reshape(-1), reduction)
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

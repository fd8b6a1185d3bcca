"""Losses of each element against its label, then reduced: ``l1_loss``, ``smooth_l1_loss``
(Paddle's Huber form) and ``binary_cross_entropy_with_logits``, with Paddle 2.5's formulas and
defaults. Each elementwise loss is one ``Function``; the reduction is the Tensor's own
``sum``/``mean``."""
from ...core import backend
from ...autograd import Function, Tensor, as_array
from ...autograd.operations import abs as _abs
from .loss import _check_not_empty, _check_reduction


def _reduced(loss, reduction):
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.mean()


def _as_tensor(value):
    return value if isinstance(value, Tensor) else Tensor(backend.asarray(value))


def _check_same_shape(name, input, label):  # noqa: A002 - Paddle's argument name
    if tuple(input.shape) != tuple(label.shape):
        raise ValueError(f"{name} needs input and label of one shape, got "
                         f"{tuple(input.shape)} and {tuple(label.shape)}")


class Huber(Function):
    """``0.5 * d ** 2`` where ``|d| < delta``, else ``delta * |d| - 0.5 * delta ** 2``, for
    ``d = input - label``."""

    op_type = "huber_loss"

    def forward(self, x, y, delta):
        xp = backend.array_module()
        d = x - y
        self.small = xp.abs(d) < delta
        self.slope = xp.where(self.small, d, delta * xp.sign(d))
        return xp.where(self.small, 0.5 * d * d, delta * xp.abs(d) - 0.5 * delta * delta)

    def backward(self, dy):
        dx = dy * self.slope
        return dx, (-dx if self.needs_input_grad[1] else None), None


class SigmoidCrossEntropyWithLogits(Function):
    """``max(x, 0) - x * y + log(1 + exp(-|x|))`` (the stable form of ``-y log sigmoid(x) -
    (1 - y) log(1 - sigmoid(x))``) times ``scale``, an array or None (Paddle's
    ``(1 + (pos_weight - 1) * y) * weight``). The label takes no gradient."""

    op_type = "sigmoid_cross_entropy_with_logits"

    def forward(self, x, y, scale):
        xp = backend.array_module()
        self.x, self.y, self.scale = x, y, scale
        loss = xp.maximum(x, 0) - x * y + xp.log1p(xp.exp(-xp.abs(x)))
        return (loss if scale is None else loss * scale).astype(x.dtype, copy=False)

    def backward(self, dloss):
        xp = backend.array_module()
        grad = (xp.tanh(self.x * 0.5) + 1) * 0.5 - self.y
        if self.scale is not None:
            grad = grad * self.scale
        return (dloss * grad).astype(self.x.dtype, copy=False), None, None


def l1_loss(input, label, reduction="mean", name=None):  # noqa: A002 - Paddle's name
    """``|input - label|``, averaged (or summed, or kept) over every element."""
    _check_reduction(reduction)
    input = _as_tensor(input)
    _check_same_shape("l1_loss", input, label)
    _check_not_empty("l1_loss", input, reduction)
    return _reduced(_abs(input - label), reduction)


def smooth_l1_loss(input, label, reduction="mean", delta=1.0, name=None):  # noqa: A002
    """Paddle's ``smooth_l1_loss``, the Huber loss: ``0.5 * d ** 2`` where ``|d| < delta``,
    ``delta * |d| - 0.5 * delta ** 2`` elsewhere, ``d = input - label``."""
    _check_reduction(reduction)
    if not isinstance(delta, (int, float)) or isinstance(delta, bool) or not delta > 0:
        raise ValueError(f"smooth_l1_loss delta must be a positive number, not {delta!r}")
    input = _as_tensor(input)
    _check_same_shape("smooth_l1_loss", input, label)
    _check_not_empty("smooth_l1_loss", input, reduction)
    return _reduced(Huber.apply(input, label, float(delta)), reduction)


def binary_cross_entropy_with_logits(logit, label, weight=None, reduction="mean",
                                     pos_weight=None, name=None):
    """Sigmoid cross entropy of ``logit`` against ``label`` (probabilities in [0, 1], of the
    logit's shape), as Paddle 2.5 computes it: the loss of each element multiplied by ``1 +
    (pos_weight - 1) * label`` where ``pos_weight`` (one per class, the last axis) is given,
    and by ``weight`` (broadcast to the logit's shape) where it is given."""
    _check_reduction(reduction)
    logit = _as_tensor(logit)
    _check_same_shape("binary_cross_entropy_with_logits", logit, label)
    _check_not_empty("binary_cross_entropy_with_logits", logit, reduction)
    label_array = backend.asarray(as_array(label)).astype(logit.dtype, copy=False)
    scale = None
    if pos_weight is not None:
        scale = 1 + (backend.asarray(as_array(pos_weight)) - 1) * label_array
    if weight is not None:
        weight = backend.asarray(as_array(weight))
        scale = weight if scale is None else scale * weight
    if scale is not None:
        scale = backend.array_module().broadcast_to(scale, tuple(logit.shape))
    loss = SigmoidCrossEntropyWithLogits.apply(logit, label_array, scale)
    return _reduced(loss, reduction)

"""Loss layers: ``CrossEntropyLoss`` (softmax cross entropy of integer labels) and ``MSELoss``."""
from . import functional as F
from .functional.loss import _check_reduction
from .layer import Layer


class CrossEntropyLoss(Layer):
    """``mean_i(-log softmax(logits_i)[label_i])``; labels of shape ``(N,)`` or Paddle's
    ``(N, 1)``. Returns a one-element Tensor (``reduction="mean"``)."""

    def __init__(self, reduction="mean"):
        super().__init__()
        _check_reduction(reduction)
        self.reduction = reduction

    def forward(self, input, label):  # noqa: A002 - Paddle's argument name
        return F.cross_entropy(input, label, self.reduction)


class MSELoss(Layer):
    def __init__(self, reduction="mean"):
        super().__init__()
        _check_reduction(reduction)
        self.reduction = reduction

    def forward(self, input, label):  # noqa: A002 - Paddle's argument name
        return F.mse_loss(input, label, self.reduction)

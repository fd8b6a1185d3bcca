"""Loss layers, each the ``fleetmpi.nn.functional`` loss of its name with the arguments kept
from construction: ``CrossEntropyLoss`` (softmax cross entropy of integer labels),
``NLLLoss``, ``MSELoss``, ``L1Loss``, ``SmoothL1Loss`` and ``BCEWithLogitsLoss``, with Paddle's
arguments and defaults."""
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


class L1Loss(Layer):
    def __init__(self, reduction="mean", name=None):
        super().__init__()
        _check_reduction(reduction)
        self.reduction = reduction

    def forward(self, input, label):  # noqa: A002 - Paddle's argument name
        return F.l1_loss(input, label, self.reduction)


class SmoothL1Loss(Layer):
    def __init__(self, reduction="mean", delta=1.0, name=None):
        super().__init__()
        _check_reduction(reduction)
        self.reduction, self.delta = reduction, delta

    def forward(self, input, label):  # noqa: A002 - Paddle's argument name
        return F.smooth_l1_loss(input, label, self.reduction, self.delta)


class BCEWithLogitsLoss(Layer):
    def __init__(self, weight=None, reduction="mean", pos_weight=None, name=None):
        super().__init__()
        _check_reduction(reduction)
        self.weight, self.reduction, self.pos_weight = weight, reduction, pos_weight

    def forward(self, logit, label):
        return F.binary_cross_entropy_with_logits(logit, label, self.weight, self.reduction,
                                                  self.pos_weight)


class NLLLoss(Layer):
    def __init__(self, weight=None, ignore_index=-100, reduction="mean", name=None):
        super().__init__()
        _check_reduction(reduction)
        self.weight, self.ignore_index, self.reduction = weight, ignore_index, reduction

    def forward(self, input, label):  # noqa: A002 - Paddle's argument name
        return F.nll_loss(input, label, self.weight, self.ignore_index, self.reduction)

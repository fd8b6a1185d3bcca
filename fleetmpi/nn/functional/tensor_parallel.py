"""The collectives of Megatron-LM's tensor parallelism as differentiable operations, and the
cross entropy over logits whose vocabulary is split across the ranks of a model-parallel group.

Each operation pairs a forward with the backward that makes the gradient right (Shoeybi et al.
2019, section 3):

==============================  ==========================  ==========================
operation                       forward                     backward
==============================  ==========================  ==========================
``copy_to_model_parallel``      identity                    allreduce (sum)
``reduce_from_model_parallel``  allreduce (sum)             identity
``gather_from_model_parallel``  allgather, last axis        this rank's part
``scatter_to_model_parallel``   this rank's part            allgather, last axis
==============================  ==========================  ==========================

``group`` is the model-parallel ``Communicator``; None (a group of one rank) makes every
operation the identity, so a tensor-parallel model of one rank is the serial model.
"""
from ...core import backend
from ...autograd import Function, Tensor
from .loss import _check_not_empty, _check_reduction


def _size(group):
    return 1 if group is None else group.size


def _rank(group):
    return 0 if group is None else group.rank


def _gather_last_axis(group, x):
    xp = backend.array_module()
    parts = group.allgather(xp.ascontiguousarray(x), stack=True)
    return xp.concatenate(list(parts), axis=-1)


def _part_of_last_axis(group, x):
    width = x.shape[-1]
    if width % group.size:
        raise ValueError(f"the last axis of shape {tuple(x.shape)} does not split into "
                         f"{group.size} equal parts over the model-parallel group")
    part = width // group.size
    return backend.array_module().ascontiguousarray(
        x[..., group.rank * part:(group.rank + 1) * part])


class CopyToModelParallel(Function):
    """Forward: identity; backward: the gradient summed over the group (every rank's part of
    the model used the same input)."""

    def forward(self, x, group):
        self.group = group
        return x.view()

    def backward(self, dy):
        return self.group.allreduce(dy), None


class ReduceFromModelParallel(Function):
    """Forward: the partial results of the group summed; backward: identity."""

    def forward(self, x, group):
        return group.allreduce(x)

    def backward(self, dy):
        return dy, None


class GatherFromModelParallel(Function):
    """Forward: the ranks' parts joined along the last axis; backward: this rank's part."""

    def forward(self, x, group):
        self.group = group
        return _gather_last_axis(group, x)

    def backward(self, dy):
        return _part_of_last_axis(self.group, dy), None


class ScatterToModelParallel(Function):
    """Forward: this rank's part of the last axis; backward: the parts' gradients joined."""

    def forward(self, x, group):
        self.group = group
        return _part_of_last_axis(group, x)

    def backward(self, dy):
        return _gather_last_axis(self.group, dy), None


def _apply_over_group(op, x, group):
    if _size(group) == 1:
        return x
    return op.apply(x if isinstance(x, Tensor) else Tensor(backend.asarray(x)), group)


def copy_to_model_parallel(x, group):
    return _apply_over_group(CopyToModelParallel, x, group)


def reduce_from_model_parallel(x, group):
    return _apply_over_group(ReduceFromModelParallel, x, group)


def gather_from_model_parallel(x, group):
    return _apply_over_group(GatherFromModelParallel, x, group)


def scatter_to_model_parallel(x, group):
    return _apply_over_group(ScatterToModelParallel, x, group)


class ParallelSoftmaxCrossEntropy(Function):
    """Softmax cross entropy of 2-d logits ``(N, V / size)``, this rank holding classes
    ``[rank * V / size, (rank + 1) * V / size)`` of ``V``, labels global class ids. Three
    numbers per row cross the group (the row maximum, then the sum of exponentials and the
    label's logit in one allreduce), never the logits; each rank keeps the softmax of its own
    classes for backward, which needs no communication."""

    # The serial loss's operator name: amp casts (and keeps from casting) both alike.
    op_type = "softmax_with_cross_entropy"

    def forward(self, logits, labels, group, reduction):
        xp = backend.array_module()
        rows, width = logits.shape
        size, rank = _size(group), _rank(group)
        labels = xp.asarray(labels).reshape(-1)
        if labels.shape[0] != rows or labels.dtype.kind not in "iu":
            raise ValueError(f"parallel_cross_entropy expects {rows} integer labels for logits "
                             f"of shape {tuple(logits.shape)}, got {labels.dtype} "
                             f"{tuple(labels.shape)}")
        vocab = width * size
        if labels.size and (int(labels.min()) < 0 or int(labels.max()) >= vocab):
            raise ValueError(f"labels must lie in [0, {vocab}) (the vocabulary of {size} "
                             f"rank(s) x {width}), got values in [{int(labels.min())}, "
                             f"{int(labels.max())}]")
        row_max = logits.max(axis=1)
        if size > 1:
            row_max = group.allreduce(row_max, op="max")
        shifted = logits - row_max[:, None]
        exp = xp.exp(shifted)
        start = rank * width
        mine = (labels >= start) & (labels < start + width)
        local = xp.where(mine, labels - start, 0)
        self.rows = xp.arange(rows)
        sums = xp.stack([exp.sum(axis=1), xp.where(mine, shifted[self.rows, local], 0.0)])
        if size > 1:
            sums = group.allreduce(xp.ascontiguousarray(sums))
        picked = xp.log(sums[0]) - sums[1]
        self.softmax = exp / sums[0][:, None]
        self.mine, self.local, self.reduction = mine, local, reduction
        if reduction == "none":
            return picked
        return picked.sum() if reduction == "sum" else picked.mean()

    def backward(self, dloss):
        grad = self.softmax
        grad[self.rows[self.mine], self.local[self.mine]] -= 1
        if self.reduction == "none":
            grad *= dloss[:, None]
        else:
            grad *= dloss if self.reduction == "sum" else dloss / grad.shape[0]
        return grad, None, None, None


def parallel_cross_entropy(input, label, group, reduction="mean"):  # noqa: A002
    """Softmax cross entropy of logits ``(..., V / size)`` split over the vocabulary across
    ``group`` (a ``ColumnParallelLinear`` without ``gather_output``, or a tensor-parallel
    GPT's output), labels ``(...)`` or ``(..., 1)`` of global class ids: the loss of the whole
    logits, on every rank of the group, without gathering them."""
    _check_reduction(reduction)
    if not isinstance(input, Tensor):
        input = Tensor(backend.asarray(input))
    _check_not_empty("parallel_cross_entropy", input, reduction)
    labels = label.data if isinstance(label, Tensor) else backend.asarray(label)
    if labels.ndim == input.ndim:
        labels = labels.reshape(labels.shape[:-1])
    lead = input.shape[:-1]
    loss = ParallelSoftmaxCrossEntropy.apply(input.reshape(-1, input.shape[-1]),
                                             labels.reshape(-1), group, reduction)
    return loss.reshape(lead) if reduction == "none" else loss

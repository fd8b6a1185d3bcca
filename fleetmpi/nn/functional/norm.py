"""Batch normalization over axis 1 (statistics over this process's batch or, through a
communicator, over the global batch of all ranks: ``sync_batch_norm``) and layer
normalization over the trailing axes."""
import numpy as np

from ...core import backend
from ... import kernels
from ...autograd import Function
from ...kernels import reference
from . import cudnn, cudnn_ops


def sum_over_ranks(communicator, *vectors):
    """The ``vectors`` concatenated in float64 and, with a communicator, summed over its ranks
    in one allreduce (float64 also carries counts above 2**24 exactly)."""
    xp = backend.array_module()
    packed = xp.concatenate([xp.asarray(v, dtype=xp.float64).reshape(-1) for v in vectors])
    if communicator is not None:
        communicator.allreduce(packed, op="sum", out=packed)
    return packed


def channel_dot(a, b):
    """``(a * b).sum`` over every axis but 1: on the host one ``einsum``, without the product's
    full-size temporary; on a GPU the product and a reduction, since CuPy's ``einsum`` runs
    this contraction as a cuBLAS product, which a CUDA graph capture refuses
    (``fleetmpi/kernels/cublaslt.py``)."""
    shape = (a.shape[0], a.shape[1], int(np.prod(a.shape[2:], dtype=np.int64)))
    a, b = a.reshape(shape), b.reshape(shape)
    if backend.on_gpu():
        return (a * b).sum(axis=(0, 2))
    return np.einsum("nci,nci->c", a, b)


def batch_statistics(x, axes, communicator):
    """``(mean, biased variance, count)`` of each channel over the batch, of every rank of
    ``communicator`` when there is one, in two exact passes: the counts and sums give the
    mean, then the sums of squared deviations from that mean give the variance. This is
    NumPy's ``mean``/``var`` arithmetic (the same bits alone; the global batch's values to
    rounding across ranks), without the cancellation of a one-pass ``E[x^2] - E[x]^2``.
    Reading the global count back to the host costs one device synchronisation; without a
    communicator the count is this process's, known on the host, and nothing is read (a
    wait for the device per batch norm of a step, which a CUDA graph could not capture)."""
    xp = backend.array_module()
    accumulate = np.result_type(x.dtype, np.float32)
    channels = x.shape[1]
    local_count = x.size // channels if channels else 0
    packed = sum_over_ranks(communicator, xp.full(1, local_count, xp.float64),
                            x.sum(axis=axes, dtype=accumulate))
    count = local_count if communicator is None else int(packed[0])
    if count == 0:
        where = "on every rank" if communicator is not None else "here"
        raise ValueError(f"BatchNorm in training needs at least one value per channel; the "
                         f"batch is empty {where} (input shape {tuple(x.shape)})")
    mean = (packed[1:] / count).astype(accumulate)
    deviation = x - reference.per_channel(mean, x.ndim)
    squares = (deviation * deviation).sum(axis=axes, dtype=accumulate)
    var = (sum_over_ranks(communicator, squares) / count).astype(accumulate)
    return mean.astype(x.dtype), var.astype(x.dtype), count


class BatchNorm(Function):
    """``weight * (x - mean) / sqrt(var + epsilon) + bias`` over axis 1, with batch statistics
    while ``training`` (which also move the running ones: ``running = momentum * running +
    (1 - momentum) * batch``, Paddle's convention) and the running statistics otherwise. With
    ``act="relu"`` the normalization and ReLU run as one fused kernel (``fuse_bn_act_ops``)."""

    op_type = "batch_norm"

    def forward(self, x, weight, bias, running_mean=None, running_var=None, training=True,
                momentum=0.9, epsilon=1e-5, communicator=None, act=None):
        xp = backend.array_module()
        self.axes = (0,) + tuple(range(2, x.ndim))
        self.training = training
        self.communicator = communicator if training else None
        if training:
            mean, var, self.count = batch_statistics(x, self.axes, self.communicator)
            for running, batch in ((running_mean, mean), (running_var, var)):
                if running is not None:
                    reference.move_running(running, batch, momentum)
        else:
            mean, var = running_mean, running_var
            self.count = x.size // x.shape[1]
        self.invstd = 1.0 / xp.sqrt(var + epsilon)
        self.weight, self.act = weight, act
        if act is not None:
            if act != "relu":
                raise ValueError(f"fuse_bn_act_ops fuses batch norm with relu only, not {act!r}")
            self.y, self.xhat = kernels.bn_act_forward(x, mean, self.invstd, weight, bias)
            # the device kernel keeps no normalized input; backward forms it from x then
            self.x, self.mean = (x, mean) if self.xhat is None else (None, None)
            return self.y
        self.xhat, y = reference.bn_normalize(x, mean, self.invstd, weight, bias)
        return y

    def backward(self, dz):
        """Parameter gradients from this rank's rows; with global statistics the input gradient
        needs the per-channel sums of ``dz`` and ``dz * xhat`` over the global batch.

        Why the plain allreduce-sum of the local sums and the global count are right: each
        rank's loss ``L_r`` is the mean over its own rows and the gradient reduction averages
        over the N ranks, so with equal shares the global loss is ``L = sum_r L_r / N``. By
        induction from the loss backwards, the ``dz`` each rank holds for its rows is the
        gradient of ``sum_r L_r`` (``N`` times that of ``L``): a row's output enters only its
        own rank's loss, and a synchronised batch norm maps the gradient of ``sum_r L_r`` with
        respect to its output to the one with respect to its input exactly when the sums in
        ``bn_input_grad`` run over every rank's rows and ``count`` is the global count. The
        parameter gradients are then the local shares of the gradient of ``sum_r L_r``, which
        the gradient reduction's mean turns into the gradient of ``L``: the single-process
        gradients on the global batch."""
        if self.act is not None:
            if self.xhat is None:
                self.xhat = reference.bn_xhat(self.x, self.mean, self.invstd)
            dz = kernels.bn_act_backward_mask(dz, self.y)
        xhat = self.xhat
        sum_dz = dz.sum(axis=self.axes)
        sum_dz_xhat = channel_dot(dz, xhat)
        dx = None
        if self.needs_input_grad[0]:
            if not self.training:
                dx = dz * reference.per_channel(self.weight * self.invstd, dz.ndim)
            else:
                local_dz, local_dz_xhat = sum_dz, sum_dz_xhat
                if self.communicator is not None:
                    channels = sum_dz.shape[0]
                    total = sum_over_ranks(self.communicator, sum_dz, sum_dz_xhat)
                    local_dz = total[:channels].astype(dz.dtype)
                    local_dz_xhat = total[channels:].astype(dz.dtype)
                dx = kernels.bn_input_grad(dz, xhat, self.invstd, self.weight, local_dz,
                                           local_dz_xhat, self.count)
        return dx, sum_dz_xhat, sum_dz


def batch_norm(x, running_mean, running_var, weight, bias, training=False, momentum=0.9,
               epsilon=1e-5, communicator=None, act=None):
    """Batch normalization over axis 1 (Paddle's ``F.batch_norm``); ``communicator`` makes the
    training statistics those of every rank's batch together. The running statistics are
    updated in place, so they must be arrays of the backend (a layer's buffers are). Through
    cuDNN where it has an engine for the shape (``cudnn_ops.py``), except with a communicator
    in training."""
    array = backend.array_module().ndarray
    for name, running in (("running_mean", running_mean), ("running_var", running_var)):
        if running is not None and not isinstance(running, array):
            raise TypeError(f"batch_norm {name} must be a {array.__module__}.ndarray updated in "
                            f"place, not {type(running).__name__}; create it with "
                            "backend.asarray")
    statistics = communicator is None if training else (running_mean is not None
                                                         and running_var is not None)
    affine = weight is not None and bias is not None
    dtype = (cudnn.operation_dtype(BatchNorm.op_type, x, weight, bias) if statistics and affine
             else None)
    plans = None if dtype is None else cudnn_ops.batch_norm_plans(x.shape, dtype, training)
    if plans is not None:
        return cudnn_ops.CudnnBatchNorm.apply(x, weight, bias, plans, running_mean=running_mean,
                                              running_var=running_var, training=training,
                                              momentum=momentum, epsilon=epsilon, act=act)
    return BatchNorm.apply(x, weight, bias, running_mean=running_mean, running_var=running_var,
                           training=training, momentum=momentum, epsilon=epsilon,
                           communicator=communicator, act=act)


class LayerNorm(Function):
    """``weight * (x - mean) / sqrt(var + epsilon) + bias`` over the trailing axes of
    ``x`` that ``weight`` covers (statistics per row, in at least float32), one fused kernel
    per direction on a GPU (``fleetmpi.kernels.layer_norm_forward``)."""

    op_type = "layer_norm"

    def forward(self, x, weight, bias, epsilon):
        y, mean, self.rstd, self.xhat = kernels.layer_norm_forward(x, weight, bias, epsilon)
        # the device kernel keeps no normalized input; backward forms it from x then
        self.x, self.mean = (x, mean) if self.xhat is None else (None, None)
        self.weight = weight
        return y

    def backward(self, dy):
        return kernels.layer_norm_backward(dy, self.x, self.mean, self.rstd, self.xhat,
                                           self.weight) + (None,)


def layer_norm(x, normalized_shape, weight=None, bias=None, epsilon=1e-5):
    """Layer normalization over the trailing ``normalized_shape`` axes (Paddle's signature);
    ``weight`` and ``bias`` are required here."""
    if weight is None or bias is None:
        raise ValueError("layer_norm needs weight and bias (use nn.LayerNorm to create them)")
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if tuple(x.shape[-len(shape):]) != shape:
        raise ValueError(f"layer_norm over {shape} got an input of shape {tuple(x.shape)}")
    return LayerNorm.apply(x, weight, bias, epsilon)

"""Convolution and batch normalization as cuDNN graphs (``cudnn.py`` builds, caches and runs
them), with the arguments, results, running statistics, fused activations and gradients of
their counterparts in ``conv.py`` and ``norm.py``.

Every tensor is declared with the C-contiguous NCHW strides fleetmpi's arrays have; whether
cuDNN has an engine for a graph is its own answer (``cudnn.plan``), and where it has none for
any graph an operation needs, ``conv_plans`` / ``batch_norm_plans`` return None and the caller
runs its own path. Pooling stays on that path everywhere: the frontend's Python graph API has
no pooling operation.
"""
import numpy as np

from ...core import backend
from ... import kernels
from ...autograd import Function
from ...kernels import reference
from . import cudnn
from .cudnn import declare, mark_output as output

_NO_DILATION = [1, 1]
_STATISTICS = np.float32  # batch norm's scale, bias and statistics, as cuDNN takes them


def conv_plans(x_shape, weight_shape, dtype, stride, padding, out_shape):
    """The forward, input-gradient and weight-gradient plans of a convolution in ``dtype`` of
    an input of ``x_shape`` by weights of ``weight_shape`` (the caller has checked the output's
    spatial size ``out_shape``), or None where cuDNN declines any of the three."""
    y_shape = (x_shape[0], weight_shape[0]) + tuple(out_shape)
    geometry = dict(padding=list(padding), stride=list(stride), dilation=_NO_DILATION)
    compute = cudnn.data_type(np.float32)

    def describe(op, operands, result):
        """The graph of convolution ``op``: ``operands`` ``(name, shape, port)``, ``result``
        ``(name, shape)``."""
        def build(graph):
            tensors = {name: declare(graph, name, shape, dtype) for name, shape, _ in operands}
            ports = {port: tensors[name] for name, _, port in operands}
            out = getattr(graph, op)(compute_data_type=compute, name=op, **ports, **geometry)
            tensors[result[0]] = output(out, result[1], dtype)
            return tensors
        return build

    x, w, y = ("x", x_shape), ("w", weight_shape), ("y", y_shape)
    dy = ("dy", y_shape)
    graphs = (("forward", describe("conv_fprop", [x + ("image",), w + ("weight",)], y)),
              ("input gradient", describe("conv_dgrad", [dy + ("loss",), w + ("filter",)],
                                          ("dx", x_shape))),
              ("weight gradient", describe("conv_wgrad", [x + ("image",), dy + ("loss",)],
                                           ("dw", weight_shape))))
    key = (tuple(x_shape), tuple(weight_shape), tuple(stride), tuple(padding))
    plans = tuple(cudnn.plan("conv2d " + part, dtype, key, build) for part, build in graphs)
    return None if None in plans else plans


class CudnnConv2D(Function):
    """``Conv2D`` through cuDNN's plans (``conv_plans``): the same arguments, the same fused
    bias and activation after the convolution (``fuse_elewise_add_act_ops``), the same
    gradients."""

    op_type = "conv2d"

    def forward(self, x, weight, bias, plans, act=None):
        xp = backend.array_module()
        x, weight = cudnn.contiguous(x), cudnn.contiguous(weight)
        fprop = plans[0]
        self.plans, self.act = plans, act
        needs = self.needs_input_grad
        self.x = x if needs[1] else None
        self.weight = weight if needs[0] else None
        self.x_shape, self.weight_shape, self.dtype = x.shape, weight.shape, x.dtype
        y = xp.empty(fprop.tensors["y"].get_dim(), dtype=x.dtype)
        cudnn.execute(fprop, {"x": x, "w": weight, "y": y})
        if act is not None:
            self.y, self.pre = kernels.bias_act_forward(y, bias, act)
            return self.y
        if bias is not None:
            y += reference.per_channel(bias, 4)
        return y

    def backward(self, dy):
        if self.act is not None:
            dy = kernels.bias_act_backward(dy, self.y, self.pre, self.act)
        xp = backend.array_module()
        dy = cudnn.contiguous(dy, dtype=self.dtype)
        _, dgrad, wgrad = self.plans
        needs = self.needs_input_grad
        dx = dweight = dbias = None
        if needs[1]:
            dweight = xp.empty(self.weight_shape, dtype=self.dtype)
            cudnn.execute(wgrad, {"x": self.x, "dy": dy, "dw": dweight})
        if needs[2]:
            dbias = dy.sum(axis=(0, 2, 3))
        if needs[0]:
            dx = xp.empty(self.x_shape, dtype=self.dtype)
            cudnn.execute(dgrad, {"dy": dy, "w": self.weight, "dx": dx})
        return dx, dweight, dbias, None, None


def _as_4d(x):
    """``x`` ``(N, C, ...)`` as the contiguous ``(N, C, rest, 1)`` cuDNN's batch norm takes:
    the same per-channel statistics over every axis but 1."""
    return cudnn.contiguous(x).reshape(x.shape[0], x.shape[1], -1, 1)


def _scalar(graph, name):
    """A float32 value passed by value from the host at each execution (``_host_scalar``)."""
    return graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1],
                        data_type=cudnn.data_type(_STATISTICS), is_pass_by_value=True)


def _host_scalar(value):
    return np.full((1, 1, 1, 1), value, dtype=_STATISTICS)


def batch_norm_plans(x_shape, dtype, training):
    """The plans batch norm in ``dtype`` over an input of ``x_shape`` needs (training: forward
    and backward; inference: forward, whose gradient is a per-channel affine map computed
    here), or None where cuDNN declines one."""
    shape = tuple(x_shape[:2]) + (int(np.prod(x_shape[2:], dtype=np.int64)), 1)
    channel = (1, shape[1], 1, 1)

    def statistics(graph, *names):
        return [declare(graph, name, channel, _STATISTICS) for name in names]

    def forward(graph):
        image = declare(graph, "x", shape, dtype)
        scale, bias = statistics(graph, "scale", "bias")
        epsilon = _scalar(graph, "epsilon")
        y, mean, inv_var, _, _ = graph.batchnorm(input=image, scale=scale, bias=bias,
                                                 in_running_mean=None, in_running_var=None,
                                                 epsilon=epsilon, momentum=None, name="bn")
        return {"x": image, "scale": scale, "bias": bias, "epsilon": epsilon,
                "y": output(y, shape, dtype), "mean": output(mean, channel, _STATISTICS),
                "inv_var": output(inv_var, channel, _STATISTICS)}

    def backward(graph):
        grad, image = declare(graph, "dy", shape, dtype), declare(graph, "x", shape, dtype)
        scale, mean, inv_var = statistics(graph, "scale", "mean", "inv_var")
        dx, dscale, dbias = graph.batchnorm_backward(grad=grad, input=image, scale=scale,
                                                     mean=mean, inv_variance=inv_var,
                                                     name="bn_backward")
        return {"dy": grad, "x": image, "scale": scale, "mean": mean, "inv_var": inv_var,
                "dx": output(dx, shape, dtype), "dscale": output(dscale, channel, _STATISTICS),
                "dbias": output(dbias, channel, _STATISTICS)}

    def inference(graph):
        image = declare(graph, "x", shape, dtype)
        mean, inv_var, scale, bias = statistics(graph, "mean", "inv_var", "scale", "bias")
        y = graph.batchnorm_inference(input=image, mean=mean, inv_variance=inv_var, scale=scale,
                                      bias=bias, name="bn_inference")
        return {"x": image, "mean": mean, "inv_var": inv_var, "scale": scale, "bias": bias,
                "y": output(y, shape, dtype)}

    parts = ((("batch norm", forward), ("batch norm gradient", backward)) if training
             else (("batch norm inference", inference),))
    plans = tuple(cudnn.plan(kind, dtype, shape, describe) for kind, describe in parts)
    return None if None in plans else plans


class CudnnBatchNorm(Function):
    """``BatchNorm`` through cuDNN's plans (``batch_norm_plans``), without a communicator
    (``sync_batch_norm``'s global statistics stay with ``BatchNorm``): the same arguments,
    running statistics, fused ReLU and gradients.

    The running statistics keep fleetmpi's convention, ``running = momentum * running + (1 -
    momentum) * batch`` with the biased batch variance. The graph computes no running
    statistics: they are moved here from the batch mean and inverse standard deviation cuDNN
    saves, the variance as ``1 / inv_var**2 - epsilon``."""

    op_type = "batch_norm"

    def forward(self, x, weight, bias, plans, running_mean=None, running_var=None,
                training=True, momentum=0.9, epsilon=1e-5, act=None):
        if act is not None and act != "relu":
            raise ValueError(f"fuse_bn_act_ops fuses batch norm with relu only, not {act!r}")
        xp = backend.array_module()
        self.x, self.act, self.plans, self.training = _as_4d(x), act, plans, training
        self.weight_dtype = weight.dtype
        self.scale = cudnn.contiguous(weight, dtype=_STATISTICS).reshape(1, -1, 1, 1)
        bias = cudnn.contiguous(bias, dtype=_STATISTICS).reshape(1, -1, 1, 1)
        y = xp.empty_like(self.x)
        if training:
            self.mean, self.inv_var = (xp.empty_like(self.scale) for _ in range(2))
            cudnn.execute(plans[0], {"x": self.x, "scale": self.scale, "bias": bias,
                                     "epsilon": _host_scalar(epsilon), "y": y,
                                     "mean": self.mean, "inv_var": self.inv_var})
            batch_var = 1 / (self.inv_var * self.inv_var) - _STATISTICS(epsilon)
            for running, batch in ((running_mean, self.mean), (running_var, batch_var)):
                if running is not None:
                    reference.move_running(running, batch.reshape(-1).astype(running.dtype),
                                           momentum)
        else:
            self.mean = running_mean.astype(_STATISTICS).reshape(1, -1, 1, 1)
            self.inv_var = (1 / xp.sqrt(running_var.astype(_STATISTICS) + _STATISTICS(epsilon))
                            ).reshape(1, -1, 1, 1)
            cudnn.execute(plans[0], {"x": self.x, "mean": self.mean, "inv_var": self.inv_var,
                                     "scale": self.scale, "bias": bias, "y": y})
        y = y.reshape(x.shape)
        if act is not None:
            self.y = xp.maximum(y, 0, out=y)
        return y

    def backward(self, dz):
        if self.act is not None:
            dz = kernels.bn_act_backward_mask(dz, self.y)
        shape = dz.shape
        dz = _as_4d(dz.astype(self.x.dtype, copy=False))
        if self.training:
            xp = backend.array_module()
            dx = xp.empty_like(self.x)
            dweight, dbias = (xp.empty_like(self.scale) for _ in range(2))
            cudnn.execute(self.plans[1], {"dy": dz, "x": self.x, "scale": self.scale,
                                          "mean": self.mean, "inv_var": self.inv_var,
                                          "dx": dx, "dscale": dweight, "dbias": dbias})
        else:  # the running statistics are constants: the gradient of a per-channel affine map
            axes = (0, 2, 3)
            dx = (dz * (self.scale * self.inv_var)).astype(self.x.dtype, copy=False)
            dweight = (dz * ((self.x - self.mean) * self.inv_var)).sum(axis=axes)
            dbias = dz.sum(axis=axes)
        dx = dx.reshape(shape) if self.needs_input_grad[0] else None
        dtype = self.weight_dtype
        return (dx, dweight.reshape(-1).astype(dtype, copy=False),
                dbias.reshape(-1).astype(dtype, copy=False), None)

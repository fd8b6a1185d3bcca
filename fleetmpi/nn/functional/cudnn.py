"""Convolution, pooling and batch normalization through cuDNN, on a GPU where it is usable.

cuDNN comes through CuPy 13's bindings (``cupyx.cudnn`` and ``cupy.cuda.cudnn``; CuPy 14 has
none), which are built against ``libcudnn.so.8``. CuPy 13 looks for that library on the default
search path only, not in the ``nvidia-cudnn-cu12`` wheel the ``gpu`` extra installs, so
``preload_library`` loads the wheel's copy first, globally, and CuPy's module then finds it
loaded. Whether cuDNN is usable is decided once, on the first operation on a GPU; when it is
not (no bindings, no library), one warning says why and the operations of ``conv.py`` and
``norm.py`` run instead (im2col and matrix products, CuPy elementwise kernels). On the CPU there
is no cuDNN and nothing is said.

What the strategy fields of the same names set (``configure``, called when a strategy is
applied; until then cuDNN's plain behaviour):

* ``cudnn_exhaustive_search``: each convolution times every algorithm cuDNN has for its shapes
  once (``cudnnFind*AlgorithmEx``, CuPy's ``auto_tune``) and keeps the fastest; off, cuDNN's
  heuristics pick one without running anything;
* ``conv_workspace_size_limit``: the most scratch memory (MB) an algorithm may use, CuPy's
  ``set_max_workspace_size``;
* ``cudnn_batchnorm_spatial_persistent``: batch norm in training runs in
  ``CUDNN_BATCHNORM_SPATIAL_PERSISTENT`` mode, often faster, with a narrower range: cuDNN warns
  that very large finite inputs may overflow to inf or NaN where the plain spatial mode stays
  finite. Inference always runs in spatial mode, the one cuDNN has for it.

The functions here compute what their counterparts in ``conv.py`` and ``norm.py`` compute, with
the same arguments, gradients and fused activations; ``tests/test_cudnn.py`` checks them
against the same references through a stand-in for the bindings.
"""
import ctypes
import dataclasses
import importlib
import importlib.metadata
import os
from typing import Optional

import numpy as np

from ... import backend, kernels
from ...autograd import Function
from ...kernels import reference
from ...log import logger

CUDNN_DISTRIBUTION = "nvidia-cudnn-cu12"
# Inside the distribution: the cuDNN 8 library CuPy 13's bindings are linked against.
CUDNN_LIBRARY = "nvidia/cudnn/lib/libcudnn.so.8"
ON_CPU = "this process computes on the CPU (NumPy), where there is no cuDNN"
# What runs where cuDNN does not.
WITHOUT_CUDNN = ("convolution, pooling and batch norm run without it, as im2col, matrix "
                 "products and elementwise array operations")
_DTYPES = frozenset({"float16", "float32", "float64"})
_NO_DILATION = (1, 1)
_ONE_GROUP = 1


@dataclasses.dataclass(frozen=True)
class Settings:
    """The cuDNN settings, under the names of the strategy fields that set them (module
    docstring). The defaults are cuDNN's plain behaviour, before any strategy is applied:
    heuristic algorithm choice, CuPy's own workspace limit (None), the spatial batch norm."""

    cudnn_exhaustive_search: bool = False
    conv_workspace_size_limit: Optional[int] = None
    cudnn_batchnorm_spatial_persistent: bool = False


_settings = Settings()
_bindings = None  # (cupyx.cudnn, cupy.cuda.cudnn) once loaded
_unusable = None  # why cuDNN cannot run on this GPU, once decided: the error met
_workspace_set = None  # the conv_workspace_size_limit last handed to CuPy


def configure(cudnn_exhaustive_search, conv_workspace_size_limit,
              cudnn_batchnorm_spatial_persistent):
    """Set what the next cuDNN operations use (the strategy fields of the same names;
    ``conv_workspace_size_limit`` in MB). Process-wide, as Paddle's flags: the strategy applied
    last wins."""
    global _settings
    for name, value in (("cudnn_exhaustive_search", cudnn_exhaustive_search),
                        ("cudnn_batchnorm_spatial_persistent",
                         cudnn_batchnorm_spatial_persistent)):
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{name} must be True or False, not {value!r}")
    limit = conv_workspace_size_limit
    if not isinstance(limit, (int, np.integer)) or isinstance(limit, bool) or limit < 0:
        raise ValueError(f"conv_workspace_size_limit must be an integer >= 0 (MB), not "
                         f"{limit!r}")
    _settings = Settings(bool(cudnn_exhaustive_search), int(limit),
                         bool(cudnn_batchnorm_spatial_persistent))


def settings():
    """The ``Settings`` the next cuDNN operations use."""
    return _settings


def preload_library():
    """Load ``libcudnn.so.8`` from the ``nvidia-cudnn-cu12`` distribution, globally, so that
    CuPy's cuDNN module finds it already loaded; the path loaded, or None where the
    distribution or its cuDNN 8 library is not installed (a cuDNN on the default search path
    serves then)."""
    try:
        distribution = importlib.metadata.distribution(CUDNN_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = str(distribution.locate_file(CUDNN_LIBRARY))
    if not os.path.isfile(path):
        return None
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return path


def _decide():
    """Load the bindings once; on failure keep and warn why."""
    global _bindings, _unusable
    try:
        path = preload_library()
        functions = importlib.import_module("cupyx.cudnn")
        constants = importlib.import_module("cupy.cuda.cudnn")
        version = constants.getVersion()
    except Exception as error:  # no bindings, no library, or one that fails: all "no cuDNN"
        _unusable = f"{type(error).__name__}: {error}"
        logger.warning("%s: %s; pip install 'fleetmpi[gpu]' installs CuPy 13 and cuDNN 8",
                       unusable_reason(), WITHOUT_CUDNN)
        return
    _bindings = (functions, constants)
    logger.info("cuDNN %s (%s) runs convolution, pooling and batch norm", version,
                path or "found on the library search path")


def unusable_reason():
    """None where cuDNN runs this process's convolutions, pooling and batch norm; else why it
    does not. The first call on a GPU decides, and warns when cuDNN is not usable."""
    if not backend.on_gpu():
        return ON_CPU
    if _bindings is None and _unusable is None:
        _decide()
    return None if _unusable is None else f"cuDNN is not usable on this GPU ({_unusable})"


def handles(*arrays):
    """Whether the cuDNN path runs an operation on ``arrays`` (None entries skipped): cuDNN is
    usable, and they are non-empty arrays of one dtype cuDNN computes in."""
    if unusable_reason() is not None:
        return False
    present = [a for a in arrays if a is not None]
    dtypes = {np.dtype(a.dtype) for a in present}
    return len(dtypes) == 1 and dtypes.pop().name in _DTYPES and all(a.size for a in present)


def batch_norm_takes(epsilon):
    """Whether cuDNN is loaded and its batch norm accepts ``epsilon`` (it refuses one below
    ``CUDNN_BN_MIN_EPSILON``; the other path computes with any)."""
    return _bindings is not None and epsilon >= _bindings[1].CUDNN_BN_MIN_EPSILON


def _functions():
    """``cupyx.cudnn``, with the workspace limit of the current settings handed to it."""
    global _workspace_set
    functions = _bindings[0]
    limit = _settings.conv_workspace_size_limit
    if limit is not None and limit != _workspace_set:
        functions.set_max_workspace_size(limit * 2**20)
        _workspace_set = limit
    return functions


def _constants():
    return _bindings[1]


def _contiguous(array, dtype=None):
    return backend.array_module().ascontiguousarray(array, dtype=dtype)


class CudnnConv2D(Function):
    """``Conv2D`` through cuDNN: the same arguments (plus the output's spatial size, which
    the caller has checked), the same fused bias and activation after the convolution
    (``fuse_elewise_add_act_ops``), the same gradients."""

    op_type = "conv2d"

    def forward(self, x, weight, bias, stride, padding, out_shape, act=None):
        xp = backend.array_module()
        x, weight = _contiguous(x), _contiguous(weight)
        needs = self.needs_input_grad
        self.x = x if needs[1] else None
        self.weight = weight if needs[0] else None
        self.x_shape, self.weight_shape, self.dtype = x.shape, weight.shape, x.dtype
        self.stride, self.padding, self.act = stride, padding, act
        y = xp.empty((x.shape[0], weight.shape[0]) + tuple(out_shape), dtype=x.dtype)
        _functions().convolution_forward(
            x, weight, None if act is not None else bias, y, padding, stride, _NO_DILATION,
            _ONE_GROUP, auto_tune=_settings.cudnn_exhaustive_search, tensor_core="auto")
        if act is not None:
            self.y, self.pre = kernels.bias_act_forward(y, bias, act)
            return self.y
        return y

    def backward(self, dy):
        if self.act is not None:
            dy = kernels.bias_act_backward(dy, self.y, self.pre, self.act)
        xp = backend.array_module()
        dy = _contiguous(dy, dtype=self.dtype)
        functions = _functions()
        tuning = dict(deterministic=False, auto_tune=_settings.cudnn_exhaustive_search,
                      tensor_core="auto")
        needs = self.needs_input_grad
        dx = dweight = dbias = None
        if needs[1]:
            dweight = xp.empty(self.weight_shape, dtype=dy.dtype)
            functions.convolution_backward_filter(self.x, dy, dweight, self.padding,
                                                  self.stride, _NO_DILATION, _ONE_GROUP,
                                                  **tuning)
        if needs[2]:
            dbias = dy.sum(axis=(0, 2, 3))
        if needs[0]:
            dx = xp.empty(self.x_shape, dtype=dy.dtype)
            functions.convolution_backward_data(self.weight, dy, None, dx, self.padding,
                                                self.stride, _NO_DILATION, _ONE_GROUP,
                                                **tuning)
        return dx, dweight, dbias, None, None, None, None


class _CudnnPool2D(Function):
    """Pooling through cuDNN in ``mode_name``'s mode: the arguments of ``conv.py``'s poolings
    plus the output's spatial size, which the caller has checked."""

    op_type = "pool2d"
    mode_name = None

    def forward(self, x, kernel, stride, padding, out_shape):
        xp = backend.array_module()
        self.mode = getattr(_constants(), self.mode_name)
        self.x = _contiguous(x)
        self.window = (kernel, stride, padding)
        self.y = xp.empty(x.shape[:2] + tuple(out_shape), dtype=x.dtype)
        _functions().pooling_forward(self.x, self.y, kernel, stride, padding, self.mode)
        return self.y

    def backward(self, dy):
        dx = _functions().pooling_backward(self.x, self.y, _contiguous(dy, dtype=self.y.dtype),
                                           *self.window, self.mode)
        return dx, None, None, None, None


class CudnnMaxPool2D(_CudnnPool2D):
    """``MaxPool2D`` through cuDNN: padding takes no part in the maximum. Where a window holds
    its maximum more than once, cuDNN decides which of them gets the gradient (``MaxPool2D``
    gives it to the first)."""

    mode_name = "CUDNN_POOLING_MAX"


class CudnnAvgPool2D(_CudnnPool2D):
    """``AvgPool2D`` through cuDNN: the mean over each window's real inputs, padding excluded
    (Paddle's ``exclusive=True``, as ``AvgPool2D``)."""

    mode_name = "CUDNN_POOLING_AVERAGE_COUNT_EXCLUDE_PADDING"


def _as_4d(x):
    """``x`` ``(N, C, ...)`` as the contiguous ``(N, C, rest, 1)`` cuDNN's spatial batch norm
    takes: the same per-channel statistics over every axis but 1."""
    return _contiguous(x).reshape(x.shape[0], x.shape[1], -1, 1)


class CudnnBatchNorm(Function):
    """``BatchNorm`` through cuDNN, without a communicator (``sync_batch_norm``'s global
    statistics stay with ``BatchNorm``): the same arguments, running statistics, fused ReLU
    and gradients.

    The running statistics keep fleetmpi's convention, ``running = momentum * running + (1 -
    momentum) * batch`` with the biased batch variance. cuDNN moves them itself with the
    unbiased variance, so it is handed scratch running statistics and a factor of 1 (CuPy's
    ``decay`` of 0), which leaves the batch mean and unbiased variance there; the variance is
    made biased again (times ``(m - 1) / m`` over ``m`` values per channel) and the real
    running statistics are moved from those."""

    op_type = "batch_norm"

    def forward(self, x, weight, bias, running_mean=None, running_var=None, training=True,
                momentum=0.9, epsilon=1e-5, act=None):
        if act is not None and act != "relu":
            raise ValueError(f"fuse_bn_act_ops fuses batch norm with relu only, not {act!r}")
        xp = backend.array_module()
        constants = _constants()
        self.x, self.weight, self.act = _as_4d(x), weight, act
        self.training, self.epsilon = training, epsilon
        if training:
            self.mode = (constants.CUDNN_BATCHNORM_SPATIAL_PERSISTENT
                         if _settings.cudnn_batchnorm_spatial_persistent
                         else constants.CUDNN_BATCHNORM_SPATIAL)
            statistics = np.float32 if x.dtype == np.float16 else x.dtype
            channels = x.shape[1]
            self.mean, self.invstd, batch_mean, batch_var = (
                xp.zeros(channels, dtype=statistics) for _ in range(4))
            y = _functions().batch_normalization_forward_training(
                self.x, weight, bias, batch_mean, batch_var, self.mean, self.invstd, epsilon,
                0.0, True, self.mode, False)
            count = x.size // channels
            if count > 1:
                batch_var *= (count - 1) / count
            else:  # one value: no unbiased variance, and a biased one of 0
                batch_var.fill(0)
            for running, batch in ((running_mean, batch_mean), (running_var, batch_var)):
                if running is not None:
                    reference.move_running(running, batch, momentum)
        else:
            self.mean = running_mean
            self.invstd = 1.0 / xp.sqrt(running_var + epsilon)
            y = _functions().batch_normalization_forward_inference(
                self.x, weight, bias, running_mean, running_var, epsilon, True,
                constants.CUDNN_BATCHNORM_SPATIAL)
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
            dx, dweight, dbias = _functions().batch_normalization_backward(
                self.x, self.weight, dz, self.mean, self.invstd, self.epsilon, True, self.mode,
                False)
        else:  # the running statistics are constants: the gradient of a per-channel affine map
            axes = (0, 2, 3)
            dx = dz * reference.per_channel(self.weight * self.invstd, 4)
            dweight = (dz * reference.bn_xhat(self.x, self.mean, self.invstd)).sum(axis=axes)
            dbias = dz.sum(axis=axes)
        dx = dx.reshape(shape) if self.needs_input_grad[0] else None
        dtype = self.weight.dtype
        return dx, dweight.astype(dtype, copy=False), dbias.astype(dtype, copy=False)

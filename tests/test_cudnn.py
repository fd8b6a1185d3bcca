"""The cuDNN path (``fleetmpi/nn/functional/cudnn.py``), run on the host.

With the backend's GPU branch switched on, a stand-in for CuPy's cuDNN bindings
(``cupyx.cudnn`` and ``cupy.cuda.cudnn``) is installed in ``sys.modules``. Its functions compute
with NumPy from references independent of fleetmpi (the direct loops of
``test_conv_reference.py``, textbook batch norm with cuDNN's own running-statistics convention)
and record every call. Against it the tests check that convolution, pooling and batch norm,
forward and backward, equal the im2col path on the same inputs; that the strategy's cuDNN fields
reach the calls; that the running statistics keep fleetmpi's convention; that sync_batch_norm,
missing bindings and the CPU keep to the other path; the library preload; and what
``applied_strategy().not_applied`` says about the cuDNN fields. The fused kernels run their
NumPy references here (``test_kernels_host.py`` checks the kernels against them).
"""
import contextlib
import ctypes
import importlib
import importlib.metadata
import logging
import sys
import types

import numpy as np
import pytest

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from fleetmpi import backend, kernels, nn, optimizer
from fleetmpi.log import logger
from fleetmpi.nn.functional import cudnn
from fleetmpi.strategies import applied

from test_conv_reference import TOLERANCE, assert_close, direct_conv, direct_pool, run

CONSTANTS = {
    "CUDNN_POOLING_MAX": 0, "CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING": 1,
    "CUDNN_POOLING_AVERAGE_COUNT_EXCLUDE_PADDING": 2, "CUDNN_POOLING_MAX_DETERMINISTIC": 3,
    "CUDNN_BATCHNORM_PER_ACTIVATION": 0, "CUDNN_BATCHNORM_SPATIAL": 1,
    "CUDNN_BATCHNORM_SPATIAL_PERSISTENT": 2, "CUDNN_TENSOR_NCHW": 0,
    "CUDNN_BN_MIN_EPSILON": 1e-5,
}
FUNCTIONS = ("convolution_forward", "convolution_backward_filter", "convolution_backward_data",
             "pooling_forward", "pooling_backward", "batch_normalization_forward_training",
             "batch_normalization_forward_inference", "batch_normalization_backward",
             "set_max_workspace_size", "get_max_workspace_size")
BN_AXES = (0, 2, 3)


def _square(name, pair):
    assert isinstance(pair, tuple) and len(pair) == 2 and pair[0] == pair[1], (name, pair)
    return pair[0]


def _channel(vector):
    return np.asarray(vector, dtype=np.float64).reshape(1, -1, 1, 1)


class StandIn:
    """``cupyx.cudnn`` in NumPy: each function checks what cuDNN requires of its arguments,
    computes from the references, writes its outputs where CuPy's does, and records
    ``(name, arguments)`` in ``calls``."""

    def __init__(self):
        self.calls = []
        self.workspace = 8 * 2**20

    def names(self):
        return [name for name, _ in self.calls]

    def arguments(self, name):
        return [arguments for called, arguments in self.calls if called == name]

    def _conv_checks(self, x, w, out, pad, stride, dilation, groups):
        assert dilation == (1, 1) and groups == 1
        assert x.dtype == w.dtype == out.dtype
        assert x.flags.c_contiguous and w.flags.c_contiguous and out.flags.c_contiguous
        return _square("stride", stride), _square("pad", pad)

    def convolution_forward(self, x, W, b, y, pad, stride, dilation, groups, *, auto_tune,
                            tensor_core, d_layout=0, w_layout=0):
        self.calls.append(("convolution_forward", dict(b=b, pad=pad, stride=stride,
                                                       auto_tune=auto_tune)))
        s, p = self._conv_checks(x, W, y, pad, stride, dilation, groups)
        bias = np.zeros(W.shape[0]) if b is None else b.astype(np.float64)
        y[...] = direct_conv(x.astype(np.float64), W.astype(np.float64), bias, s, p)[0]

    def convolution_backward_filter(self, x, gy, gW, pad, stride, dilation, groups, *,
                                    deterministic, auto_tune, tensor_core, d_layout=0,
                                    w_layout=0):
        self.calls.append(("convolution_backward_filter", dict(pad=pad, stride=stride,
                                                               auto_tune=auto_tune)))
        s, p = self._conv_checks(x, gW, gy, pad, stride, dilation, groups)
        backward = direct_conv(x.astype(np.float64), np.zeros(gW.shape), np.zeros(gW.shape[0]),
                               s, p)[1]
        gW[...] = backward(gy.astype(np.float64))[1]

    def convolution_backward_data(self, W, x, b, y, pad, stride, dilation, groups, *,
                                  deterministic, auto_tune, tensor_core, d_layout=0,
                                  w_layout=0):
        self.calls.append(("convolution_backward_data", dict(pad=pad, stride=stride,
                                                             auto_tune=auto_tune)))
        assert b is None
        s, p = self._conv_checks(y, W, x, pad, stride, dilation, groups)
        backward = direct_conv(np.zeros(y.shape), W.astype(np.float64), np.zeros(W.shape[0]),
                               s, p)[1]
        y[...] = backward(x.astype(np.float64))[0]

    def _pool(self, x, ksize, stride, pad, mode):
        kind = {CONSTANTS["CUDNN_POOLING_MAX"]: "max",
                CONSTANTS["CUDNN_POOLING_AVERAGE_COUNT_EXCLUDE_PADDING"]: "avg"}[mode]
        assert x.flags.c_contiguous
        return direct_pool(x.astype(np.float64), _square("ksize", ksize),
                           _square("stride", stride), _square("pad", pad), kind)

    def pooling_forward(self, x, y, ksize, stride, pad, mode):
        self.calls.append(("pooling_forward", dict(ksize=ksize, stride=stride, pad=pad,
                                                   mode=mode)))
        assert x.dtype == y.dtype
        y[...] = self._pool(x, ksize, stride, pad, mode)[0]
        return y

    def pooling_backward(self, x, y, gy, ksize, stride, pad, mode):
        self.calls.append(("pooling_backward", dict(mode=mode)))
        want, backward = self._pool(x, ksize, stride, pad, mode)
        np.testing.assert_array_equal(y, want.astype(y.dtype))
        assert gy.dtype == x.dtype and gy.flags.c_contiguous
        return backward(gy.astype(np.float64)).astype(x.dtype)

    @staticmethod
    def _bn_checks(x, is_for_conv2d, *statistics):
        assert is_for_conv2d and x.ndim == 4 and x.flags.c_contiguous
        parameter = np.float32 if x.dtype == np.float16 else x.dtype
        for vector in statistics:
            assert vector.dtype == parameter and vector.shape == (x.shape[1],)

    def batch_normalization_forward_training(self, x, gamma, beta, running_mean, running_var,
                                             mean, inv_std, eps, decay, is_for_conv2d,
                                             cudnn_mode, debug, d_layout=0):
        """cuDNN's arithmetic: ``running = (1 - factor) * running + factor * batch`` with
        ``factor = 1 - decay`` and the unbiased batch variance (NaN for one value)."""
        self.calls.append(("batch_normalization_forward_training",
                           dict(eps=eps, decay=decay, mode=cudnn_mode)))
        self._bn_checks(x, is_for_conv2d, running_mean, running_var, mean, inv_std)
        values = x.astype(np.float64)
        count = values.size // values.shape[1]
        batch_mean, batch_var = values.mean(axis=BN_AXES), values.var(axis=BN_AXES)
        factor = 1.0 - decay
        with np.errstate(divide="ignore", invalid="ignore"):
            unbiased = batch_var * count / (count - 1)
        running_mean[...] = (1 - factor) * running_mean + factor * batch_mean
        running_var[...] = (1 - factor) * running_var + factor * unbiased
        mean[...] = batch_mean
        inv_std[...] = 1 / np.sqrt(batch_var + eps)
        y = (_channel(gamma) * (values - _channel(batch_mean)) * _channel(inv_std)
             + _channel(beta))
        return y.astype(x.dtype)

    def batch_normalization_forward_inference(self, x, gamma, beta, mean, var, eps,
                                              is_for_conv2d, cudnn_mode, d_layout=0):
        self.calls.append(("batch_normalization_forward_inference", dict(mode=cudnn_mode)))
        assert is_for_conv2d and x.ndim == 4 and x.flags.c_contiguous
        y = (_channel(gamma) * (x.astype(np.float64) - _channel(mean))
             / np.sqrt(_channel(var) + eps) + _channel(beta))
        return y.astype(x.dtype)

    def batch_normalization_backward(self, x, gamma, gy, mean, inv_std, eps, is_for_conv2d,
                                     cudnn_mode, debug, d_layout=0):
        self.calls.append(("batch_normalization_backward", dict(mode=cudnn_mode)))
        self._bn_checks(x, is_for_conv2d, mean, inv_std)
        assert gy.dtype == x.dtype and gy.shape == x.shape
        count = x.size // x.shape[1]
        xhat = (x.astype(np.float64) - _channel(mean)) * _channel(inv_std)
        dy = gy.astype(np.float64)
        gbeta, ggamma = dy.sum(axis=BN_AXES), (dy * xhat).sum(axis=BN_AXES)
        gx = (_channel(gamma) * _channel(inv_std) / count
              * (count * dy - _channel(gbeta) - xhat * _channel(ggamma)))
        return gx.astype(x.dtype), ggamma.astype(gamma.dtype), gbeta.astype(gamma.dtype)

    def set_max_workspace_size(self, size):
        self.calls.append(("set_max_workspace_size", dict(size=size)))
        self.workspace = size

    def get_max_workspace_size(self):
        return self.workspace


def install(monkeypatch, stand_in=None):
    """CuPy's modules in ``sys.modules``: with ``stand_in``'s cuDNN bindings, or, without one,
    a CuPy that has none (as CuPy 14)."""
    cupy, cuda, cupyx = (types.ModuleType(name) for name in ("cupy", "cupy.cuda", "cupyx"))
    cupy.cuda = cuda
    cupy.lib = np.lib  # the im2col path's strided windows
    modules = {"cupy": cupy, "cupy.cuda": cuda, "cupyx": cupyx,
               "cupy.cuda.cudnn": None, "cupyx.cudnn": None}
    if stand_in is not None:
        constants = types.ModuleType("cupy.cuda.cudnn")
        for name, value in CONSTANTS.items():
            setattr(constants, name, value)
        constants.getVersion = lambda: 8907
        functions = types.ModuleType("cupyx.cudnn")
        for name in FUNCTIONS:
            setattr(functions, name, getattr(stand_in, name))
        cuda.cudnn, cupyx.cudnn = constants, functions
        modules.update({"cupy.cuda.cudnn": constants, "cupyx.cudnn": functions})
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


@pytest.fixture
def gpu_branch(monkeypatch):
    """The backend's GPU branch over NumPy, with the cuDNN decision and settings fresh; no
    library is preloaded (``test_preload_*`` check that step)."""
    monkeypatch.setattr(backend, "on_gpu", lambda: True)
    monkeypatch.setattr(kernels, "_use_kernel", lambda *arrays: False)
    for name, value in (("_bindings", None), ("_unusable", None),
                        ("_settings", cudnn.Settings()), ("_workspace_set", None)):
        monkeypatch.setattr(cudnn, name, value)
    monkeypatch.setattr(cudnn, "preload_library", lambda: None)
    return monkeypatch


@pytest.fixture
def stand_in(gpu_branch):
    bindings = StandIn()
    install(gpu_branch, bindings)
    return bindings


@contextlib.contextmanager
def other_path(monkeypatch):
    """Inside: the CPU branch, so conv.py's and norm.py's own functions run."""
    with monkeypatch.context() as patch:
        patch.setattr(backend, "on_gpu", lambda: False)
        yield


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def warnings_logged():
    handler = Collect()
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


def assert_all_close(got, want, dtype, what):
    for index, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, dtype, f"{what} {index}")


def _arrays(rng, *shapes):
    return [rng.standard_normal(shape) for shape in shapes]


# (kernel, stride, padding)
CONV_WINDOWS = [(k, s, p) for k in (1, 3) for s in (1, 2) for p in (0, 1)]
# (bias, act): a fused activation comes with a bias, as nn.Conv2D.forward_act has it
CONV_OUTPUTS = [(False, None), (True, None), (True, "relu"), (True, "gelu")]


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("outputs", CONV_OUTPUTS, ids=lambda o: f"bias{int(o[0])}_{o[1]}")
@pytest.mark.parametrize("window", CONV_WINDOWS, ids=lambda w: "k{}s{}p{}".format(*w))
def test_conv2d_through_cudnn_equals_the_im2col_path(stand_in, monkeypatch, window, outputs,
                                                     dtype):
    kernel, stride, padding = window
    with_bias, act = outputs
    rng = np.random.default_rng([kernel, stride, padding])
    inputs = _arrays(rng, (2, 3, 6, 5), (4, 3, kernel, kernel), (4,))[:3 if with_bias else 2]

    def conv(x, weight, bias=None):
        return F.conv2d(x, weight, bias, stride, padding, act)

    y, grads, _ = run(conv, dtype, *inputs)
    with other_path(monkeypatch):
        want_y, want_grads, _ = run(conv, dtype, *inputs)
    assert_close(y, want_y, dtype, "output")
    assert_all_close(grads, want_grads, dtype, "gradient of argument")
    assert stand_in.names() == ["convolution_forward", "convolution_backward_filter",
                                "convolution_backward_data"]
    forward = stand_in.arguments("convolution_forward")[0]
    assert forward["pad"] == (padding, padding) and forward["stride"] == (stride, stride)
    # a fused activation adds the bias itself, after the convolution
    assert (forward["b"] is None) == (not with_bias or act is not None)


def test_conv2d_asks_cudnn_only_for_the_gradients_needed(stand_in):
    rng = np.random.default_rng(3)
    x, weight, bias = _arrays(rng, (2, 3, 5, 5), (4, 3, 3, 3), (4,))
    frozen = fleet.to_tensor(weight.astype(np.float32))  # stop_gradient: no weight gradient
    trained = fleet.to_tensor(bias.astype(np.float32), stop_gradient=False)
    y = F.conv2d(fleet.to_tensor(x.astype(np.float32), stop_gradient=False), frozen, trained,
                 padding=1)
    y.backward(np.ones(y.shape, np.float32))
    assert stand_in.names() == ["convolution_forward", "convolution_backward_data"]
    np.testing.assert_allclose(trained.grad, np.full(4, 2 * 5 * 5))

    stand_in.calls.clear()
    y = F.conv2d(x.astype(np.float32), fleet.to_tensor(weight.astype(np.float32),
                                                       stop_gradient=False))
    y.backward(np.ones(y.shape, np.float32))
    assert stand_in.names() == ["convolution_forward", "convolution_backward_filter"]


# (kernel, stride, padding)
POOL_WINDOWS = [(3, 2, 1), (2, 2, 0), (3, 1, 1), (1, 1, 0), (1, 2, 0)]


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("window", POOL_WINDOWS, ids=lambda w: "k{}s{}p{}".format(*w))
@pytest.mark.parametrize("kind", ["max", "avg"])
def test_pooling_through_cudnn_equals_the_strided_windows(stand_in, monkeypatch, kind, window,
                                                          dtype):
    kernel, stride, padding = window
    pool = F.max_pool2d if kind == "max" else F.avg_pool2d
    x = np.random.default_rng([kernel, stride, padding]).standard_normal((2, 3, 7, 6))

    def pooled(a):
        return pool(a, kernel, stride=stride, padding=padding)

    y, grads, _ = run(pooled, dtype, x)
    with other_path(monkeypatch):
        want_y, want_grads, _ = run(pooled, dtype, x)
    assert_close(y, want_y, dtype, "output")
    assert_all_close(grads, want_grads, dtype, "input gradient")
    mode = CONSTANTS["CUDNN_POOLING_MAX" if kind == "max"
                     else "CUDNN_POOLING_AVERAGE_COUNT_EXCLUDE_PADDING"]
    assert stand_in.calls == [
        ("pooling_forward", dict(ksize=(kernel,) * 2, stride=(stride,) * 2,
                                 pad=(padding,) * 2, mode=mode)),
        ("pooling_backward", dict(mode=mode))]


def test_adaptive_average_pooling_goes_through_cudnn_and_the_global_mean_does_not(
        stand_in, monkeypatch):
    x = np.random.default_rng(5).standard_normal((2, 3, 6, 4))
    y, grads, _ = run(lambda a: F.adaptive_avg_pool2d(a, (3, 2)), np.float64, x)
    with other_path(monkeypatch):
        want_y, want_grads, _ = run(lambda a: F.adaptive_avg_pool2d(a, (3, 2)), np.float64, x)
    assert_close(y, want_y, np.float64, "output")
    assert_all_close(grads, want_grads, np.float64, "input gradient")
    assert [c["ksize"] for c in stand_in.arguments("pooling_forward")] == [(2, 2)]
    stand_in.calls.clear()
    F.adaptive_avg_pool2d(x, 1)
    F.global_avg_pool(x)
    assert stand_in.calls == []


def _batch_norm(dtype, shape, training, act, momentum=0.8, epsilon=1e-5, communicator=None):
    """Output, gradients of input, weight and bias, and the running statistics after, for one
    call of F.batch_norm from running statistics (0.5, 2.0)."""
    rng = np.random.default_rng(list(shape) + [training])
    x = rng.standard_normal(shape) * 3 + 1
    weight, bias = rng.standard_normal(shape[1]) + 1, rng.standard_normal(shape[1])
    running_mean = np.full(shape[1], 0.5, dtype)  # a layer's buffers are in its dtype
    running_var = np.full(shape[1], 2.0, dtype)

    def normalized(a, w, b):
        return F.batch_norm(a, running_mean, running_var, w, b, training=training,
                            momentum=momentum, epsilon=epsilon, communicator=communicator,
                            act=act)

    y, grads, _ = run(normalized, dtype, x, weight, bias)
    return y, grads, (running_mean, running_var), x.astype(dtype).astype(np.float64)


BN_SHAPES = [(4, 3, 5, 5), (6, 3), (4, 3, 7)]


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("act", [None, "relu"])
@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("shape", BN_SHAPES, ids=str)
def test_batch_norm_through_cudnn_equals_the_other_path(stand_in, monkeypatch, shape, training,
                                                        act, dtype):
    y, grads, running, _ = _batch_norm(dtype, shape, training, act)
    with other_path(monkeypatch):
        want_y, want_grads, want_running, _ = _batch_norm(dtype, shape, training, act)
    assert_close(y, want_y, dtype, "output")
    assert_all_close(grads, want_grads, dtype, "gradient of argument")
    assert_all_close(running, want_running, dtype, "running statistic")
    if act is not None:
        assert 0 < (y > 0).mean() < 1
    forward = "batch_normalization_forward_" + ("training" if training else "inference")
    assert stand_in.names() == [forward] + ["batch_normalization_backward"] * training


@pytest.mark.parametrize("shape", [(4, 3, 5, 5), (5, 2), (1, 3)], ids=str)
def test_running_statistics_move_by_the_biased_batch_variance(stand_in, shape):
    """cuDNN moves running statistics by the unbiased variance and ``1 - decay``; fleetmpi's
    are ``momentum * running + (1 - momentum) * batch`` with the biased variance, whatever
    cuDNN makes of one value per channel."""
    _, _, (running_mean, running_var), x = _batch_norm(np.float64, shape, True, None,
                                                       momentum=0.7)
    axes = (0,) + tuple(range(2, len(shape)))
    np.testing.assert_allclose(running_mean, 0.7 * 0.5 + 0.3 * x.mean(axis=axes), rtol=1e-12)
    np.testing.assert_allclose(running_var, 0.7 * 2.0 + 0.3 * x.var(axis=axes), rtol=1e-12)
    assert [c["decay"] for c in stand_in.arguments("batch_normalization_forward_training")] \
        == [0.0]


class _Communicator:
    """One rank's communicator that records its allreduces."""

    size = 1

    def __init__(self):
        self.allreduces = 0

    def allreduce(self, array, op="sum", out=None):
        self.allreduces += 1
        return array


def test_sync_batch_norm_keeps_its_global_statistics_off_cudnn(stand_in):
    communicator = _Communicator()
    _batch_norm(np.float32, (4, 3, 5, 5), True, None, communicator=communicator)
    assert communicator.allreduces == 3  # two for the statistics, one for the input gradient
    assert stand_in.calls == []
    _batch_norm(np.float32, (4, 3, 5, 5), False, None, communicator=communicator)
    assert stand_in.names() == ["batch_normalization_forward_inference"]


def test_an_epsilon_cudnn_refuses_keeps_batch_norm_off_cudnn(stand_in, monkeypatch):
    y, grads, running, _ = _batch_norm(np.float64, (4, 3, 5, 5), True, None, epsilon=1e-6)
    assert stand_in.calls == []
    with other_path(monkeypatch):
        want = _batch_norm(np.float64, (4, 3, 5, 5), True, None, epsilon=1e-6)
    assert_all_close([y, *grads, *running], [want[0], *want[1], *want[2]], np.float64, "value")


def _conv_bn_relu():
    backend.manual_seed(0)
    return nn.Sequential(nn.Conv2D(3, 4, 3, padding=1), nn.BatchNorm2D(4), nn.ReLU())


def _strategy(exhaustive_search, workspace_limit, spatial_persistent):
    strategy = fleet.DistributedStrategy()
    strategy.cudnn_exhaustive_search = exhaustive_search
    strategy.conv_workspace_size_limit = workspace_limit
    strategy.cudnn_batchnorm_spatial_persistent = spatial_persistent
    return strategy


@pytest.mark.parametrize("fields", [(True, 4000, True), (False, 100, False), (True, 0, False)],
                         ids=str)
def test_strategy_fields_reach_the_cudnn_calls(stand_in, fields):
    exhaustive_search, workspace_limit, spatial_persistent = fields
    model = _conv_bn_relu()
    fleet.distributed_optimizer(optimizer.SGD(parameters=model.parameters()),
                                _strategy(*fields), local=True)
    assert not set(applied.CUDNN_FIELDS) & set(fleet.applied_strategy().not_applied)
    x = np.random.default_rng(0).standard_normal((2, 3, 6, 6)).astype(np.float32)
    y = model(fleet.to_tensor(x, stop_gradient=False))
    y.backward(np.ones(y.shape, np.float32))
    model.eval()
    model(x)
    assert stand_in.calls[0] == ("set_max_workspace_size", dict(size=workspace_limit * 2**20))
    assert stand_in.names().count("set_max_workspace_size") == 1
    convolutions = [arguments for name, arguments in stand_in.calls if "convolution" in name]
    assert len(convolutions) == 4
    assert all(c["auto_tune"] is exhaustive_search for c in convolutions)
    mode = CONSTANTS["CUDNN_BATCHNORM_SPATIAL_PERSISTENT" if spatial_persistent
                     else "CUDNN_BATCHNORM_SPATIAL"]
    assert [(name, c["mode"]) for name, c in stand_in.calls if "batch_norm" in name] == [
        ("batch_normalization_forward_training", mode), ("batch_normalization_backward", mode),
        ("batch_normalization_forward_inference", CONSTANTS["CUDNN_BATCHNORM_SPATIAL"])]


def test_until_a_strategy_is_applied_cudnn_runs_as_cupy_sets_it(stand_in):
    model = _conv_bn_relu()
    y = model(np.ones((1, 3, 4, 4), np.float32))
    assert "set_max_workspace_size" not in stand_in.names()
    assert stand_in.arguments("convolution_forward")[0]["auto_tune"] is False
    assert stand_in.arguments("batch_normalization_forward_training")[0]["mode"] == \
        CONSTANTS["CUDNN_BATCHNORM_SPATIAL"]
    assert y.shape == (1, 4, 4, 4)


@pytest.mark.parametrize("arguments, bad", [
    ((1, 4000, True), "cudnn_exhaustive_search must be True or False, not 1"),
    ((True, -1, True), "conv_workspace_size_limit must be an integer >= 0 (MB), not -1"),
    ((True, 2.5, True), "conv_workspace_size_limit must be an integer >= 0 (MB), not 2.5"),
    ((True, 10, "yes"), "cudnn_batchnorm_spatial_persistent must be True or False, not 'yes'"),
])
def test_configure_refuses_bad_values_naming_them(arguments, bad):
    before = cudnn.settings()
    with pytest.raises(ValueError) as error:
        cudnn.configure(*arguments)
    assert str(error.value) == bad
    assert cudnn.settings() == before


def test_without_bindings_the_other_path_runs_after_one_warning(gpu_branch):
    install(gpu_branch)
    rng = np.random.default_rng(2)
    x, weight, bias = _arrays(rng, (2, 3, 5, 5), (4, 3, 3, 3), (4,))
    with warnings_logged() as warned:
        y, grads, _ = run(lambda a, w, b: F.conv2d(a, w, b, padding=1), np.float64, x, weight,
                          bias)
        F.batch_norm(x, None, None, np.ones(3), np.zeros(3), training=True)
    with other_path(gpu_branch):
        want_y, want_grads, _ = run(lambda a, w, b: F.conv2d(a, w, b, padding=1), np.float64,
                                    x, weight, bias)
    assert_close(y, want_y, np.float64, "output")
    assert_all_close(grads, want_grads, np.float64, "gradient of argument")
    assert len(warned) == 1, warned
    assert warned[0].startswith("cuDNN is not usable on this GPU (ModuleNotFoundError: ")
    assert "cupyx.cudnn" in warned[0] and "fleetmpi[gpu]" in warned[0]
    assert warned[0] == (f"{cudnn.unusable_reason()}: {cudnn.WITHOUT_CUDNN}; pip install "
                         "'fleetmpi[gpu]' installs CuPy 13 and cuDNN 8")


def test_on_the_cpu_the_bindings_are_never_loaded(monkeypatch):
    bindings = StandIn()
    install(monkeypatch, bindings)
    monkeypatch.setattr(cudnn, "_bindings", None)
    monkeypatch.setattr(cudnn, "_unusable", None)
    with warnings_logged() as warned:
        F.conv2d(np.ones((1, 2, 3, 3)), np.ones((2, 2, 1, 1)))
        F.max_pool2d(np.ones((1, 2, 4, 4)), 2)
        F.batch_norm(np.ones((4, 2)), None, None, np.ones(2), np.zeros(2), training=True)
    assert bindings.calls == [] and warned == []
    assert cudnn.unusable_reason() == cudnn.ON_CPU and cudnn._bindings is None


class _Distribution:
    def __init__(self, root):
        self.root = root

    def locate_file(self, path):
        return self.root / path


@pytest.fixture
def loads(monkeypatch):
    """The libraries ``ctypes.CDLL`` was asked to load, as ``(path, mode)``."""
    loaded = []
    monkeypatch.setattr(ctypes, "CDLL", lambda path, mode=0: loaded.append((path, mode)))
    return loaded


def test_preload_loads_the_wheels_cudnn_8_globally(tmp_path, monkeypatch, loads):
    library = tmp_path / "nvidia" / "cudnn" / "lib" / "libcudnn.so.8"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"")
    asked = []

    def distribution(name):
        asked.append(name)
        return _Distribution(tmp_path)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    assert cudnn.preload_library() == str(library)
    assert asked == ["nvidia-cudnn-cu12"]
    assert loads == [(str(library), ctypes.RTLD_GLOBAL)]


@pytest.mark.parametrize("installed", ["no distribution", "a cuDNN 9 wheel"])
def test_preload_leaves_the_search_path_without_the_wheels_cudnn_8(tmp_path, monkeypatch, loads,
                                                                   installed):
    if installed == "no distribution":
        def distribution(name):
            raise importlib.metadata.PackageNotFoundError(name)
    else:
        library = tmp_path / "nvidia" / "cudnn" / "lib" / "libcudnn.so.9"
        library.parent.mkdir(parents=True)
        library.write_bytes(b"")

        def distribution(name):
            return _Distribution(tmp_path)
    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    assert cudnn.preload_library() is None
    assert loads == []


def test_the_library_is_preloaded_before_the_bindings_are_imported(stand_in, monkeypatch):
    order = []
    import_module = importlib.import_module
    monkeypatch.setattr(cudnn, "preload_library", lambda: order.append("preload"))
    monkeypatch.setattr(importlib, "import_module",
                        lambda name: order.append(name) or import_module(name))
    assert cudnn.unusable_reason() is None
    assert order == ["preload", "cupyx.cudnn", "cupy.cuda.cudnn"]
    cudnn.unusable_reason()
    assert len(order) == 3  # decided once


CUDNN_SET = {"cudnn_exhaustive_search": False, "conv_workspace_size_limit": 100,
             "cudnn_batchnorm_spatial_persistent": False}


def test_on_the_cpu_the_cudnn_fields_are_reported_as_not_applied():
    model = _conv_bn_relu()
    fleet.distributed_optimizer(optimizer.SGD(parameters=model.parameters()),
                                _strategy(*CUDNN_SET.values()), local=True)
    reasons = fleet.applied_strategy().not_applied
    want = f"{cudnn.ON_CPU}: {cudnn.WITHOUT_CUDNN}"
    assert {name: reasons.get(name) for name in CUDNN_SET} == dict.fromkeys(CUDNN_SET, want)
    in_parameter_server_mode = applied.parameter_server_not_applied(
        _strategy(*CUDNN_SET.values()), on_gpu=False)
    assert {name: in_parameter_server_mode.get(name) for name in CUDNN_SET} == \
        dict.fromkeys(CUDNN_SET, want)


def test_fields_at_their_defaults_are_not_reported():
    model = _conv_bn_relu()
    fleet.distributed_optimizer(optimizer.SGD(parameters=model.parameters()),
                                fleet.DistributedStrategy(), local=True)
    assert not set(CUDNN_SET) & set(fleet.applied_strategy().not_applied)


def test_on_a_gpu_without_cudnn_the_fields_are_reported_with_the_reason(gpu_branch):
    install(gpu_branch)
    with warnings_logged():
        reasons = applied.not_applied(_strategy(*CUDNN_SET.values()), None, on_gpu=True)
    for name in CUDNN_SET:
        assert reasons[name].startswith("cuDNN is not usable on this GPU (ModuleNotFoundError")
        assert reasons[name].endswith(f"): {cudnn.WITHOUT_CUDNN}")


def test_on_a_gpu_with_cudnn_the_fields_are_not_reported(stand_in):
    strategy = _strategy(*CUDNN_SET.values())
    assert not set(CUDNN_SET) & set(applied.not_applied(strategy, None, on_gpu=True))
    assert not set(CUDNN_SET) & set(applied.parameter_server_not_applied(strategy, True))

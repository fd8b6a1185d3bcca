"""The cuDNN path (``fleetmpi/nn/functional/cudnn.py``, ``cudnn_ops.py``, ``cudnn_attention.py``).

On the host, with the backend's GPU branch switched on over NumPy, the stand-in frontend of
``cudnn_frontend_stand_in.py`` is installed as the module ``cudnn``. Against it the tests check
that convolution, batch norm and attention, forward and backward, equal fleetmpi's own path on
the same inputs; which graphs are built, with what declarations and settings, and that each is
built once; that the strategy's cuDNN fields reach the build and the choice of plan; that a
graph cuDNN declines, float64, pooling, masks, dropout and sync_batch_norm keep to the own path;
the fallback without the frontend, with its one warning; and what ``applied_strategy()``
reports about the cuDNN fields.

``TestOnTheGPU`` runs the real frontend against the own path on a GPU (the prepared GPU command,
``benchmarks/gpu_check.py``, runs this file with ``FLEETMPI_DEVICE=gpu``); elsewhere it is
skipped with the reason.
"""
import contextlib
import logging
import sys
import types

import numpy as np
import pytest

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from fleetmpi.core import backend, job
from fleetmpi import kernels, nn, optimizer
from fleetmpi.autograd.autocast import autocast
from fleetmpi.core.log import logger
from fleetmpi.nn.functional import cudnn
from fleetmpi.strategies import applied
from fleetmpi.strategies.amp import CastPolicy

from cublaslt_stand_in import install as install_cublaslt
from cudnn_frontend_stand_in import StandIn
from test_conv_reference import TOLERANCE, assert_close, run


def _fresh_decision(monkeypatch):
    for name, value in (("_frontend", None), ("_handle", None), ("_unusable", None),
                        ("_settings", cudnn.Settings()), ("_plans", {}),
                        ("_declined_kinds", set())):
        monkeypatch.setattr(cudnn, name, value)


@pytest.fixture
def gpu_branch(monkeypatch):
    """The backend's GPU branch over NumPy (the fused kernels' references, products through
    the stand-in cuBLASLt), with the cuDNN decision, settings and graphs fresh."""
    monkeypatch.setattr(backend, "_xp", np)
    monkeypatch.setattr(backend, "on_gpu", lambda: True)
    monkeypatch.setattr(kernels, "_use_kernel", lambda *groups: None)
    monkeypatch.setattr(cudnn, "_current_stream", lambda: 7)
    cupy = types.ModuleType("cupy")
    cupy.lib = np.lib  # the own path's strided windows on the GPU branch
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    _fresh_decision(monkeypatch)
    install_cublaslt(monkeypatch)
    return monkeypatch


@pytest.fixture
def stand_in(gpu_branch):
    frontend = StandIn()
    gpu_branch.setitem(sys.modules, "cudnn", frontend.module())
    return frontend


@contextlib.contextmanager
def own_path(monkeypatch):
    """Inside: the CPU branch, so conv.py's, norm.py's and attention.py's own functions run."""
    with monkeypatch.context() as patch:
        patch.setattr(backend, "on_gpu", lambda: False)
        yield


class Collect(logging.Handler):
    def __init__(self, level):
        super().__init__(level)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def logged(level=logging.WARNING):
    handler = Collect(level)
    previous = logger.level
    logger.setLevel(min(previous or level, level))
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


def assert_all_close(got, want, dtype, what):
    for index, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, dtype, f"{what} {index}")


def _arrays(rng, *shapes):
    return [rng.standard_normal(shape) for shape in shapes]


def _nodes(stand_in):
    """``[(op, params, output dims)]`` of every graph built, in order."""
    return [(op, params, {name: t.dim for name, t in outputs.items()})
            for graph in stand_in.built for op, _, outputs, params in graph.nodes]


# (kernel, stride, padding)
CONV_WINDOWS = [(k, s, p) for k in (1, 3) for s in (1, 2) for p in (0, 1)]
# (bias, act): a fused activation comes with a bias, as nn.Conv2D.forward_act has it
CONV_OUTPUTS = [(False, None), (True, None), (True, "relu"), (True, "gelu")]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
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
    with own_path(monkeypatch):
        want_y, want_grads, _ = run(conv, dtype, *inputs)
    assert_close(y, want_y, dtype, "output")
    assert_all_close(grads, want_grads, dtype, "gradient of argument")
    geometry = {"padding": [padding] * 2, "stride": [stride] * 2}
    out = (2, 4) + tuple(want_y.shape[2:])
    assert _nodes(stand_in) == [("conv_fprop", geometry, {"out": list(out)}),
                                ("conv_dgrad", geometry, {"out": [2, 3, 6, 5]}),
                                ("conv_wgrad", geometry, {"out": [4, 3, kernel, kernel]})]
    assert all(g.io_data_type == cudnn.DATA_TYPES[np.dtype(dtype).name]
               and g.compute_data_type == "FLOAT" for g in stand_in.built)
    assert [op for op, _ in stand_in.executions] == ["conv_fprop", "conv_wgrad", "conv_dgrad"]


def test_conv2d_runs_only_the_gradients_needed_and_builds_each_graph_once(stand_in):
    rng = np.random.default_rng(3)
    x, weight, bias = (a.astype(np.float32) for a in _arrays(rng, (2, 3, 5, 5), (4, 3, 3, 3),
                                                             (4,)))
    frozen = fleet.to_tensor(weight)  # stop_gradient: no weight gradient
    trained = fleet.to_tensor(bias, stop_gradient=False)
    y = F.conv2d(fleet.to_tensor(x, stop_gradient=False), frozen, trained, padding=1)
    y.backward(np.ones(y.shape, np.float32))
    assert [op for op, _ in stand_in.executions] == ["conv_fprop", "conv_dgrad"]
    np.testing.assert_allclose(trained.grad, np.full(4, 2 * 5 * 5))
    stand_in.executions.clear()
    y = F.conv2d(x, fleet.to_tensor(weight, stop_gradient=False), padding=1)
    y.backward(np.ones(y.shape, np.float32))
    assert [op for op, _ in stand_in.executions] == ["conv_fprop", "conv_wgrad"]
    assert len(stand_in.built) == 3  # the same shapes: the graphs built on the first call
    assert stand_in.streams == [(stand_in.handle, 7)] * 4  # CuPy's current stream, each time


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_float32_graphs_keep_float32_math(stand_in, dtype):
    """A float32 convolution never runs on an engine that rounds its inputs (TF32 tensor
    cores): single-process float32 math is what the own path and the peers' strict mode give.
    float16 graphs keep the tensor-core engines."""
    x, weight = _arrays(np.random.default_rng(5), (2, 3, 5, 5), (4, 3, 3, 3))
    y = F.conv2d(fleet.to_tensor(x.astype(dtype), stop_gradient=False),
                 fleet.to_tensor(weight.astype(dtype), stop_gradient=False), padding=1)
    y.backward(np.ones(y.shape, dtype))
    assert len(stand_in.built) == 3
    for graph in stand_in.built:
        if dtype == np.float32:
            assert graph.deselected_notes == ["TENSOR_CORE", "DOWN_CONVERT_INPUTS"]
            assert graph.steps.index("deselect_numeric_notes") < graph.steps.index("build_plans")
        else:
            assert "deselect_numeric_notes" not in graph.steps


def test_float64_and_pooling_stay_on_the_own_path(stand_in):
    x = np.random.default_rng(4).standard_normal((2, 3, 6, 6))
    F.conv2d(x, np.ones((2, 3, 3, 3)))
    F.batch_norm(x, None, None, np.ones(3), np.zeros(3), training=True)
    F.scaled_dot_product_attention(x, x, x)
    for pool in (F.max_pool2d, F.avg_pool2d):
        pool(x.astype(np.float32), 2)
    F.adaptive_avg_pool2d(x.astype(np.float32), (3, 3))
    assert stand_in.built == [] and stand_in.executions == []


def test_a_graph_cudnn_declines_keeps_the_operation_on_its_own_path(stand_in, monkeypatch):
    stand_in.declined = {"conv_dgrad"}
    rng = np.random.default_rng(6)
    inputs = [a.astype(np.float32) for a in _arrays(rng, (2, 3, 5, 5), (4, 3, 3, 3))]
    with logged(logging.INFO) as messages:
        y, grads, _ = run(lambda x, w: F.conv2d(x, w, padding=1), np.float32, *inputs)
        run(lambda x, w: F.conv2d(x, w, padding=1), np.float32, *inputs)
    with own_path(monkeypatch):
        want_y, want_grads, _ = run(lambda x, w: F.conv2d(x, w, padding=1), np.float32, *inputs)
    assert_close(y, want_y, np.float32, "output")
    assert_all_close(grads, want_grads, np.float32, "gradient of argument")
    assert stand_in.executions == []
    declined = [m for m in messages if m.startswith("cuDNN has no engine for")]
    assert len(declined) == 1 and "conv2d input gradient" in declined[0], messages
    assert "GraphNotSupported: No valid engine configs for conv_dgrad" in declined[0]
    assert len(stand_in.built) == 2  # forward and weight gradient, once: the decline is kept


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


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("act", [None, "relu"])
@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("shape", BN_SHAPES, ids=str)
def test_batch_norm_through_cudnn_equals_the_own_path(stand_in, monkeypatch, shape, training,
                                                      act, dtype):
    y, grads, running, _ = _batch_norm(dtype, shape, training, act)
    with own_path(monkeypatch):
        want_y, want_grads, want_running, _ = _batch_norm(dtype, shape, training, act)
    assert_close(y, want_y, dtype, "output")
    assert_all_close(grads, want_grads, dtype, "gradient of argument")
    assert_all_close(running, want_running, dtype, "running statistic")
    if act is not None:
        assert 0 < (y > 0).mean() < 1
    four_d = [shape[0], shape[1], int(np.prod(shape[2:])), 1]
    ops = ["batchnorm", "batchnorm_backward"] if training else ["batchnorm_inference"]
    assert stand_in.ops() == ops
    assert [op for op, _ in stand_in.executions] == ops
    assert all(t.dim == four_d for g in stand_in.built for t in g.tensors
               if t.name in ("x", "dy"))


@pytest.mark.parametrize("shape", [(4, 3, 5, 5), (5, 2), (1, 3)], ids=str)
def test_running_statistics_move_by_the_biased_batch_variance(stand_in, shape):
    """fleetmpi's running statistics are ``momentum * running + (1 - momentum) * batch`` with
    the biased variance, here recovered from the inverse standard deviation cuDNN saves."""
    _, _, (running_mean, running_var), x = _batch_norm(np.float32, shape, True, None,
                                                       momentum=0.7)
    axes = (0,) + tuple(range(2, len(shape)))
    np.testing.assert_allclose(running_mean, 0.7 * 0.5 + 0.3 * x.mean(axis=axes), rtol=1e-6)
    np.testing.assert_allclose(running_var, 0.7 * 2.0 + 0.3 * x.var(axis=axes), rtol=1e-5,
                               atol=1e-6)


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
    assert stand_in.built == []
    _batch_norm(np.float32, (4, 3, 5, 5), False, None, communicator=communicator)
    assert stand_in.ops() == ["batchnorm_inference"]


# (query, key, value) shapes: heads and sequences of several sizes, folded leading axes
ATTENTION_SHAPES = [((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 4)), ((2, 6, 8),) * 3,
                    ((2, 2, 2, 4, 8),) * 3]


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shapes", ATTENTION_SHAPES, ids=str)
def test_attention_through_fused_cudnn_equals_the_own_operation(stand_in, monkeypatch, shapes,
                                                                is_causal):
    inputs = _arrays(np.random.default_rng(len(shapes[0])), *shapes)

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    y, grads, _ = run(attention, np.float16, *inputs)
    with own_path(monkeypatch):
        want_y, want_grads, _ = run(attention, np.float16, *inputs)
    assert_close(y, want_y, np.float16, "output")
    assert_all_close(grads, want_grads, np.float16, "gradient of argument")
    assert stand_in.ops() == ["sdpa", "sdpa_backward"]
    scale = 1 / np.sqrt(shapes[0][-1])
    assert [params for _, params, _ in _nodes(stand_in)] == [
        {"scale": pytest.approx(scale), "causal": is_causal}] * 2
    stats = [t for t in stand_in.built[0].tensors if t.name == "sdpa::stats"][0]
    assert stats.data_type == "FLOAT" and stats.dim[-1] == 1 and len(stats.dim) == 4


def test_attention_with_a_mask_dropout_or_float32_stays_on_the_own_operation(stand_in):
    q = np.random.default_rng(8).standard_normal((2, 2, 4, 8)).astype(np.float16)
    F.scaled_dot_product_attention(q, q, q, attn_mask=np.ones((4, 4), bool))
    F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    F.scaled_dot_product_attention(q.astype(np.float32), q.astype(np.float32), q.astype(
        np.float32))
    assert stand_in.built == []
    F.scaled_dot_product_attention(q, q, q, dropout_p=0.5, training=False)
    assert stand_in.ops() == ["sdpa", "sdpa_backward"]


def test_under_amp_the_graphs_are_built_in_the_dtype_the_operator_computes_in(stand_in):
    rng = np.random.default_rng(9)
    x, weight = (a.astype(np.float32) for a in _arrays(rng, (2, 3, 5, 5), (4, 3, 3, 3)))
    with autocast(CastPolicy({"conv2d"}, {"batch_norm"})):
        y = F.conv2d(fleet.to_tensor(x, stop_gradient=False), weight, padding=1)
        z = F.batch_norm(y, None, None, np.ones(4, np.float32), np.zeros(4, np.float32),
                         training=True)
    assert y.dtype == np.float16 and z.dtype == np.float32
    assert [g.io_data_type for g in stand_in.built] == ["HALF"] * 3 + ["FLOAT"] * 2


def _conv_bn_relu():
    backend.manual_seed(0)
    return nn.Sequential(nn.Conv2D(3, 4, 3, padding=1), nn.BatchNorm2D(4), nn.ReLU())


def _strategy(exhaustive_search, workspace_limit, spatial_persistent=False):
    strategy = fleet.DistributedStrategy()
    strategy.cudnn_exhaustive_search = exhaustive_search
    strategy.conv_workspace_size_limit = workspace_limit
    strategy.cudnn_batchnorm_spatial_persistent = spatial_persistent
    return strategy


def _train_and_infer(model):
    x = np.random.default_rng(0).standard_normal((2, 3, 6, 6)).astype(np.float32)
    y = model(fleet.to_tensor(x, stop_gradient=False))
    y.backward(np.ones(y.shape, np.float32))
    model.eval()
    model(x)


@pytest.mark.parametrize("fields", [(True, 4000), (False, 100), (True, 0)], ids=str)
def test_strategy_fields_reach_the_cudnn_graphs(stand_in, monkeypatch, fields):
    exhaustive_search, workspace_limit = fields
    timings = {0: 3.0, 1: 1.0, 2: 2.0}  # plan 1 is the fastest
    monkeypatch.setattr(cudnn, "_elapsed_ms", lambda run: run() or timings[
        stand_in.executions[-1][1]])
    model = _conv_bn_relu()
    fleet.distributed_optimizer(optimizer.SGD(parameters=model.parameters()),
                                _strategy(*fields), local=True)
    assert not set(applied.CUDNN_FIELDS) & set(fleet.applied_strategy().not_applied)
    _train_and_infer(model)
    assert stand_in.ops() == ["conv_fprop", "conv_dgrad", "conv_wgrad", "batchnorm",
                              "batchnorm_backward", "batchnorm_inference"]
    for graph in stand_in.built:
        assert graph.modes == ["A", "FALLBACK"]
        assert graph.workspace_limit == workspace_limit * 2**20
        assert graph.steps.index("deselect_workspace_greater_than") < \
            graph.steps.index("build_plans")
        assert graph.policy == ("ALL" if exhaustive_search else "HEURISTICS_CHOICE")
    ran = {}
    for op, index in stand_in.executions:
        ran.setdefault(op, []).append(index)
    assert len(ran) == 6 and len(ran["conv_fprop"]) == (5 if exhaustive_search else 2)
    for indices in ran.values():  # each graph: its three plans timed, then the fastest, plan 1
        assert indices == ([0, 1, 2] + [1] * (len(indices) - 3) if exhaustive_search
                           else [None] * len(indices))


def test_until_a_strategy_is_applied_cudnn_runs_as_the_frontend_sets_it(stand_in):
    _train_and_infer(_conv_bn_relu())
    assert all(g.policy == "HEURISTICS_CHOICE" and g.workspace_limit is None
               and "deselect_workspace_greater_than" not in g.steps for g in stand_in.built)
    assert {index for _, index in stand_in.executions} == {None}


def test_new_settings_build_new_graphs(stand_in):
    model = _conv_bn_relu()
    model(np.ones((1, 3, 4, 4), np.float32))
    cudnn.configure(False, 64)
    model(np.ones((1, 3, 4, 4), np.float32))
    model(np.ones((1, 3, 4, 4), np.float32))
    assert [g.workspace_limit for g in stand_in.built] == [None] * 5 + [64 * 2**20] * 5


@pytest.mark.parametrize("arguments, bad", [
    ((1, 4000), "cudnn_exhaustive_search must be True or False, not 1"),
    ((True, -1), "conv_workspace_size_limit must be an integer >= 0 (MB), not -1"),
    ((True, 2.5), "conv_workspace_size_limit must be an integer >= 0 (MB), not 2.5"),
])
def test_configure_refuses_bad_values_naming_them(arguments, bad):
    before = cudnn.settings()
    with pytest.raises(ValueError) as error:
        cudnn.configure(*arguments)
    assert str(error.value) == bad
    assert cudnn.settings() == before


@pytest.mark.parametrize("missing", ["frontend", "library"])
def test_without_cudnn_the_own_path_runs_after_one_warning(gpu_branch, missing):
    if missing == "frontend":
        gpu_branch.setitem(sys.modules, "cudnn", None)
        cause = "ModuleNotFoundError: "
    else:
        frontend = StandIn().module()

        def no_library():
            raise OSError("libcudnn.so.9: cannot open shared object file")

        frontend.backend_version = no_library
        gpu_branch.setitem(sys.modules, "cudnn", frontend)
        cause = "OSError: libcudnn.so.9: cannot open shared object file"
    rng = np.random.default_rng(2)
    x, weight, bias = (a.astype(np.float32) for a in _arrays(rng, (2, 3, 5, 5), (4, 3, 3, 3),
                                                             (4,)))
    with logged() as warned:
        y, grads, _ = run(lambda a, w, b: F.conv2d(a, w, b, padding=1), np.float32, x, weight,
                          bias)
        F.batch_norm(x, None, None, np.ones(3, np.float32), np.zeros(3, np.float32),
                     training=True)
    with own_path(gpu_branch):
        want_y, want_grads, _ = run(lambda a, w, b: F.conv2d(a, w, b, padding=1), np.float32,
                                    x, weight, bias)
    assert_close(y, want_y, np.float32, "output")
    assert_all_close(grads, want_grads, np.float32, "gradient of argument")
    assert len(warned) == 1, warned
    assert warned[0].startswith("cuDNN is not usable on this GPU (" + cause)
    assert warned[0].endswith(f": {cudnn.WITHOUT_CUDNN}; pip install 'fleetmpi[gpu]' (CUDA 12) "
                              "or 'fleetmpi[gpu-cuda13]' installs cuDNN 9 and the cuDNN "
                              "frontend")


def test_only_the_first_worker_warns_the_other_ranks_log_it_as_information(gpu_branch):
    gpu_branch.setitem(sys.modules, "cudnn", None)
    gpu_branch.setattr(job, "joined", lambda: True)
    gpu_branch.setattr(job, "is_first_worker", lambda: False)
    with logged() as warned, logged(logging.INFO) as told:
        assert cudnn.unusable_reason().startswith("cuDNN is not usable on this GPU")
    assert warned == [] and len(told) == 1 and cudnn.WITHOUT_CUDNN in told[0]


@pytest.mark.skipif(backend.on_gpu(), reason="a test of the CPU path")
def test_on_the_cpu_the_frontend_is_never_loaded(monkeypatch):
    frontend = StandIn()
    monkeypatch.setitem(sys.modules, "cudnn", frontend.module())
    _fresh_decision(monkeypatch)
    with logged() as warned:
        F.conv2d(np.ones((1, 2, 3, 3), np.float32), np.ones((2, 2, 1, 1), np.float32))
        F.batch_norm(np.ones((4, 2), np.float32), None, None, np.ones(2, np.float32),
                     np.zeros(2, np.float32), training=True)
    assert frontend.built == [] and warned == []
    assert cudnn.unusable_reason() == cudnn.ON_CPU and cudnn._frontend is None


# Paddle's defaults are True, 512 and True
CUDNN_SET = {"cudnn_exhaustive_search": False, "conv_workspace_size_limit": 100,
             "cudnn_batchnorm_spatial_persistent": False}


@pytest.mark.skipif(backend.on_gpu(), reason="a test of the CPU path")
def test_on_the_cpu_the_cudnn_fields_are_reported_as_not_applied():
    model = _conv_bn_relu()
    fleet.distributed_optimizer(optimizer.SGD(parameters=model.parameters()),
                                _strategy(*CUDNN_SET.values()), local=True)
    reasons = fleet.applied_strategy().not_applied
    want = dict.fromkeys(applied.CUDNN_FIELDS, f"{cudnn.ON_CPU}: {cudnn.WITHOUT_CUDNN}")
    want["cudnn_batchnorm_spatial_persistent"] = cudnn.PERSISTENT_NOT_IN_GRAPH_API
    assert {name: reasons.get(name) for name in CUDNN_SET} == want
    in_parameter_server_mode = applied.parameter_server_not_applied(
        _strategy(*CUDNN_SET.values()), on_gpu=False)
    assert {name: in_parameter_server_mode.get(name) for name in applied.CUDNN_FIELDS} == {
        name: want[name] for name in applied.CUDNN_FIELDS}
    assert in_parameter_server_mode["cudnn_batchnorm_spatial_persistent"]


def test_fields_at_their_defaults_are_not_reported():
    model = _conv_bn_relu()
    fleet.distributed_optimizer(optimizer.SGD(parameters=model.parameters()),
                                fleet.DistributedStrategy(), local=True)
    assert not set(CUDNN_SET) & set(fleet.applied_strategy().not_applied)


def test_on_a_gpu_without_cudnn_the_fields_are_reported_with_the_reason(gpu_branch):
    gpu_branch.setitem(sys.modules, "cudnn", None)
    with logged():
        reasons = applied.not_applied(_strategy(*CUDNN_SET.values()), None, on_gpu=True)
    for name in applied.CUDNN_FIELDS:
        assert reasons[name].startswith("cuDNN is not usable on this GPU (ModuleNotFoundError")
        assert reasons[name].endswith(f"): {cudnn.WITHOUT_CUDNN}")


def test_on_a_gpu_with_cudnn_only_the_persistent_batch_norm_is_reported(stand_in):
    strategy = _strategy(*CUDNN_SET.values())
    reasons = applied.not_applied(strategy, None, on_gpu=True)
    assert {name: reasons.get(name) for name in CUDNN_SET} == {
        "cudnn_exhaustive_search": None, "conv_workspace_size_limit": None,
        "cudnn_batchnorm_spatial_persistent": cudnn.PERSISTENT_NOT_IN_GRAPH_API}
    in_parameter_server_mode = applied.parameter_server_not_applied(strategy, True)
    assert not set(applied.CUDNN_FIELDS) & set(in_parameter_server_mode)


def _real_cudnn():
    """Why the real frontend cannot run here, or None on a GPU where it does."""
    if not backend.on_gpu():
        return "needs a CUDA GPU through CuPy (FLEETMPI_DEVICE=gpu)"
    return cudnn.unusable_reason()


# float32 convolutions may run on TF32 tensor cores, as PyTorch's and Paddle's do by default
GPU_TOLERANCE = {np.float32: 5e-3, np.float16: 3e-2}


@pytest.mark.skipif(_real_cudnn() is not None, reason=str(_real_cudnn()))
class TestOnTheGPU:
    """The real frontend on a GPU, against fleetmpi's own path on the same GPU."""

    @staticmethod
    def _compare(monkeypatch, function, dtype, *inputs):
        y, grads, _ = run(function, dtype, *inputs)
        with monkeypatch.context() as patch:
            patch.setattr(cudnn, "_unusable", "forced off by the test")
            want_y, want_grads, _ = run(function, dtype, *inputs)
        tolerance = GPU_TOLERANCE[dtype]
        for got, want, what in [(y, want_y, "output")] + [
                (g, w, f"gradient {i}") for i, (g, w) in enumerate(zip(grads, want_grads))]:
            error = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
            assert error < tolerance, (what, error)

    @pytest.mark.parametrize("dtype", [np.float32, np.float16])
    @pytest.mark.parametrize("window", [(3, 1, 1), (3, 2, 1), (1, 1, 0)], ids=str)
    def test_convolution(self, monkeypatch, window, dtype):
        kernel, stride, padding = window
        inputs = _arrays(np.random.default_rng(kernel), (8, 16, 12, 12),
                         (32, 16, kernel, kernel), (32,))
        shape_plans = len([p for p in cudnn._plans.values() if p is not None])
        self._compare(monkeypatch, lambda x, w, b: F.conv2d(x, w, b, stride, padding, "relu"),
                      dtype, *inputs)
        assert len([p for p in cudnn._plans.values() if p is not None]) > shape_plans

    @pytest.mark.parametrize("dtype", [np.float32, np.float16])
    @pytest.mark.parametrize("training", [True, False])
    def test_batch_norm(self, monkeypatch, record_property, training, dtype):
        rng = np.random.default_rng(1)
        x, weight, bias = _arrays(rng, (8, 16, 10, 10), (16,), (16,))
        statistics = [backend.asarray(np.zeros(16, dtype)), backend.asarray(np.ones(16, dtype))]
        self._compare(monkeypatch, lambda a, w, b: F.batch_norm(
            a, *statistics, w, b, training=training, act="relu"), dtype, x, weight, bias)
        record_property("cudnn_batch_norm_plans", sum(
            key[0].startswith("batch norm") and p is not None for key, p in cudnn._plans.items()))

    @pytest.mark.parametrize("is_causal", [False, True])
    def test_fused_attention(self, monkeypatch, is_causal):
        inputs = _arrays(np.random.default_rng(2), *[(2, 4, 128, 64)] * 3)
        self._compare(monkeypatch, lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=is_causal), np.float16, *inputs)
        assert any(key[0] == "fused attention" and p is not None
                   for key, p in cudnn._plans.items())

"""cuDNN 9 through NVIDIA's cuDNN frontend (``nvidia-cudnn-frontend``, module ``cudnn``), on a
GPU where it is usable: the graphs ``cudnn_ops.py`` and ``cudnn_attention.py`` describe are
built, cached and executed here.

CuPy 14 has no cuDNN bindings; its upgrade guide points to the frontend, whose Python graph API
takes CuPy arrays (their device pointers and strides) in each execution's variant pack. The
frontend finds cuDNN in NVIDIA's ``nvidia-cudnn-cu12`` / ``nvidia-cudnn-cu13`` wheel itself.
Whether it is usable is decided once, on the first operation on a GPU (the module imports,
cuDNN loads, a handle is created); when it is not, one warning on the first worker says why (the
other ranks log it as information, and ``applied_strategy().not_applied`` gives each rank's
reason), and the operations run without it (``WITHOUT_CUDNN``). On the CPU there is no cuDNN
and nothing is said.

A graph is built once per key (the operation, its shapes, dtypes and parameters, and the
settings below) and kept. Building is where cuDNN says whether it has an engine for the graph:
where it has none, the key is remembered as unsupported, one line is logged per kind of
operation, and the caller runs that operation on its own path.

What the strategy fields of the same names set (``configure``, called when a strategy is
applied; until then the frontend's plain behaviour):

* ``cudnn_exhaustive_search``: every plan cuDNN has for a graph is built, each is timed once on
  the graph's first execution, and the fastest is kept; off, cuDNN's heuristics (mode A, then
  its fallback list) pick one plan without running anything;
* ``conv_workspace_size_limit``: plans that need more scratch memory (MB) are not considered,
  for every graph (convolution, batch norm, attention);
* ``cudnn_batchnorm_spatial_persistent`` sets nothing: it selects a mode of cuDNN's legacy
  batch-norm call, and the graph API has no such mode (its heuristics choose the batch-norm
  engine), so ``applied_strategy().not_applied`` reports it wherever it is set
  (``PERSISTENT_NOT_IN_GRAPH_API``).
"""
import dataclasses
import importlib
import logging
from typing import Optional

import numpy as np

from ...core import backend, job
from ...autograd.autocast import input_dtype
from ...core.log import logger

FRONTEND_MODULE = "cudnn"
FRONTEND_DISTRIBUTION = "nvidia-cudnn-frontend"
ON_CPU = "this process computes on the CPU (NumPy), where there is no cuDNN"
# What runs where cuDNN does not.
WITHOUT_CUDNN = ("convolution, batch norm and attention run without it, as im2col and matrix "
                 "products, elementwise array operations and fleetmpi's fused attention")
PERSISTENT_NOT_IN_GRAPH_API = (
    "cuDNN 9's graph API, which fleetmpi uses through the cuDNN frontend, has no persistent "
    "batch-norm mode (that mode belongs to the legacy cudnnBatchNormalizationForwardTraining); "
    "cuDNN's heuristics choose the batch-norm engine")
# The dtypes cuDNN computes in here, by NumPy (or ml_dtypes) name, and the frontend's name.
DATA_TYPES = {"float16": "HALF", "bfloat16": "BFLOAT16", "float32": "FLOAT"}
_MB = 2**20


@dataclasses.dataclass(frozen=True)
class Settings:
    """The cuDNN settings, under the names of the strategy fields that set them (module
    docstring). The defaults are the frontend's plain behaviour, before any strategy is applied:
    heuristic plan choice, no workspace limit (None)."""

    cudnn_exhaustive_search: bool = False
    conv_workspace_size_limit: Optional[int] = None


_settings = Settings()
_frontend = None  # the frontend module, once loaded
_handle = None  # the cuDNN handle every execution uses (on CuPy's current stream)
_unusable = None  # why cuDNN cannot run on this GPU, once decided: the error met
_plans = {}  # key -> Plan, or None where cuDNN has no engine for the key's graph
_declined_kinds = set()  # the kinds of operation already logged as declined


def configure(cudnn_exhaustive_search, conv_workspace_size_limit):
    """Set what the next cuDNN graphs use (the strategy fields of the same names;
    ``conv_workspace_size_limit`` in MB). Process-wide, as Paddle's flags: the strategy applied
    last wins."""
    global _settings
    if not isinstance(cudnn_exhaustive_search, (bool, np.bool_)):
        raise ValueError(f"cudnn_exhaustive_search must be True or False, not "
                         f"{cudnn_exhaustive_search!r}")
    limit = conv_workspace_size_limit
    if not isinstance(limit, (int, np.integer)) or isinstance(limit, bool) or limit < 0:
        raise ValueError(f"conv_workspace_size_limit must be an integer >= 0 (MB), not "
                         f"{limit!r}")
    _settings = Settings(bool(cudnn_exhaustive_search), int(limit))


def settings():
    """The ``Settings`` the next cuDNN graphs use."""
    return _settings


def _decide():
    """Load the frontend and create the handle once; on failure keep and warn why."""
    global _frontend, _handle, _unusable
    try:
        frontend = importlib.import_module(FRONTEND_MODULE)
        version = frontend.backend_version()
        _handle = frontend.create_handle()
    except Exception as error:  # no frontend, no cuDNN library, no handle: all "no cuDNN"
        _unusable = f"{type(error).__name__}: {error}"
        first = not job.joined() or job.is_first_worker()
        logger.log(logging.WARNING if first else logging.INFO,
                   "%s: %s; pip install 'fleetmpi[gpu]' (CUDA 12) or 'fleetmpi[gpu-cuda13]' "
                   "installs cuDNN 9 and the cuDNN frontend", unusable_reason(), WITHOUT_CUDNN)
        return
    _frontend = frontend
    logger.info("cuDNN %s (frontend %s) runs convolution, batch norm and attention", version,
                getattr(frontend, "__version__", "of unknown version"))


def unusable_reason():
    """None where cuDNN runs this process's convolutions, batch norm and attention; else why
    it does not. The first call on a GPU decides, and warns when cuDNN is not usable."""
    if not backend.on_gpu():
        return ON_CPU
    if _frontend is None and _unusable is None:
        _decide()
    return None if _unusable is None else f"cuDNN is not usable on this GPU ({_unusable})"


def operation_dtype(op_type, *arrays):
    """The dtype cuDNN would compute the operator ``op_type`` on ``arrays`` in (None entries
    skipped; amp's casts applied, ``autocast.input_dtype``), or None where cuDNN does not run
    it: it is not usable, or the arrays are empty, of several dtypes, or of one it does not
    compute in here (``DATA_TYPES``)."""
    if unusable_reason() is not None:
        return None
    present = [a for a in arrays if a is not None]
    dtypes = {input_dtype(op_type, a.dtype) for a in present}
    if len(dtypes) != 1 or not all(a.size for a in present):
        return None
    dtype = dtypes.pop()
    return dtype if dtype.name in DATA_TYPES else None


def data_type(dtype):
    """The frontend's ``data_type`` for a NumPy (or ml_dtypes) ``dtype``."""
    return getattr(_frontend.data_type, DATA_TYPES[np.dtype(dtype).name])


def strides(shape):
    """The element strides of a C-contiguous array of ``shape``, as the graph API takes them."""
    out, step = [], 1
    for extent in reversed(shape):
        out.append(step)
        step *= extent
    return out[::-1]


def declare(graph, name, shape, dtype):
    """A graph input ``name``: a C-contiguous array of ``shape`` and ``dtype``."""
    return graph.tensor(name=name, dim=list(shape), stride=strides(shape),
                        data_type=data_type(dtype))


def mark_output(tensor, shape, dtype):
    """``tensor`` as a graph output: a C-contiguous array of ``shape`` and ``dtype``."""
    tensor.set_output(True).set_dim(list(shape)).set_stride(strides(shape))
    tensor.set_data_type(data_type(dtype))
    return tensor


class Plan:
    """A built graph: ``tensors`` names its graph tensors (the names ``execute`` takes),
    ``index`` is the plan chosen by timing (None: the heuristics' choice)."""

    def __init__(self, graph, tensors):
        self.graph = graph
        self.tensors = tensors
        self.index = None

    def workspace(self, index=None):
        size = (self.graph.get_workspace_size() if index is None
                else self.graph.get_workspace_size_plan_at_index(index))
        return backend.array_module().empty(max(int(size), 1), dtype=np.uint8)


def new_graph(io_dtype):
    """An empty graph computing in float32, with ``io_dtype`` inputs and outputs."""
    names = _frontend.data_type
    return _frontend.pygraph(io_data_type=data_type(io_dtype), intermediate_data_type=names.FLOAT,
                             compute_data_type=names.FLOAT, handle=_handle)


def _finish(graph, io_dtype):
    """Validate and build ``graph`` with the current settings (module docstring); raises the
    frontend's error where cuDNN has no engine for it. A float32 graph keeps float32 math:
    engines that round its inputs to TF32 or a narrower type are excluded."""
    frontend = _frontend
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([frontend.heur_mode.A, frontend.heur_mode.FALLBACK])
    if np.dtype(io_dtype) == np.float32:
        notes = frontend.numerical_note
        graph.deselect_numeric_notes([notes.TENSOR_CORE, notes.DOWN_CONVERT_INPUTS])
    if _settings.conv_workspace_size_limit is not None:
        graph.deselect_workspace_greater_than(_settings.conv_workspace_size_limit * _MB)
    graph.check_support()
    policy = frontend.build_plan_policy
    graph.build_plans(policy.ALL if _settings.cudnn_exhaustive_search
                      else policy.HEURISTICS_CHOICE)


def plan(kind, io_dtype, key, describe):
    """The built ``Plan`` of the graph ``describe(graph)`` declares (``describe`` returns the
    dict of its named tensors), with ``io_dtype`` inputs and outputs, built once per ``key``;
    None where cuDNN has no engine for it. ``kind`` names the operation in the log."""
    key = (kind, np.dtype(io_dtype).name, key, _settings)
    if key in _plans:
        return _plans[key]
    try:
        graph = new_graph(io_dtype)
        built = Plan(graph, describe(graph))
        _finish(graph, io_dtype)
    except Exception as error:  # the caller's own path runs what cuDNN does not
        built = None
        _log_once(kind, key[1:3], error)
    _plans[key] = built
    return built


def _log_once(kind, key, error):
    """Say once per kind of operation that cuDNN does not run it: cuDNN's own "no engine"
    (``cudnnGraphNotSupportedError``) as information, any other error as a warning."""
    if kind in _declined_kinds:
        return
    _declined_kinds.add(kind)
    declined = isinstance(error, _frontend.cudnnGraphNotSupportedError)
    logger.log(logging.INFO if declined else logging.WARNING,
               "cuDNN %s %s %s (%s: %s); such operations run without cuDNN",
               "has no engine for" if declined else "could not build the graph of", kind, key,
               type(error).__name__, error)


def execute(built, buffers):
    """Run ``built`` on ``buffers`` (graph tensor name -> array, host arrays for the values
    passed by value) on CuPy's current stream."""
    pack = {built.tensors[name]: array for name, array in buffers.items()}
    _frontend.set_stream(_handle, _current_stream())
    if _settings.cudnn_exhaustive_search and built.index is None:
        built.index = _fastest(built, pack)
    if built.index is None:
        built.graph.execute(pack, built.workspace(), handle=_handle)
    else:
        built.graph.execute_plan_at_index(pack, built.workspace(built.index), built.index,
                                          handle=_handle)


def _current_stream():
    return backend.array_module().cuda.get_current_stream().ptr


def _elapsed_ms(run):
    """The milliseconds ``run()`` takes on the device (CUDA events around it)."""
    cuda = backend.array_module().cuda
    start, end = cuda.Event(), cuda.Event()
    start.record()
    run()
    end.record()
    end.synchronize()
    return cuda.get_elapsed_time(start, end)


def _fastest(built, pack):
    """Time every plan of ``built`` once on ``pack`` and return the fastest's index, None when
    none runs (each plan writes the same outputs; the execution afterwards writes them
    again)."""
    timings = []
    for index in range(built.graph.get_execution_plan_count()):
        try:
            workspace = built.workspace(index)
            elapsed = _elapsed_ms(lambda: built.graph.execute_plan_at_index(
                pack, workspace, index, handle=_handle))
        except Exception:  # a plan that did not build or does not run is not a candidate
            continue
        timings.append((elapsed, index))
    return min(timings)[1] if timings else None


def contiguous(array, dtype=None):
    """``array`` C-contiguous (and cast to ``dtype``), as the graphs here declare it."""
    return backend.array_module().ascontiguousarray(array, dtype=dtype)

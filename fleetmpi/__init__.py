"""fleetmpi: MPI-style distributed deep-learning training with Fleet's DistributedStrategy.

    import fleetmpi as fleet
    fleet.init(is_collective=True)
    strategy = fleet.DistributedStrategy()
"""
import os as _os
import sys as _sys


def _started_as_launcher(argv, orig_argv):
    """Whether this process is ``fleetmpirun`` (its console script, or ``python -m
    fleetmpi.launch``): it starts the ranks and is none of them."""
    if argv and _os.path.basename(argv[0]) == "fleetmpirun":
        return True
    words = list(orig_argv or ())
    return any(word == "-m" and following == "fleetmpi.launch" or word == "-mfleetmpi.launch"
               for word, following in zip(words, words[1:] + [""]))


import mpi4py as _mpi4py

# Asynchronous collectives run on a communicator's own thread while the training thread may call
# MPI on other communicators (fleetmpi.comm.handles), so MPI must allow calls from any thread at
# any time. Measured at 2 ranks (MPICH 5.0.2, one run): a 4 KiB Allreduce takes 6.3 us at
# THREAD_MULTIPLE, 3.9 us at THREAD_SERIALIZED, 4.9 us at THREAD_SINGLE; 1 MiB: 359, 387, 398 us.
_mpi4py.rc.thread_level = "multiple"

_transport_env = {}
if _started_as_launcher(_sys.argv, getattr(_sys, "orig_argv", None)):
    # mpi4py initializes MPI when it is imported, below; the launcher would then be an MPI
    # process of its own, whose transport listens on the network (docs/launch.md, "Network")
    _mpi4py.rc.initialize = _mpi4py.rc.finalize = False
else:
    from .core import launcher_env as _launcher_env

    if _launcher_env.started_alone(_os.environ):
        # A world of one has no peer to reach: its transport stays on shared memory, where the
        # defaults listen on the host's external address (docs/launch.md, "Network"). Set for
        # MPI's start only, so that jobs this process starts do not inherit it.
        _transport_env = {name: value for name, value
                          in _launcher_env.LOCAL_TRANSPORT_ENV.items() if name not in _os.environ}

from .core import extras as _extras

_extras.install()  # a missing optional package ends a script with one line, not a traceback

_os.environ.update(_transport_env)
try:
    from mpi4py import MPI as _MPI  # noqa: F401 - the first load of the MPI library
except RuntimeError as _error:
    raise _extras.MissingExtra(
        "fleetmpi", f"an MPI library (mpi4py: {str(_error).splitlines()[0]})", "mpi",
        " ('fleetmpi[examples]' for the examples), or on a cluster mpi4py built against its "
        "MPI (pip install --no-binary mpi4py mpi4py)"
    ) from None
finally:
    for _name in _transport_env:
        del _os.environ[_name]

from . import autograd, device, framework, io, metric, nn, optimizer, utils
from .autograd import (Function, NonFiniteError, Tensor, abs, add, cast, concat, divide,
                       enable_grad, exp, gather, is_grad_enabled, log, matmul, max, mean,
                       multiply, no_grad, reshape, sigmoid, split, sqrt, stack, subtract, sum,
                       tanh, to_tensor, transpose)
from .core.backend import manual_seed as seed
from .device import get_device, set_device
from .core.capture_checks import CaptureError
from .training.log_writer import LogWriter
from .nn.creation import (arange, create_parameter, full, full_like, ones, ones_like, rand,
                          randn, zeros, zeros_like)
from .nn.lazy import LazyGuard
from .nn.param_attr import ParamAttr
from .nn.summary import summary
from .config.schema_view import ConfigError
from .training.serialization import load, save
from .device_guard import device_guard, split_stages
from .config.distributed_strategy import BuildStrategy, DistributedStrategy, ExecutionStrategy
from .fleet_util import UtilBase, util
from .graphed import GraphedStep, graphed_step
from .group_sharded import group_sharded_parallel, save_group_sharded_model
from .hybrid import get_hybrid_communicate_group
from .join import Join
from . import meta_parallel
from .parallel import applied_strategy, distributed_model, distributed_optimizer
from . import amp, distributed
from .amp import distributed_scaler
from .distributed import DataParallel
from . import callbacks, hapi, static
from .hapi import Model
from .config.role_maker import ModeError, PaddleCloudRoleMaker, Role, UserDefinedRoleMaker
from .strategies.ps.runtime import (init_server, init_worker, is_server, is_worker, run_server,
                                    save_persistables, server_index, server_num, stop_worker)
from .world import (barrier_worker, init, is_first_worker, local_rank, local_size, node_index,
                    node_num, server_endpoints, worker_endpoints, worker_index, worker_num)


# The modules that lived directly in fleetmpi/ before the layer sub-packages (core/, config/,
# training/) keep their first names: ``import fleetmpi.knobs`` and ``from fleetmpi import
# checkpoint`` reach the same module objects. fleetmpi's own code uses the new names
# (tests/test_layers.py: an old name would import this package back, a cycle).
_FIRST_NAMES = {
    "core": ("backend", "capture_checks", "cuda_source", "failure", "files", "host_memory", "job",
             "knobs", "launcher_env", "log", "paddle_flags", "rng_tracker", "timeline"),
    "config": ("distributed_strategy", "paddle_fields", "paddle_values", "prototxt",
               "role_maker", "schema_view"),
    "training": ("checkpoint", "checkpoint_agreement", "data", "elastic", "hybrid_checkpoint",
                 "log_writer", "progress", "serialization"),
}


def _keep_first_names():
    import importlib
    for package, names in _FIRST_NAMES.items():
        for name in names:
            module = importlib.import_module(f"{__name__}.{package}.{name}")
            _sys.modules[f"{__name__}.{name}"] = module
            globals()[name] = module


_keep_first_names()

__version__ = "0.1.0"

__all__ = [
    "abs", "add", "amp", "applied_strategy", "arange", "autograd", "barrier_worker",
    "BuildStrategy", "callbacks", "CaptureError", "cast", "concat", "ConfigError",
    "create_parameter", "DataParallel", "device", "device_guard", "distributed",
    "distributed_model", "distributed_optimizer", "distributed_scaler", "DistributedStrategy",
    "divide", "enable_grad", "ExecutionStrategy", "exp", "framework", "full", "full_like",
    "Function", "gather", "get_device", "get_hybrid_communicate_group", "graphed_step",
    "GraphedStep", "group_sharded_parallel", "hapi", "init", "init_server", "init_worker", "io",
    "is_first_worker", "is_grad_enabled", "is_server", "is_worker", "Join", "LazyGuard", "load",
    "local_rank", "local_size", "log", "LogWriter", "matmul", "max", "mean", "meta_parallel",
    "metric", "Model", "ModeError", "multiply", "nn", "no_grad", "node_index", "node_num",
    "NonFiniteError", "ones", "ones_like", "optimizer", "PaddleCloudRoleMaker", "ParamAttr",
    "rand", "randn", "reshape", "Role", "run_server", "save", "save_group_sharded_model",
    "save_persistables", "seed", "server_endpoints", "server_index", "server_num", "set_device",
    "sigmoid", "split", "split_stages", "sqrt", "stack", "static", "stop_worker", "subtract",
    "sum", "summary", "tanh", "Tensor", "to_tensor", "transpose", "UserDefinedRoleMaker", "util",
    "utils", "worker_endpoints", "worker_index", "worker_num", "zeros", "zeros_like",
]


from .core.paddle_names import module_getattr as _module_getattr
# A name Paddle has and fleetmpi lacks raises an error that says so (core.paddle_names).
__getattr__ = _module_getattr(__name__, "paddle", globals())

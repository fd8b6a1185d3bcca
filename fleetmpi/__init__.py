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

if _started_as_launcher(_sys.argv, getattr(_sys, "orig_argv", None)):
    # mpi4py initializes MPI when it is imported, below; the launcher would then be an MPI
    # process of its own, whose transport listens on the network (docs/launch.md, "Network")
    _mpi4py.rc.initialize = _mpi4py.rc.finalize = False

from . import autograd, device, nn, optimizer, utils
from .autograd import (Function, NonFiniteError, Tensor, concat, enable_grad, is_grad_enabled,
                       matmul, no_grad, reshape, split, stack, to_tensor, transpose)
from .backend import manual_seed as seed
from .capture_checks import CaptureError
from .schema_view import ConfigError
from .device_guard import device_guard, split_stages
from .distributed_strategy import BuildStrategy, DistributedStrategy, ExecutionStrategy
from .fleet_util import UtilBase
from .graphed import GraphedStep, graphed_step
from .hybrid import get_hybrid_communicate_group
from .parallel import applied_strategy, distributed_model, distributed_optimizer
from .role_maker import ModeError, PaddleCloudRoleMaker, Role, UserDefinedRoleMaker
from .strategies.ps.runtime import (init_server, init_worker, is_server, is_worker, run_server,
                                    save_persistables, server_index, server_num, stop_worker)
from .world import (barrier_worker, init, is_first_worker, local_rank, local_size, node_index,
                    node_num, server_endpoints, worker_endpoints, worker_index, worker_num)

util = UtilBase()

__version__ = "0.1.0"

__all__ = [
    "BuildStrategy", "CaptureError", "ConfigError", "DistributedStrategy", "ExecutionStrategy",
    "Function", "GraphedStep", "ModeError", "NonFiniteError", "PaddleCloudRoleMaker", "Role", "Tensor", "UserDefinedRoleMaker",
    "applied_strategy", "autograd", "barrier_worker", "concat", "device", "device_guard",
    "distributed_model", "distributed_optimizer", "enable_grad",
    "get_hybrid_communicate_group", "graphed_step", "init", "init_server",
    "init_worker", "is_first_worker", "is_grad_enabled", "is_server", "is_worker", "local_rank",
    "local_size", "matmul", "nn", "no_grad", "node_index", "node_num", "optimizer", "reshape",
    "run_server", "save_persistables", "seed", "server_endpoints", "server_index", "server_num",
    "split", "split_stages", "stack", "stop_worker", "to_tensor", "transpose", "util", "utils",
    "worker_endpoints", "worker_index", "worker_num",
]

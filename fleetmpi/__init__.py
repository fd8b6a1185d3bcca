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


if _started_as_launcher(_sys.argv, getattr(_sys, "orig_argv", None)):
    # mpi4py initializes MPI when it is imported, below; the launcher would then be an MPI
    # process of its own, whose transport listens on the network (docs/launch.md, "Network")
    import mpi4py as _mpi4py

    _mpi4py.rc.initialize = _mpi4py.rc.finalize = False

from . import autograd, nn, optimizer, utils
from .autograd import (Function, Tensor, concat, enable_grad, is_grad_enabled, matmul, no_grad,
                       reshape, split, stack, to_tensor, transpose)
from .backend import manual_seed as seed
from .config_message import ConfigError
from .device_guard import device_guard, split_stages
from .distributed_strategy import BuildStrategy, DistributedStrategy, ExecutionStrategy
from .hybrid import get_hybrid_communicate_group
from .parallel import applied_strategy, distributed_model, distributed_optimizer
from .role_maker import PaddleCloudRoleMaker, Role, UserDefinedRoleMaker
from .strategies.ps.runtime import (init_server, init_worker, is_server, is_worker, run_server,
                                    save_persistables, server_index, server_num, stop_worker)
from .world import (barrier_worker, init, is_first_worker, local_rank, local_size, node_index,
                    node_num, worker_index, worker_num)

__version__ = "0.1.0"

__all__ = [
    "Function", "Tensor", "autograd", "concat", "enable_grad", "is_grad_enabled", "matmul",
    "no_grad", "reshape", "seed", "split", "stack", "to_tensor", "transpose",
    "BuildStrategy", "ConfigError", "DistributedStrategy", "ExecutionStrategy",
    "PaddleCloudRoleMaker", "Role", "UserDefinedRoleMaker", "applied_strategy", "barrier_worker",
    "device_guard", "distributed_model", "distributed_optimizer", "get_hybrid_communicate_group",
    "init", "init_server", "init_worker", "is_first_worker", "is_server", "is_worker",
    "local_rank", "local_size", "nn", "node_index", "node_num", "optimizer", "run_server",
    "save_persistables", "server_index", "server_num", "split_stages", "stop_worker", "utils",
    "worker_index", "worker_num",
]

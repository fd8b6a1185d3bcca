"""fleetmpi: MPI-style distributed deep-learning training with Fleet's DistributedStrategy.

    import fleetmpi as fleet
    fleet.init(is_collective=True)
    strategy = fleet.DistributedStrategy()
"""
from . import nn, optimizer
from .config_message import ConfigError
from .distributed_strategy import BuildStrategy, DistributedStrategy, ExecutionStrategy
from .parallel import distributed_model, distributed_optimizer
from .world import (barrier_worker, init, is_first_worker, local_rank, local_size, node_index,
                    node_num, worker_index, worker_num)

__version__ = "0.1.0"

__all__ = [
    "BuildStrategy", "ConfigError", "DistributedStrategy", "ExecutionStrategy",
    "barrier_worker", "distributed_model", "distributed_optimizer", "init", "is_first_worker",
    "local_rank", "local_size", "nn", "node_index", "node_num", "optimizer", "worker_index",
    "worker_num",
]

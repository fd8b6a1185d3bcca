"""``fleetmpi.distributed``, Paddle's ``paddle.distributed`` on tensors: process groups
(``new_group``), the collectives with Paddle's in-place semantics, and ``DataParallel``.

    import fleetmpi.distributed as dist
    dist.init_parallel_env()
    group = dist.new_group([0, 1])                 # every rank calls it
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    model, opt, _ = dist.sharding.group_sharded_parallel(model, opt, level="p_g_os")
"""
from ..core.paddle_names import module_getattr as _module_getattr
from .collective import (all_gather, all_reduce, alltoall, broadcast, recv, reduce, scatter,
                         send)
from . import sharding
from .data_parallel import DataParallel
from .group import (Group, ReduceOp, barrier, get_group, get_rank, get_world_size,
                    init_parallel_env, new_group)

__all__ = ["DataParallel", "Group", "ReduceOp", "all_gather", "all_reduce", "alltoall",
           "barrier", "broadcast", "get_group", "get_rank", "get_world_size",
           "init_parallel_env", "new_group", "recv", "reduce", "scatter", "send", "sharding"]


# A name Paddle has and fleetmpi lacks raises an error that says so (core.paddle_names).
__getattr__ = _module_getattr(__name__, "paddle.distributed", globals())

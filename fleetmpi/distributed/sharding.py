"""``fleetmpi.distributed.sharding``, Paddle's ``paddle.distributed.sharding``: the dygraph
group-sharded API (``fleetmpi.group_sharded``)."""
from ..group_sharded import group_sharded_parallel, save_group_sharded_model

__all__ = ["group_sharded_parallel", "save_group_sharded_model"]

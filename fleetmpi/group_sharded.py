"""Paddle's dygraph sharding API (``paddle.distributed.sharding``, Paddle 2.3 and later):
``group_sharded_parallel`` and ``save_group_sharded_model``, over the ``sharding`` strategy.

``level`` names what is partitioned and maps to ``sharding_configs["stage"]``: ``"os"`` the
optimizer state (stage 1), ``"os_g"`` its gradients too (stage 2), ``"p_g_os"`` the parameters
too (stage 3). The group is the whole world, as with Paddle's default ``group=None``.

Paddle's arguments and what they do here:

* ``buffer_max_size`` (elements, default 2**23): the gradient buckets, as
  ``fuse_grad_size_in_MB`` (at the parameters' element size, rounded up to whole MiB).
* ``sync_buffers``: the model's buffers (batch norm's statistics) are broadcast from rank 0
  before every forward, as Paddle does.
* ``sync_comm``: either value; stage 3 gathers each layer's parameters when it is used and
  waits for them (what Paddle's ``sync_comm=True`` does).
* ``segment_size``: Paddle leaves parameters smaller than it whole on every rank under
  ``"p_g_os"``; here every parameter is partitioned, so any value other than the default is
  reported as having no effect.
* Refused, with the reason: ``scaler`` (fleetmpi has no ``GradScaler`` object; loss scaling
  is ``strategy.amp``), ``offload`` (no host offload), ``group``, ``dp_group`` (groups other
  than the world are ``sharding_configs``' ``hybrid_dp``) and ``exclude_layer``.

Under ``"p_g_os"`` the model's parameters hold only this rank's shard between the operations
that use them; the returned model's ``get_all_parameters()`` (Paddle's
``GroupShardedStage3`` method, a collective) gathers them whole, where they stay until the next
update, so that they read as the trained values. ``save_group_sharded_model`` calls it, as
Paddle's does, so the parameters are whole after the save too.

``save_group_sharded_model`` writes ``model.pdmodel`` (the model's whole ``state_dict``) and
``model.pdopt`` (the optimizer's state, gathered whole from the shards) into a folder, from
rank 0, with ``fleetmpi.save`` (in Paddle's pickle format, as it writes those names). As in
Paddle, load them into the model and a plain optimizer (``set_state_dict``) before
``group_sharded_parallel``; unlike Paddle, ``model.pdopt`` holds every shard's state, so it
loads at any number of ranks.
"""
import math
import os

import numpy as np

from . import world
from .config.distributed_strategy import DistributedStrategy
from .core.log import logger
from .optimizer import Optimizer
from .parallel import DistributedOptimizer, distributed_model, distributed_optimizer
from .training.serialization import save

LEVELS = {"os": 1, "os_g": 2, "p_g_os": 3}
BUFFER_MAX_SIZE = 2 ** 23
SEGMENT_SIZE = 2 ** 20
MODEL_FILE = "model.pdmodel"
OPTIMIZER_FILE = "model.pdopt"


def _stage(level):
    if level not in LEVELS:
        raise ValueError(f"group_sharded_parallel: level {level!r} is not one of "
                         f"{', '.join(map(repr, LEVELS))} (optimizer state; and gradients; "
                         f"and parameters)")
    return LEVELS[level]


def _refuse_unsupported(scaler, group, offload, dp_group, exclude_layer):
    if scaler is not None:
        raise ValueError("group_sharded_parallel: scaler must be None: fleetmpi has no "
                         "GradScaler object; loss scaling is strategy.amp (amp_configs), which "
                         "combines with sharding: set strategy.amp = True, strategy.sharding = "
                         "True and sharding_configs['stage'], then call "
                         "fleet.distributed_optimizer")
    if offload is not False:
        raise ValueError(f"group_sharded_parallel: offload={offload!r} is not supported: "
                         f"fleetmpi keeps each rank's shard in the memory of the device it "
                         f"trains on and has no offload to host memory; pass offload=False")
    for name, value in (("group", group), ("dp_group", dp_group)):
        if value is not None:
            raise ValueError(f"group_sharded_parallel: {name} must be None: the sharding group "
                             f"is the whole world here; for sharding groups smaller than the "
                             f"world with data-parallel replicas of them, set "
                             f"strategy.sharding_configs hybrid_dp and sharding_degree and "
                             f"call fleet.distributed_optimizer")
    if exclude_layer:
        raise ValueError(f"group_sharded_parallel: exclude_layer={exclude_layer!r} is not "
                         f"supported: stage 3 partitions every parameter of the optimizer")


def _checked(name, value, kind):
    if kind is bool and not isinstance(value, bool):
        raise ValueError(f"group_sharded_parallel: {name} must be True or False, not "
                         f"{value!r}")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"group_sharded_parallel: {name} must be a positive int (elements), "
                         f"not {value!r}")
    return value


def _sync_buffers_hook(layer, inputs):
    """Broadcast the model's buffers from rank 0 (``sync_buffers``)."""
    from .comm import get_communicator

    buffers = [b for _, b in layer.named_buffers()]
    if buffers and world.worker_num() > 1:
        get_communicator().broadcast_many(buffers, root=0)


def group_sharded_parallel(model, optimizer, level, scaler=None, group=None, offload=False,
                           sync_buffers=False, buffer_max_size=BUFFER_MAX_SIZE,
                           segment_size=SEGMENT_SIZE, sync_comm=False, dp_group=None,
                           exclude_layer=None):
    """``(model, optimizer, scaler)`` sharded at ``level`` over the world (module
    docstring): the model through ``fleet.distributed_model``, the optimizer (a
    ``fleetmpi.optimizer`` one over ``model.parameters()``) through
    ``fleet.distributed_optimizer`` with ``sharding`` at the level's stage."""
    stage = _stage(level)
    _refuse_unsupported(scaler, group, offload, dp_group, exclude_layer)
    for name, value, kind in (("sync_buffers", sync_buffers, bool), ("sync_comm", sync_comm, bool),
                              ("buffer_max_size", buffer_max_size, int),
                              ("segment_size", segment_size, int)):
        _checked(name, value, kind)
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"group_sharded_parallel: optimizer must be a fleetmpi.optimizer "
                        f"optimizer over model.parameters(), not {type(optimizer).__name__}")
    if segment_size != SEGMENT_SIZE:
        logger.warning(f"group_sharded_parallel: segment_size={segment_size} has no effect in "
                       f"fleetmpi: every parameter is partitioned, however small")
    itemsize = np.dtype(optimizer.parameters()[0].dtype).itemsize
    strategy = DistributedStrategy()
    strategy.sharding = True
    strategy.sharding_configs = {"stage": stage}
    strategy.fuse_grad_size_in_MB = max(1, math.ceil(buffer_max_size * itemsize / 2 ** 20))
    model = distributed_model(model)
    if sync_buffers:
        model.register_forward_pre_hook(_sync_buffers_hook)
    optimizer = distributed_optimizer(optimizer, strategy)
    if stage == 3:
        model.get_all_parameters = _AllParameters(optimizer.strategies["sharding"].gatherer)
    return model, optimizer, scaler


class _AllParameters:
    """``get_all_parameters(convert2cpu=False)`` of a stage-3 model (module docstring)."""

    def __init__(self, gatherer):
        self._gatherer = gatherer

    def __call__(self, convert2cpu=False):
        if convert2cpu:
            raise ValueError("get_all_parameters: convert2cpu=True is Paddle's offload, which "
                             "fleetmpi does not have; the whole parameters stay on the device "
                             "the model trains on (call it with convert2cpu=False)")
        self._gatherer.gather_all()


def _whole_optimizer_state(optimizer):
    """The optimizer's ``state_dict`` with every state array gathered whole from the shards
    (a collective over the sharding group)."""
    inner = optimizer.inner
    state = inner.state_dict()
    state.pop("gradient.shard", None)
    if "shard" not in state:
        return state
    sharding = optimizer.strategies["sharding"]
    offsets = sharding.offsets
    counts = [offsets[r + 1] - offsets[r] for r in range(len(offsets) - 1)]
    for name in inner.state_names:
        piece = state[f"{name}.shard"]
        if sharding.group is not None:
            piece = sharding.group.allgatherv(np.ascontiguousarray(piece), counts)
        state[f"{name}.shard"] = piece
    # An array: fleetmpi.save stores no lists.
    state["shard"] = np.array([0, inner.space_size, inner.space_size], dtype=np.int64)
    return state


def save_group_sharded_model(model, output, optimizer=None):
    """Write ``output/model.pdmodel`` and, given the optimizer ``group_sharded_parallel``
    returned, ``output/model.pdopt`` (module docstring). Every rank calls it: the
    parameters (left whole under ``"p_g_os"``) and the optimizer state are gathered from the
    shards; rank 0 writes."""
    if os.path.isfile(output):
        raise ValueError(f"save_group_sharded_model: output {output!r} is a file; it must be "
                         f"a folder (made if missing)")
    if optimizer is not None and not (isinstance(optimizer, DistributedOptimizer)
                                      and "sharding" in optimizer.strategies):
        raise TypeError(f"save_group_sharded_model: optimizer must be the one "
                        f"group_sharded_parallel returned, not a {type(optimizer).__name__}")
    gather = getattr(model, "get_all_parameters", None)
    if isinstance(gather, _AllParameters):
        gather()
    model_state = model.state_dict()
    optimizer_state = None if optimizer is None else _whole_optimizer_state(optimizer)
    if world.worker_index() == 0:
        os.makedirs(output, exist_ok=True)
        save(model_state, os.path.join(output, MODEL_FILE))
        if optimizer_state is not None:
            save(optimizer_state, os.path.join(output, OPTIMIZER_FILE))
    world.barrier_worker()

"""What a ``DistributedStrategy`` turns into in one job: the strategies that run, and, for every
field a user set that changes nothing here, why.

``fleet.applied_strategy()`` returns an ``AppliedStrategy``: the strategy that runs (with
``auto`` resolved into the fields its calibration chose), saved and loaded like any other, plus
``active`` (the step hooks, outermost first), ``not_applied`` (field path: why) and, after
``auto``, ``calibration`` (the measurements that decided it). The startup log shows the same:
the active strategies at INFO, every field that is not applied as a warning on the first worker.
"""
import os
import types

from fleetmpi.config import schema_view
from fleetmpi.core import job, knobs, paddle_flags
from fleetmpi.config.distributed_strategy import DistributedStrategy
from fleetmpi.core.log import logger
from fleetmpi.nn import BatchNorm, Sequential
from fleetmpi.nn.functional import cudnn
from fleetmpi.config.paddle_fields import PADDLE_ONLY
from . import amp_precision
from .compose import ORDER
from .configs import AMPConfig, HybridConfig, RecomputeConfig, ShardingConfig, TensorParallelConfig
from .field_effects import IN_PARAMETER_SERVER_MODE, NO_EFFECT, NO_EFFECT_KEYS
from .inert_fields import inert_fields_set, report_once

# Fields that only change what cuDNN does (fleetmpi.nn.functional.cudnn);
# cudnn_batchnorm_spatial_persistent changes nothing anywhere (field_effects).
CUDNN_FIELDS = ("cudnn_exhaustive_search", "conv_workspace_size_limit")
# Fields that only shape how gradients travel between ranks.
COMMUNICATION_FIELDS = ("fuse_all_reduce_ops", "fuse_grad_size_in_MB", "fuse_grad_size_in_TFLOPS",
                        "last_comm_group_size_MB", "find_unused_parameters", "nccl_comm_num",
                        "use_hierarchical_allreduce", "hierarchical_allreduce_inter_nranks")
_ALONE = "this process trains alone ({}), so there are no gradients to exchange"
# Strategies whose whole effect is between ranks, and what a process alone lacks for them.
_ALONE_SWITCHES = {
    "fp16_allreduce": "gradients to exchange",
    "sync_batch_norm": "batch statistics of other ranks to combine",
    "localsgd": "parameters of other ranks to average",
    "adaptive_localsgd": "parameters of other ranks to average",
    "sharding": "other ranks to hold parts of the optimizer state",
}


def changed(strategy, default, name):
    """Whether top-level field ``name`` of ``strategy`` differs from ``default``'s."""
    value, base = getattr(strategy, name), getattr(default, name)
    if hasattr(value, "keys"):
        return dict(value) != dict(base)
    return value != base


def _in_every_mode(strategy, on_gpu):
    """The reasons that do not depend on the mode: Paddle-only fields of a loaded file,
    ``elastic`` outside ``fleetmpirun --elastic``, ``FLAGS_*`` variables not read, and the
    cuDNN fields where cuDNN does not run."""
    reasons = {path: f"a field of Paddle's DistributedStrategy that fleetmpi does not have: "
                     f"{PADDLE_ONLY[path]}" for path in strategy.paddle_only_fields()}
    if strategy.elastic and knobs.RESTART_COUNT.name not in os.environ:
        reasons["elastic"] = ("the job was not started by fleetmpirun --elastic, so nothing "
                              "restarts it after a failure")
    reasons.update(paddle_flags.unread(on_gpu))
    reasons.update(_cudnn_reasons(strategy, on_gpu))
    return reasons


def _cudnn_reasons(strategy, on_gpu):
    """The cuDNN fields set where cuDNN does not run: on the CPU, or on a GPU where it is not
    usable."""
    why = cudnn.unusable_reason() if on_gpu else cudnn.ON_CPU
    if why is None:
        return {}
    default = DistributedStrategy()
    return {name: f"{why}: {cudnn.WITHOUT_CUDNN}" for name in CUDNN_FIELDS
            if changed(strategy, default, name)}


def not_applied(strategy, communicator, on_gpu, hooks=()):
    """``{field path: why}`` for every field of ``strategy`` set away from its default that
    changes nothing in a collective job with ``communicator`` (None: one process) on a GPU or
    not, running the step ``hooks`` (the strategies' objects)."""
    default = DistributedStrategy()
    reasons = {path: NO_EFFECT[path] for path in inert_fields_set(strategy)}
    reasons.update(_in_every_mode(strategy, on_gpu))
    for name in ORDER:
        configs = f"{name}_configs"
        if hasattr(default, configs) and not getattr(strategy, name) \
                and changed(strategy, default, configs):
            reasons[configs] = f"strategy {name} is off, so its configs are not used"
    reasons.update(_strategy_reasons(strategy, on_gpu))
    by_name = {hook.name: hook for hook in hooks}
    if communicator is None or communicator.size == 1:
        alone = _ALONE.format("local=True" if communicator is None else "one rank")
        _communication(strategy, default, reasons, alone)
        for name, lacking in _ALONE_SWITCHES.items():
            if getattr(strategy, name):
                reasons[name] = alone.replace("gradients to exchange", lacking)
        return _with_configs_of_unused(strategy, default, reasons)
    if "sharding" in by_name:
        _sharding_reasons(strategy, default, by_name["sharding"], reasons)
    if "pipeline" in by_name and by_name["pipeline"].layout.replicas == 1:
        _communication(strategy, default, reasons,
                       "every pipeline stage has one replica here (world = stages), so no "
                       "gradients are exchanged")
    if not strategy.fuse_all_reduce_ops:
        for name in ("fuse_grad_size_in_MB", "fuse_grad_size_in_TFLOPS",
                     "last_comm_group_size_MB"):
            if changed(strategy, default, name):
                reasons.setdefault(name, "fuse_all_reduce_ops is off: one allreduce per "
                                         "parameter")
    if not strategy.use_hierarchical_allreduce \
            and changed(strategy, default, "hierarchical_allreduce_inter_nranks"):
        reasons.setdefault("hierarchical_allreduce_inter_nranks",
                           "use_hierarchical_allreduce is off")
    return _with_configs_of_unused(strategy, default, reasons)


def _with_configs_of_unused(strategy, default, reasons):
    """A strategy that is on but has no effect here leaves its configs without effect too."""
    for name in ORDER:
        configs = f"{name}_configs"
        if name in reasons and hasattr(default, configs) \
                and changed(strategy, default, configs):
            reasons[configs] = f"strategy {name} has no effect here: {reasons[name]}"
    return reasons


def _communication(strategy, default, reasons, why):
    for name in COMMUNICATION_FIELDS:
        if changed(strategy, default, name):
            reasons[name] = why


def _sharding_reasons(strategy, default, sharding, reasons):
    """What sharding's own communication leaves unused (``fleetmpi.strategies.sharding``)."""
    flat = ("sharding reduce-scatters over its group and averages over the replicas with "
            "one-level communicators; there is no two-level allreduce")
    for name in ("use_hierarchical_allreduce", "hierarchical_allreduce_inter_nranks"):
        if changed(strategy, default, name):
            reasons[name] = flat
    if changed(strategy, default, "last_comm_group_size_MB"):
        reasons["last_comm_group_size_MB"] = (
            "sharding reduce-scatters each gradient bucket before backward goes on, so no "
            "bucket's reduction overlaps backward and the last one's size shortens nothing")
    if changed(strategy, default, "find_unused_parameters"):
        reasons["find_unused_parameters"] = (
            "sharding reduces a parameter without a gradient as zeros without looking for "
            "one, so there is no warning for the field to silence")
    if sharding.stage == 1:
        for name in ("fuse_all_reduce_ops", "fuse_grad_size_in_MB", "fuse_grad_size_in_TFLOPS"):
            if changed(strategy, default, name):
                reasons[name] = ("sharding stage 1 reduce-scatters the whole gradient space at "
                                 "once; gradient buckets exist from stage 2 on")
    config, defaults = sharding.config, ShardingConfig.of(default)
    if sharding.group is None and config.fuse_broadcast_MB != defaults.fuse_broadcast_MB:
        reasons["sharding_configs.fuse_broadcast_MB"] = (
            "a sharding group of one rank broadcasts no shards")
    if sharding.stage < 3:
        for key in ("prefetch_depth", "unit_size_MB"):
            if getattr(config, key) != getattr(defaults, key):
                reasons[f"sharding_configs.{key}"] = (
                    f"stage {sharding.stage} keeps the parameters whole; units are gathered "
                    "from stage 3 on")
    elif sharding.group is None and config.prefetch_depth != defaults.prefetch_depth:
        reasons["sharding_configs.prefetch_depth"] = (
            "a sharding group of one rank copies its units instead of gathering them; there "
            "is nothing to run ahead")
    if config.hybrid_dp and sharding.replicas is None:
        reasons["sharding_configs.hybrid_dp"] = (
            f"the sharding group is the whole world of {sharding.world_size} rank(s), so there "
            "are no data-parallel replicas")
    if not config.hybrid_dp:
        for key in ("sharding_group_size", "sharding_degree"):
            if getattr(config, key) != getattr(defaults, key):
                reasons[f"sharding_configs.{key}"] = (
                    "without hybrid_dp the sharding group is the whole world")
    if changed(strategy, default, "nccl_comm_num") and \
            (sharding.stage == 3 or sharding.group is None):
        reasons["nccl_comm_num"] = (
            "under sharding nccl_comm_num spreads the broadcasts of the updated shards over "
            "communicators, and here none are broadcast ("
            + ("stage 3 gathers parameters when they are used)" if sharding.stage == 3
               else "a sharding group of one rank)"))


def _strategy_reasons(strategy, on_gpu):
    """Config keys that the enabled strategies leave unused in this configuration."""
    reasons = {}
    recompute = RecomputeConfig.of(strategy)
    if strategy.recompute and recompute.enable_offload and not on_gpu:
        reasons["recompute_configs.enable_offload"] = (
            "on CPU host and device memory are the same: checkpoints are copied to host "
            "buffers, but no device memory is freed")
    if strategy.recompute and not recompute.enable_offload and recompute.checkpoint_shape:
        reasons["recompute_configs.checkpoint_shape"] = (
            "it sizes the host buffers of enable_offload, which is off")
    if strategy.amp:
        reasons.update(amp_precision.unused_keys(AMPConfig.of(strategy),
                                                 AMPConfig.of(DistributedStrategy())))
    if strategy.tensor_parallel \
            and TensorParallelConfig.of(strategy).tensor_parallel_degree == 1 \
            and HybridConfig.of(strategy).mp_degree == 1:
        reasons["tensor_parallel"] = ("tensor_parallel_degree is 1: no weight is split over "
                                      "ranks")
    if (strategy.lars or strategy.lamb) and strategy.build_strategy.fuse_all_optimizer_ops:
        reasons["build_strategy.fuse_all_optimizer_ops"] = (
            f"{'lars' if strategy.lars else 'lamb'} scales each parameter's update by its own "
            "trust ratio, walking the parameters one by one; there is no fused optimizer "
            "kernel over the flat buffer")
    return reasons


_PARAMETER_SERVER = ("parameter-server mode trains with a_sync and a_sync_configs.k_steps; "
                     "the collective strategies, communication and graph fields do not exist "
                     "there")


def parameter_server_not_applied(strategy, on_gpu):
    """``{field path: why}`` for every field set away from its default in parameter-server
    mode, where ``a_sync`` and ``a_sync_configs.k_steps`` alone choose what runs
    (``fleetmpi.strategies.ps.mode``)."""
    reasons = {}
    for path, _ in schema_view.differences(strategy._message, DistributedStrategy()._message):
        configs, _, key = path.partition(".")
        if path == "a_sync_configs.k_steps" and not strategy.a_sync:
            reasons[path] = ("a_sync is off: synchronous training pushes every step, whatever "
                             "k_steps says")
            continue
        if path in IN_PARAMETER_SERVER_MODE:
            continue
        reasons[path] = NO_EFFECT_KEYS[key] if configs == "a_sync_configs" else \
            _PARAMETER_SERVER
    reasons.update(_in_every_mode(strategy, on_gpu))
    for name in paddle_flags.FIELD_FLAGS:
        if os.environ.get(name, ""):
            reasons[name] = _PARAMETER_SERVER
    return reasons


_FUSION_FIELDS = {
    "build_strategy.fuse_elewise_add_act_ops": "a Linear or Conv2D with bias followed by an "
                                               "activation",
    "build_strategy.fuse_bn_act_ops": "a BatchNorm followed by a ReLU",
}


def unfused(strategy, model):
    """``{field path: why}`` for each kernel-fusion field that is on while ``model`` holds no
    pair of layers it fuses: fusion applies to neighbouring layers of an ``nn.Sequential``."""
    wanted = {"build_strategy.fuse_elewise_add_act_ops":
              bool(strategy.build_strategy.fuse_elewise_add_act_ops),
              "build_strategy.fuse_bn_act_ops": bool(strategy.build_strategy.fuse_bn_act_ops)}
    fused = dict.fromkeys(wanted, 0)
    for _, layer in model.named_sublayers(include_self=True):
        if isinstance(layer, Sequential):
            for step_layer, act in layer.steps():
                if act is not None:
                    kind = "build_strategy.fuse_bn_act_ops" if isinstance(step_layer, BatchNorm) \
                        else "build_strategy.fuse_elewise_add_act_ops"
                    fused[kind] += 1
    return {path: f"the model has no nn.Sequential holding {_FUSION_FIELDS[path]}, the pairs "
                  "this fuses" for path, on in wanted.items() if on and not fused[path]}


class AppliedStrategy(DistributedStrategy):
    """The ``DistributedStrategy`` a job runs, with ``active``, ``not_applied`` and
    ``calibration`` (see the module docstring). It equals any ``DistributedStrategy`` with the
    same fields, so a copy saved with ``save_to_prototxt`` and loaded again compares equal."""

    active = ()
    not_applied = types.MappingProxyType({})
    calibration = None

    @classmethod
    def of(cls, strategy, active, reasons, calibration=None):
        applied = cls()
        applied._message.CopyFrom(strategy._message)
        object.__setattr__(applied, "_paddle_only", strategy._paddle_only)
        object.__setattr__(applied, "active", tuple(active))
        object.__setattr__(applied, "not_applied", types.MappingProxyType(dict(reasons)))
        object.__setattr__(applied, "calibration", calibration)
        return applied

    def with_reasons(self, reasons):
        """This applied strategy with ``reasons`` (``{field path: why}``) added to
        ``not_applied``."""
        return AppliedStrategy.of(self, self.active, {**self.not_applied, **reasons},
                                  self.calibration)

    def __eq__(self, other):
        if not isinstance(other, DistributedStrategy):
            return False
        return not schema_view.differences(self._message, other._message) and \
            dict(self._paddle_only) == dict(other._paddle_only)

    def __ne__(self, other):
        return not self == other

    __hash__ = None

    def __deepcopy__(self, memo):
        copy = DistributedStrategy.__deepcopy__(self, memo)
        for name in ("active", "not_applied", "calibration"):
            object.__setattr__(copy, name, getattr(self, name))
        return copy

    def summary(self):
        """The active strategies and every field that is not applied, one line each."""
        lines = [f"active: {', '.join(self.active) if self.active else 'none (one process)'}"]
        lines += [f"not applied: {path}: {why}" for path, why in self.not_applied.items()]
        return "\n".join(lines)

    def __str__(self):
        text = DistributedStrategy.__str__(self).replace("DistributedStrategy", "AppliedStrategy",
                                                         1)
        return f"{text}\n{self.summary()}"

    __repr__ = __str__


def report(applied):
    """Log what ``applied`` runs (INFO) and warn about each field it does not apply (first
    worker only, once per field and process)."""
    try:
        first = job.worker_index() == 0
    except RuntimeError:  # local=True before fleet.init(): a process on its own
        first = True
    if first:
        logger.info("strategies active: %s", ", ".join(applied.active) or "none")
    for path, why in applied.not_applied.items():
        report_once(path, why, first)

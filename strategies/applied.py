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

from .. import config_message as cm
from .. import world
from ..distributed_strategy import DistributedStrategy
from ..elastic import RESTART_COUNT_ENV
from ..log import logger
from ..nn import BatchNorm, Sequential
from ..paddle_fields import PADDLE_ONLY
from .compose import ORDER
from .inert_fields import NO_EFFECT, inert_fields_set, report_once

# Fields that only shape how gradients travel between ranks.
COMMUNICATION_FIELDS = ("fuse_all_reduce_ops", "fuse_grad_size_in_MB", "fuse_grad_size_in_TFLOPS",
                        "nccl_comm_num", "use_hierarchical_allreduce",
                        "hierarchical_allreduce_inter_nranks")
_ALONE = "this process trains alone ({}), so there are no gradients to exchange"


def changed(strategy, default, name):
    """Whether top-level field ``name`` of ``strategy`` differs from ``default``'s."""
    value, base = getattr(strategy, name), getattr(default, name)
    if hasattr(value, "keys"):
        return dict(value) != dict(base)
    return value != base


def not_applied(strategy, communicator, on_gpu):
    """``{field path: why}`` for every field of ``strategy`` set away from its default that
    changes nothing in a job with ``communicator`` (None: one process) on a GPU or not."""
    default = DistributedStrategy()
    reasons = {path: NO_EFFECT[path] for path in inert_fields_set(strategy)}
    reasons.update({path: f"a field of Paddle's DistributedStrategy that fleetmpi does not have: "
                          f"{PADDLE_ONLY[path]}" for path in strategy.paddle_only_fields()})
    for name in ORDER:
        configs = f"{name}_configs"
        if hasattr(default, configs) and not getattr(strategy, name) \
                and changed(strategy, default, configs):
            reasons[configs] = f"strategy {name} is off, so its configs are not used"
    if strategy.elastic and RESTART_COUNT_ENV not in os.environ:
        reasons["elastic"] = ("the job was not started by fleetmpirun --elastic, so nothing "
                              "restarts it after a failure")
    if communicator is None or communicator.size == 1:
        alone = _ALONE.format("local=True" if communicator is None else "one rank")
        for name in COMMUNICATION_FIELDS:
            if changed(strategy, default, name):
                reasons[name] = alone
        if strategy.fp16_allreduce:
            reasons["fp16_allreduce"] = alone
        return _with_cpu_reasons(strategy, on_gpu, reasons)
    if not strategy.fuse_all_reduce_ops:
        for name in ("fuse_grad_size_in_MB", "fuse_grad_size_in_TFLOPS"):
            if changed(strategy, default, name):
                reasons[name] = "fuse_all_reduce_ops is off: one allreduce per parameter"
    if not strategy.use_hierarchical_allreduce \
            and changed(strategy, default, "hierarchical_allreduce_inter_nranks"):
        reasons["hierarchical_allreduce_inter_nranks"] = "use_hierarchical_allreduce is off"
    return _with_cpu_reasons(strategy, on_gpu, reasons)


def _with_cpu_reasons(strategy, on_gpu, reasons):
    if strategy.recompute and not on_gpu and strategy.recompute_configs["enable_offload"]:
        reasons["recompute_configs.enable_offload"] = (
            "on CPU host and device memory are the same: checkpoints are copied to host "
            "buffers, but no device memory is freed")
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
            for step_layer, act in layer.plan():
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
        return not cm.differences(self._message, other._message) and \
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
        first = world.worker_index() == 0
    except RuntimeError:  # local=True before fleet.init(): a process on its own
        first = True
    if first:
        logger.info("strategies active: %s", ", ".join(applied.active) or "none")
    for path, why in applied.not_applied.items():
        report_once(path, why, first)

"""Which strategies a DistributedStrategy enables, in which order their hooks run, and which
of them cannot be combined.

``ORDER`` lists the strategies outermost first: a strategy's forward, backward, reduce, update
and after-step methods wrap those of every strategy after it, and ``on_gradient`` is called in
this order. The gradient reduction (``fp16_allreduce`` or the plain one) is always innermost, so
the strategies before it see gradients before they travel (gradient_merge folds its
accumulator in) and act on the averaged gradients after (amp's unscale and overflow check, the
lars/lamb update). With ``sharding`` its reduce-scatter is the gradient reduction (with
float16 on the wire under ``fp16_allreduce``), and its update broadcasts the shards back;
under ``pipeline`` it partitions each stage over that stage's replicas. The non-finite check
(``nonfinite``), where it runs, comes last before the gradient reduction, whose buckets it
checks before they travel.
``python -m fleetmpi.docs regenerate`` writes ``docs/strategy_pairs.md`` from ``ORDER`` and
``CONFLICTS``.
"""
import importlib
import itertools

from .sharding import WITH_PIPELINE

ORDER = ("sync_batch_norm", "recompute", "amp", "gradient_merge", "localsgd",
         "adaptive_localsgd", "lars", "lamb", "dgc", "tensor_parallel", "pipeline",
         "fp16_allreduce", "sharding")

_CLASSES = {
    "sync_batch_norm": "sync_batch_norm:SyncBatchNorm",
    "recompute": "recompute:Recompute",
    "amp": "amp:AMP",
    "gradient_merge": "gradient_merge:GradientMerge",
    "localsgd": "localsgd:LocalSGD",
    "adaptive_localsgd": "localsgd:AdaptiveLocalSGD",
    "lars": "lars_lamb:LARS",
    "lamb": "lars_lamb:LAMB",
    "dgc": "dgc:DGC",
    "tensor_parallel": "tensor_parallel:TensorParallel",
    "pipeline": "pipeline:Pipeline",
    "fp16_allreduce": "gradient_allreduce:FP16AllReduce",
    "sharding": "sharding:Sharding",
}

# Not a strategy with hooks of its own: distributed_optimizer replaces it by the strategy its
# calibration measures best (fleetmpi.strategies.auto).
SEARCHED = ("auto",)


def _nested_schedules(averaging):
    return (f"{averaging} averages parameters on its own schedule after begin_step while "
            "gradient_merge communicates only every k_steps-th step; both decide on which "
            "steps the ranks communicate, and the two schedules cannot be nested")


def _across_stages(other, what):
    return (f"{other} {what} over every rank as if each held the whole model, while under "
            "pipeline a rank holds one stage and only the replicas of that stage share it")


def _no_gradient_exchange(averaging):
    return (f"{averaging} exchanges parameters, not gradients, after begin_step, so there is "
            "no gradient exchange for dgc to compress")


def _sharded_state(partner):
    return (f"{partner} updates every parameter on every rank from that rank's own optimizer "
            "state, while sharding keeps each rank's optimizer state for its own shard of the "
            "parameters only")


def _whole_tensor_norms(partner):
    return (f"{partner} scales each parameter tensor's step by norms of the whole tensor, "
            "while sharding cuts tensors between the ranks that update them")


def _split_tensors(partner, what):
    return (f"{partner} {what}, while tensor_parallel splits weight tensors over the ranks of "
            "a model-parallel group, each rank holding and updating its own part")


CONFLICTS = {
    frozenset({"lars", "lamb"}): "lars and lamb both replace the optimizer's update rule "
                                 "(lars needs Momentum, lamb needs Adam); enable one",
    frozenset({"dgc", "lars"}): "dgc applies momentum on each rank before sparsifying and then "
                                "a plain SGD step, so there is no Momentum update left for "
                                "lars to scale",
    frozenset({"dgc", "lamb"}): "dgc needs a Momentum optimizer and lamb an Adam optimizer",
    frozenset({"dgc", "amp"}): "dgc keeps residual gradients across steps; a step amp skips for "
                               "overflow would already have moved them, and a loss-scale "
                               "change would mix scales inside them",
    frozenset({"dgc", "localsgd"}): _no_gradient_exchange("localsgd"),
    frozenset({"dgc", "adaptive_localsgd"}): _no_gradient_exchange("adaptive_localsgd"),
    frozenset({"dgc", "fp16_allreduce"}): "dgc exchanges sparse (index, value) pairs by "
                                          "allgather instead of the dense allreduce that "
                                          "fp16_allreduce compresses",
    frozenset({"localsgd", "adaptive_localsgd"}): "localsgd and adaptive_localsgd are two "
                                                  "schedules for the same parameter averaging; "
                                                  "enable one",
    frozenset({"localsgd", "gradient_merge"}): _nested_schedules("localsgd"),
    frozenset({"adaptive_localsgd", "gradient_merge"}): _nested_schedules("adaptive_localsgd"),
    frozenset({"pipeline", "sync_batch_norm"}): "pipeline runs batch norm on one micro-batch "
                                                "at a time, so there is no whole batch whose "
                                                "statistics sync_batch_norm could gather",
    frozenset({"pipeline", "dgc"}): _across_stages("dgc", "exchanges sparse gradients"),
    frozenset({"pipeline", "localsgd"}): _across_stages("localsgd", "averages parameters"),
    frozenset({"pipeline", "adaptive_localsgd"}): _across_stages("adaptive_localsgd",
                                                                 "averages parameters"),
    frozenset({"localsgd", "sharding"}): _sharded_state("localsgd"),
    frozenset({"adaptive_localsgd", "sharding"}): _sharded_state("adaptive_localsgd"),
    frozenset({"dgc", "sharding"}): "dgc keeps momentum and residuals of every parameter on "
                                    "every rank and exchanges sparse gradients by allgather, "
                                    "while sharding reduce-scatters dense gradients to the "
                                    "owner of each shard, the only rank holding its state",
    frozenset({"lars", "tensor_parallel"}): _split_tensors("lars", "scales each parameter "
                                                           "tensor's step by norms of the "
                                                           "whole tensor"),
    frozenset({"lamb", "tensor_parallel"}): _split_tensors("lamb", "scales each parameter "
                                                           "tensor's step by norms of the "
                                                           "whole tensor"),
    frozenset({"dgc", "tensor_parallel"}): _split_tensors("dgc", "keeps the largest entries "
                                                          "of each whole gradient tensor"),
    frozenset({"lars", "sharding"}): _whole_tensor_norms("lars"),
    frozenset({"lamb", "sharding"}): _whole_tensor_norms("lamb"),
}


# Pairs that combine with a restriction the strategies check themselves, and what it is.
LIMITS = {
    frozenset({"pipeline", "sharding"}): f"sharding {WITH_PIPELINE}",
}


def strategy_class(name):
    module, cls = _CLASSES[name].split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), cls)


def enabled_strategies(strategy):
    """The names of the strategies ``strategy`` enables, in ``ORDER``."""
    return [name for name in ORDER if getattr(strategy, name)]


def check_combination(names):
    """Raise a ValueError naming the first pair of ``names`` that collides, and why."""
    for a, b in itertools.combinations(names, 2):
        reason = CONFLICTS.get(frozenset({a, b}))
        if reason is not None:
            raise ValueError(f"strategies {a} and {b} cannot be combined: {reason}")


def build_strategies(strategy, optimizer, communicator, agreement=None):
    """The hooks of every strategy ``strategy`` enables, outermost first, ending with the
    gradient reduction when there is more than one rank (sharding's own, when enabled);
    refuses what cannot work before building anything. ``agreement``: the ranks that must
    share amp's decision to skip a step, when they are more than ``communicator``'s (every
    rank of a hybrid layout; ``fleetmpi.hybrid``)."""
    from .gradient_allreduce import GradientAllreduce

    if strategy.auto:
        raise ValueError("strategy.auto is resolved by fleet.distributed_optimizer, which "
                         "measures the candidates; build the strategies of the result "
                         "(fleet.applied_strategy()) instead")
    names = enabled_strategies(strategy)
    check_combination(names)
    classes = [strategy_class(name) for name in names]
    for cls in classes:
        cls.check(strategy, optimizer)
    # A strategy that lays the ranks out is built first: it narrows the optimizer to this
    # rank's part before the other strategies see it, and its replicas are the ranks that
    # average the gradients of that part.
    layout_class = next((cls for cls in classes if cls.lays_out_ranks), None)
    layout = None if layout_class is None else layout_class(strategy, optimizer, communicator)
    replicas = communicator if layout is None else layout.replica_communicator
    scopes = {"world": communicator, "replicas": replicas,
              "agreement": agreement or communicator}
    hooks = [layout if cls is layout_class
             else cls(strategy, optimizer, scopes[cls.communicator_scope])
             for cls in classes if not cls.is_gradient_reduction]
    if replicas is not None and replicas.size > 1 \
            and not any(cls.reduces_gradients for cls in classes):
        reduction = next((cls for cls in classes if cls.is_gradient_reduction),
                         GradientAllreduce)
        hooks.append(reduction(strategy, optimizer, scopes[reduction.communicator_scope]))
    return with_nonfinite_check(hooks, optimizer, agreement or communicator)


def with_nonfinite_check(hooks, optimizer, communicator):
    """``hooks`` with the non-finite check (``fleetmpi.strategies.nonfinite``) before the
    gradient reduction (the last hook, when it is one: the plain or fp16 allreduce, whose
    buckets it checks as they leave and which carries the verdicts where it runs over the
    ranks that agree on them, or a strategy that ``reduces_gradients`` itself, sharding),
    unless ``FLEETMPI_NONFINITE=off`` or a hook ``checks_every_update`` itself (amp's loss
    scaling)."""
    from .gradient_allreduce import GradientAllreduce
    from .nonfinite import NonFiniteCheck, nonfinite_mode

    mode = nonfinite_mode()
    if mode == "off" or any(hook.checks_every_update for hook in hooks):
        return hooks
    check = NonFiniteCheck(mode, optimizer, communicator,
                           local_steps_alone=any(hook.local_steps for hook in hooks))
    last = hooks[-1] if hooks else None
    if isinstance(last, GradientAllreduce):
        last.check_bucket = check.check_bucket
        check.buckets = last.buckets
        check.carries = last.communicator is communicator
        check.bucket_of = last.schedule.bucket_of
    elif last is None or not last.reduces_gradients:
        return hooks + [check]
    return hooks[:-1] + [check, last]

"""Hybrid parallelism from ``hybrid_configs``: the layout ``fleet.init(is_collective=True,
strategy=strategy)`` builds, ``get_hybrid_communicate_group()``, and what
``distributed_optimizer`` runs under it.

A strategy is hybrid when ``hybrid_configs`` sets a model, pipeline or sharding degree above 1,
or ``tensor_parallel`` is on with ``tensor_parallel_configs["tensor_parallel_degree"]`` above
1 (Paddle's earlier switch for the model-parallel degree; setting both to different values is
an error). Then:

* the ranks are laid out over data x pipeline x sharding x model (``fleetmpi.comm.
  hybrid_topology``), model innermost;
* tensor-parallel layers (``fleetmpi.nn.tensor_parallel``) split their weights over the
  model-parallel group;
* the strategies run over the ranks of this rank's model-parallel coordinate as over a world
  of their own: ``pipeline`` with ``pp_degree`` stages, ``sharding`` over groups of
  ``sharding_degree`` with ``hybrid_dp`` across ``dp_degree`` of them, the gradient averaging
  over the data-parallel replicas; amp's overflow decision is agreed by every rank.

``pipeline`` and ``sharding`` are switched on by their degrees; a strategy that switches them
on by hand with the degree left at 1 is refused, since the degree says how many ranks they
take.
"""
import copy
import dataclasses

from .core import backend
from .comm import hybrid_topology
from .core.rng_tracker import MODEL_PARALLEL_RNG, get_rng_state_tracker
from .comm import get_communicator
from .comm.hybrid_topology import DEGREE_NAMES, HybridCommunicateGroup, resolve_degrees
from .strategies.configs import HybridConfig, TensorParallelConfig


def hybrid_configs(strategy):
    """``hybrid_configs`` as a dict of its keys, with ``tensor_parallel_degree`` folded into
    ``mp_degree``."""
    configs = dataclasses.asdict(HybridConfig.of(strategy))
    if strategy.tensor_parallel:
        degree = TensorParallelConfig.of(strategy).tensor_parallel_degree
        if configs["mp_degree"] not in (1, degree):
            raise ValueError(f"tensor_parallel_configs['tensor_parallel_degree']={degree} "
                             f"and hybrid_configs['mp_degree']={configs['mp_degree']} both "
                             f"set the model-parallel degree; set one, or both to one value")
        configs["mp_degree"] = degree
    return configs


def is_hybrid(strategy):
    """Whether ``strategy`` asks for a hybrid layout (module docstring)."""
    configs = hybrid_configs(strategy)
    return any(configs[DEGREE_NAMES[axis]] > 1 for axis in ("model", "pipe", "sharding"))


def strategy_communicator(strategy):
    """The world's ``Communicator`` configured by the strategy's allreduce fields
    (``nccl_comm_num``, ``fuse_grad_size_in_MB``, ``use_hierarchical_allreduce``,
    ``hierarchical_allreduce_inter_nranks``; 1, the default, means ranks per node): one
    communicator per set of values, however many optimizers and layouts ask
    (``Communicator.with_options``)."""
    inter = strategy.hierarchical_allreduce_inter_nranks
    return get_communicator().with_options(
        nccl_comm_num=strategy.nccl_comm_num,
        fuse_grad_size_in_MB=strategy.fuse_grad_size_in_MB,
        use_hierarchical_allreduce=strategy.use_hierarchical_allreduce,
        hierarchical_allreduce_inter_nranks=inter if inter > 1 else None)


def model_parallel_random_seed(seed=None):
    """Paddle's ``meta_parallel.model_parallel_random_seed``: with ``seed``, reseed every
    generator with it (the same on every rank: initial weights, and the dropout of activations
    a model-parallel group holds whole); then give the tracker's ``"model_parallel_rng"`` a
    seed of this model-parallel rank's own (Paddle's ``seed * 1024 + 100 * rank``, from the
    current seed when ``seed`` is None), for the dropout of this rank's part of a split
    activation (``fleetmpi.core.rng_tracker``)."""
    if seed is not None:
        backend.manual_seed(seed)
    layout = hybrid_topology.current()
    rank = 0 if layout is None else layout.get_model_parallel_rank()
    tracker = get_rng_state_tracker()
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, backend.get_seed() * 1024 + 100 * rank)


def build_layout(strategy, topology):
    """For ``fleet.init(strategy=...)``: build and make current the layout of ``strategy``
    over the world ``topology``. ``tensor_init_seed`` >= 0 reseeds every generator; under a
    model-parallel degree above 1, ``model_parallel_random_seed`` seeds the tracker's
    ``"model_parallel_rng"`` (as Paddle's ``fleet.init``). A strategy that is not hybrid
    clears the layout."""
    if not is_hybrid(strategy):
        if HybridConfig.of(strategy).dp_degree != -1:
            resolve_degrees(hybrid_configs(strategy), topology.size)
        hybrid_topology.set_current(None)
        backend.set_model_parallel_degree(1)
        return None
    seed = TensorParallelConfig.of(strategy).tensor_init_seed
    degrees = resolve_degrees(hybrid_configs(strategy), topology.size)
    group = HybridCommunicateGroup(strategy_communicator(strategy), degrees)
    hybrid_topology.set_current(group)
    backend.set_model_parallel_degree(degrees["model"])
    if degrees["model"] > 1:
        model_parallel_random_seed(seed if seed >= 0 else None)
    elif seed >= 0:
        backend.manual_seed(seed)
    return group


def get_hybrid_communicate_group():
    """The ``HybridCommunicateGroup`` that ``fleet.init(is_collective=True, strategy=...)``
    built: this rank's coordinates and the communicator of each axis."""
    group = hybrid_topology.current()
    if group is None:
        raise RuntimeError("no hybrid layout: call fleet.init(is_collective=True, "
                           "strategy=strategy) with strategy.hybrid_configs setting mp_degree, "
                           "pp_degree or sharding_degree above 1")
    return group


def _check_switches(strategy, degrees):
    for name, axis in (("pipeline", "pipe"), ("sharding", "sharding")):
        if getattr(strategy, name) and degrees[axis] == 1:
            raise ValueError(f"strategy.{name} is on but hybrid_configs['{DEGREE_NAMES[axis]}']"
                             f" is 1: under hybrid_configs the degree sets how many ranks "
                             f"{name} takes; set it (which switches {name} on) instead")


def running_strategy(strategy, degrees):
    """A copy of ``strategy`` with the strategies the degrees switch on: ``pipeline`` for
    ``pp_degree`` > 1, ``sharding`` for ``sharding_degree`` > 1 (groups of that size, with
    ``hybrid_dp`` when ``dp_degree`` > 1), ``tensor_parallel`` for ``mp_degree`` > 1."""
    _check_switches(strategy, degrees)
    running = copy.deepcopy(strategy)
    running.pipeline = degrees["pipe"] > 1
    running.tensor_parallel = degrees["model"] > 1
    if degrees["sharding"] > 1:
        running.sharding = True
        running.sharding_configs = {"sharding_degree": degrees["sharding"],
                                    "sharding_group_size": degrees["sharding"],
                                    "hybrid_dp": degrees["data"] > 1}
    return running


class HybridRun:
    """What ``distributed_optimizer`` runs under a hybrid strategy: ``strategy`` (with the
    switches the degrees imply), ``communicator`` (the ranks of this model-parallel
    coordinate, None alone) and ``agreement`` (every rank, for decisions all must share)."""

    def __init__(self, strategy, communicator, agreement, group):
        self.strategy, self.communicator, self.agreement, self.group = \
            strategy, communicator, agreement, group


def run_of(strategy, optimizer, world_communicator, local):
    """The ``HybridRun`` of ``strategy`` for ``optimizer``, or None when it is not hybrid.
    Refuses degrees whose product is not the world size (naming each), a layout other than
    the one ``fleet.init`` built, and a model whose pipeline stages are not ``pp_degree``."""
    world_size = 1 if local or world_communicator is None else world_communicator.size
    if not is_hybrid(strategy):
        if not local and HybridConfig.of(strategy).dp_degree != -1:
            resolve_degrees(hybrid_configs(strategy), world_size)
        layout = hybrid_topology.current()
        if not local and layout is not None and layout.degrees["model"] > 1:
            raise ValueError(f"fleet.init laid the ranks out with {_named(layout.degrees)}, "
                             f"so tensor-parallel layers hold parts of their weights, but this "
                             f"strategy has no hybrid degrees; pass the same strategy to "
                             f"fleet.init and distributed_optimizer")
        return None
    from .strategies.pipeline_stages import stage_count

    configs = hybrid_configs(strategy)
    if local:
        degrees = {axis: configs[DEGREE_NAMES[axis]] for axis in DEGREE_NAMES}
        degrees["data"] = max(degrees["data"], 1)
    else:
        degrees = resolve_degrees(configs, world_size)
    stages = stage_count(optimizer.parameters())
    if stages != degrees["pipe"]:
        raise ValueError(f"hybrid_configs['pp_degree']={degrees['pipe']} but the model has "
                         f"{stages} pipeline stage(s); build it with fleet.device_guard("
                         f"'stage:N') for N in 0..{degrees['pipe'] - 1} (or as a "
                         f"PipelineLayer of num_stages={degrees['pipe']}), or set pp_degree to "
                         f"{stages}")
    running = running_strategy(strategy, degrees)
    if local or world_communicator is None:
        return HybridRun(running, None, None, None)
    group = hybrid_topology.current()
    if group is None or group.communicator.size != world_size:
        group = HybridCommunicateGroup(world_communicator, degrees)
        hybrid_topology.set_current(group)
        backend.set_model_parallel_degree(degrees["model"])
    elif group.degrees != degrees:
        raise ValueError(f"the strategy's hybrid degrees {_named(degrees)} differ from the "
                         f"layout fleet.init built ({_named(group.degrees)}); pass the same "
                         f"strategy to fleet.init and distributed_optimizer")
    return HybridRun(running, group.data_communicator, world_communicator, group)


def _named(degrees):
    return ", ".join(f"{DEGREE_NAMES[axis]}={degrees[axis]}" for axis in DEGREE_NAMES)


def parameter_communicator(world_communicator):
    """The ranks whose parameters must start equal, for ``distributed_model``: those of this
    rank's model-parallel coordinate under a hybrid layout with ``mp_degree`` > 1 (None
    alone), the world otherwise (tensor-parallel layers hold different parts on the ranks of
    a model-parallel group)."""
    group = hybrid_topology.current()
    if group is None or group.degrees["model"] == 1:
        return world_communicator
    return group.data_communicator

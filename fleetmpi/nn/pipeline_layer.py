"""``PipelineLayer``, ``LayerDesc`` and ``SharedLayerDesc``: a model written as a list of
layers, cut into pipeline stages, where each process builds only the layers of its own stage
(Paddle's ``fleet.meta_parallel`` names and arguments).

``layers`` holds ``LayerDesc(layer_class, *args, **kwargs)`` (built on the stage that runs
it), ``SharedLayerDesc(key, layer_class, forward_func, shared_weight_attr, *args, **kwargs)``
(one layer per key and stage, its weight tied across the stages that use the key), built
``Layer`` objects and plain functions; a micro-batch runs through them in order, each one's
output the next one's input. ``seg_method`` cuts the list (``pipeline_segments``).

Where this process stands: ``topology`` (``fleet.get_hybrid_communicate_group().topology()``)
or, without it, the hybrid layout ``fleet.init(strategy=...)`` built from ``hybrid_configs``
(its ``pp_degree`` must equal ``num_stages``), or without one the world cut as Paddle's
default topology does: stage ``rank % num_stages`` of replica ``rank // num_stages``. A
process alone, or ``local=True`` (fleetmpi's own argument), builds and runs every stage, one
after the other: the single-process model the ranks must match, trained with
``distributed_optimizer(..., local=True)``.

Initial weights do not depend on which process builds a layer: the layer at index ``i`` is
built with the shared generator seeded by the seed, one number drawn from the shared generator
when the ``PipelineLayer`` is made (the same on every rank) and ``i``
(``backend.shared_rng_of``); every layer of one ``SharedLayerDesc`` key is built as the key's
first entry. So each stage's parameters are bit for bit those of the same ``PipelineLayer``
built whole in one process from the same seed, and the copies of a shared weight start equal
(they are also broadcast from the first stage holding them, as Paddle does, for layers that
draw from elsewhere).

In one process the stages that use a key share one layer, whose gradients the engine sums
over its uses. Split over ranks, each stage holds a copy, and the gradient of every parameter
of the copies is summed over those stages (``allreduce_shared_weight_gradients``, which the
pipeline runs after each step's schedule and before the update), so the copies take the same
update and stay equal to the one layer of one process. Paddle sums ``shared_weight_attr``'s
gradient alone, which leaves the other parameters of a later stage's copy (a position
embedding beside the token table) untrained there; here the whole layer is tied, and
``shared_weight_attr`` must name one of its parameters.

``recompute_interval=k`` runs each run of ``k`` consecutive entries of this process's list
without keeping its activations, recomputing it in backward (``autograd.recompute``), when it
holds parameters and its input needs a gradient.
"""
import functools
import weakref

from ..core import backend, job
from ..autograd import Tensor
from ..autograd.recompute import layer_parameters, layers_of, run_recomputed
from fleetmpi.comm import get_communicator, hybrid_topology
from fleetmpi.comm.hybrid_topology import HybridCommunicateGroup, rank_of
from .basic_layers import check_positive_int
from .containers import LayerDict
from .layer import Layer
from .parameter import Parameter
from .pipeline_segments import segment_parts

# id(parameter) -> the PipelineLayer that built it (``pipeline_layer_of``).
_builders = weakref.WeakValueDictionary()


class LayerDesc:
    """A layer to build later, on the stage that runs it: ``layer_func(*inputs, **kwargs)``
    (``layer_func`` a ``Layer`` subclass)."""

    def __init__(self, layer_func, *inputs, **kwargs):
        if not (isinstance(layer_func, type) and issubclass(layer_func, Layer)):
            raise TypeError(f"{type(self).__name__}: layer_func must be a subclass of "
                            f"fleetmpi.nn.Layer, not {layer_func!r}")
        self.layer_func, self.inputs, self.kwargs = layer_func, inputs, kwargs

    def build_layer(self):
        return self.layer_func(*self.inputs, **self.kwargs)

    def __repr__(self):
        args = [repr(a) for a in self.inputs] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{self.layer_func.__name__}({', '.join(args)})"


class SharedLayerDesc(LayerDesc):
    """A layer whose weight ``shared_weight_attr`` (an attribute path of the built layer) is
    one weight wherever ``key`` appears in the list: GPT's token embedding and its tied output
    projection. ``forward_func(layer, x)``, when given, is what this entry runs instead of the
    layer's forward (the head's product with the embedding's weight)."""

    def __init__(self, key, layer_func, forward_func=None, shared_weight_attr="weight",
                 *inputs, **kwargs):
        super().__init__(layer_func, *inputs, **kwargs)
        if not isinstance(key, str) or not key:
            raise ValueError(f"SharedLayerDesc: key must be a non-empty string, not {key!r}")
        if forward_func is not None and not callable(forward_func):
            raise TypeError(f"SharedLayerDesc {key!r}: forward_func must be callable or "
                            f"None, not {forward_func!r}")
        self.layer_name, self.forward_func = key, forward_func
        self.shared_weight_attr = shared_weight_attr


def shared_weight(layer, attr, key):
    """The parameter at the attribute path ``attr`` of ``layer`` (a SharedLayerDesc's)."""
    value = layer
    for name in attr.split("."):
        value = getattr(value, name, None)
    if not isinstance(value, Parameter):
        raise ValueError(f"SharedLayerDesc {key!r}: shared_weight_attr={attr!r} is not a "
                         f"parameter of {type(layer).__name__} (parameters: "
                         f"{[name for name, _ in layer.named_parameters()]})")
    return value


def pipeline_layer_of(parameters):
    """The ``PipelineLayer`` that built ``parameters``, or None when none of them comes from
    one; a ValueError when only some do."""
    owners = {id(p): _builders.get(id(p)) for p in parameters}
    builders = {id(layer): layer for layer in owners.values()}
    if list(builders) == [id(None)] or not builders:
        return None
    if len(builders) > 1:
        raise ValueError("the optimizer holds parameters of a PipelineLayer beside others "
                         "(or of two PipelineLayers); give it the PipelineLayer's parameters "
                         "alone")
    return next(iter(builders.values()))


class PipelineLayer(Layer):
    """Paddle's ``PipelineLayer`` (module docstring). ``num_stages``: the stage count (or
    ``topology``'s ``pipe`` axis); ``loss_fn(output, label)``: the loss the last stage
    computes; ``seg_method``: ``"uniform"`` or ``"layer:<ClassName>"``;
    ``recompute_interval``: 0 (off) or the entries per recomputed run; ``local``: build and
    run every stage in this process.

    ``num_stages``, ``stage_id`` (this process's stage; 0 with every stage here),
    ``stages`` (the stages this process runs), ``segment_parts``, ``run_function`` (this
    process's entries, ready to call), ``shared_layers``, ``pipe_group`` (the communicator of
    this replica's stages, None alone) and ``data_parallel_group`` (the replicas of this stage,
    None alone) are read by the pipeline."""

    def __init__(self, layers, num_stages=None, topology=None, loss_fn=None,
                 seg_method="uniform", recompute_interval=0, recompute_offload=False,
                 recompute_partition=False, local=False):
        super().__init__()
        layers = _checked_entries(layers)
        if recompute_offload or recompute_partition:
            raise ValueError("PipelineLayer: recompute_offload and recompute_partition are "
                             "not supported (the recomputed runs keep their inputs on the "
                             "device, whole); leave them False")
        if not isinstance(recompute_interval, int) or recompute_interval < 0:
            raise ValueError(f"PipelineLayer: recompute_interval={recompute_interval!r}; "
                             "allowed: 0 (off) or a positive number of layers")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"PipelineLayer: loss_fn must be callable, not {loss_fn!r}")
        self.loss_fn = loss_fn
        self.recompute_interval = recompute_interval
        self.local = bool(local) or not job.joined() or job.worker_num() == 1
        self._group = None if self.local else _stage_group(num_stages, topology)
        if self._group is not None:
            self.num_stages = self._group.get_pipe_parallel_world_size()
            self.stage_id = self._group.get_stage_id()
            self.stages = [self.stage_id]
        else:
            self.num_stages = _local_stages(num_stages, topology)
            self.stage_id, self.stages = 0, list(range(self.num_stages))
        self.pipe_group = None if self._group is None else self._group.get_pipe_parallel_group()
        self.data_parallel_group = None if self._group is None else \
            self._group.get_data_parallel_group()
        self.segment_parts = segment_parts(layers, self.num_stages, seg_method)
        self.shared_layers = LayerDict()
        self.shared_weight_attrs = {}
        self.run_function = []
        self._build(layers)
        self.shared_comm = self._shared_communicators(layers)
        self._synchronize_shared_weights()
        for p in self.parameters():
            _builders[id(p)] = self

    # -- building ---------------------------------------------------------------------------
    def get_stage_from_index(self, layer_idx):
        """The stage that runs entry ``layer_idx`` of ``layers``."""
        if not 0 <= layer_idx < self.segment_parts[-1]:
            raise ValueError(f"layer index {layer_idx} is outside 0..{self.segment_parts[-1] - 1}")
        return next(s for s in range(self.num_stages)
                    if self.segment_parts[s] <= layer_idx < self.segment_parts[s + 1])

    def _build(self, layers):
        """Build this process's entries, each under its own generator (module docstring)."""
        token = int(backend.shared_rng().integers(2 ** 31))
        first = {}
        for index, entry in enumerate(layers):
            if isinstance(entry, SharedLayerDesc):
                first.setdefault(entry.layer_name, index)
        for stage in self.stages:
            for index in range(self.segment_parts[stage], self.segment_parts[stage + 1]):
                entry = layers[index]
                if isinstance(entry, SharedLayerDesc):
                    self.run_function.append(self._shared_entry(entry, token,
                                                                first[entry.layer_name], stage))
                elif isinstance(entry, LayerDesc):
                    with backend.shared_rng_of((token, index)):
                        layer = entry.build_layer()
                    self._add(str(index), layer, stage)
                elif isinstance(entry, Layer):
                    self._add(str(index), entry, stage)
                else:
                    self.run_function.append(entry)

    def _add(self, name, layer, stage):
        layer.set_pipeline_stage(stage)
        self.add_sublayer(name, layer)
        self.run_function.append(layer)

    def _shared_entry(self, desc, token, first_index, stage):
        key = desc.layer_name
        if key not in self.shared_weight_attrs:
            with backend.shared_rng_of((token, first_index)):
                layer = desc.build_layer()
            layer.set_pipeline_stage(stage)
            shared_weight(layer, desc.shared_weight_attr, key)
            self.shared_layers[key] = layer
            self.shared_weight_attrs[key] = desc.shared_weight_attr
        layer = self.shared_layers[key]
        return layer if desc.forward_func is None else \
            functools.partial(desc.forward_func, layer)

    # -- shared weights ---------------------------------------------------------------------
    def _shared_communicators(self, layers):
        """``{key: communicator of the stages holding it}`` for this process's keys held by
        several stages (a collective: every rank splits for every such key, in key order)."""
        if self._group is None:
            return {}
        stages = {}
        for index, entry in enumerate(layers):
            if isinstance(entry, SharedLayerDesc):
                stages.setdefault(entry.layer_name, set()).add(self.get_stage_from_index(index))
        found = {}
        coords = self._group.coords
        replica = rank_of(dict(coords, pipe=0), self._group.degrees)
        for key in sorted(stages):
            if len(stages[key]) < 2:
                continue
            member = self.stage_id in stages[key]
            comm = self._group.communicator.split(replica if member else None, coords["pipe"])
            if member:
                found[key] = comm
        return found

    def _synchronize_shared_weights(self):
        for key, comm in self.shared_comm.items():
            for p in layer_parameters([self.shared_layers[key]]):
                comm.broadcast(p.data, root=0)

    def allreduce_shared_weight_gradients(self):
        """Sum the gradient of every parameter of each shared layer over the stages holding
        it (module docstring)."""
        for key, comm in self.shared_comm.items():
            for p in layer_parameters([self.shared_layers[key]]):
                grad = p.grad.data
                comm.allreduce(grad, op="sum", out=grad)

    # -- running ----------------------------------------------------------------------------
    def forward(self, input):
        functions = self.run_function
        if not self.recompute_interval:
            return _run_entries(functions, input)
        x = input
        for start in range(0, len(functions), self.recompute_interval):
            piece = functions[start:start + self.recompute_interval]
            layers = [layer for f in piece for layer in layers_of(f)[0]]
            inputs = x if isinstance(x, tuple) else (x,)
            if layer_parameters(layers) and any(isinstance(t, Tensor) and not t.stop_gradient
                                                for t in inputs):
                # Paddle's rule: a run is recomputed when it holds parameters and its input
                # (an item of it, for a tuple) needs a gradient
                x = run_recomputed(functools.partial(_run_unpacked, piece), inputs,
                                   layers=layers)
            else:
                x = _run_entries(piece, x)
        return x


def _run_entries(functions, x):
    """Each entry on the one before's output: ``x`` a tensor or a tuple, given whole."""
    for function in functions:
        x = function(x)
    return x


def _run_unpacked(functions, *inputs):
    """``_run_entries`` on the tuple ``inputs``, or on the one tensor it holds."""
    return _run_entries(functions, inputs[0] if len(inputs) == 1 else inputs)


def _checked_entries(layers):
    try:
        entries = list(layers)
    except TypeError:
        raise TypeError(f"PipelineLayer: layers must be a list of LayerDesc, SharedLayerDesc, "
                        f"Layer or functions, not {type(layers).__name__}") from None
    if not entries:
        raise ValueError("PipelineLayer: layers is empty")
    for index, entry in enumerate(entries):
        if not (isinstance(entry, (LayerDesc, Layer)) or callable(entry)):
            raise TypeError(f"PipelineLayer: layers[{index}] is {entry!r}; allowed: a "
                            "LayerDesc, a SharedLayerDesc, a Layer or a function")
    return entries


def _local_stages(num_stages, topology):
    """The stage count of a PipelineLayer built whole in this process."""
    if topology is not None:
        stages = topology.get_dim("pipe")
        if num_stages is not None and num_stages != stages:
            raise ValueError(f"PipelineLayer: num_stages={num_stages} but the topology's pipe "
                             f"axis has {stages} stages; give one, or both equal")
        return stages
    if num_stages is None:
        raise ValueError("PipelineLayer: give num_stages or topology")
    return check_positive_int("num_stages", num_stages)


def _stage_group(num_stages, topology):
    """The ``HybridCommunicateGroup`` that places this process (module docstring): the hybrid
    layout's, or the world cut into ``num_stages`` stages without one."""
    layout = hybrid_topology.current()
    if layout is not None:
        stages = layout.get_pipe_parallel_world_size()
        wanted = [("num_stages", num_stages)]
        if topology is not None:
            wanted.append(("the topology's pipe axis", topology.get_dim("pipe")))
        for what, value in wanted:
            if value is not None and value != stages:
                raise ValueError(f"PipelineLayer: {what} is {value} but the hybrid layout "
                                 f"fleet.init built has pp_degree={stages}; they must be equal")
        if topology is not None and topology.world_size() != layout.communicator.size:
            raise ValueError(f"PipelineLayer: the topology spans {topology.world_size()} "
                             f"ranks, the job {layout.communicator.size}")
        return layout
    if topology is not None:
        raise ValueError("PipelineLayer: a topology was given but fleet.init built no hybrid "
                         "layout; call fleet.init(is_collective=True, strategy=strategy) with "
                         "hybrid_configs setting pp_degree, and pass "
                         "fleet.get_hybrid_communicate_group().topology()")
    stages = _local_stages(num_stages, None)
    world = get_communicator()
    if world.size % stages:
        raise ValueError(f"PipelineLayer: num_stages={stages} over a world of {world.size} "
                         "ranks without a hybrid layout; the world size must be a multiple of "
                         "num_stages (or call fleet.init(is_collective=True, strategy=...) with "
                         "hybrid_configs setting pp_degree)")
    return HybridCommunicateGroup(world, {"data": world.size // stages, "pipe": stages,
                                          "sharding": 1, "model": 1})

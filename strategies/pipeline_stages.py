"""How ``pipeline`` cuts a model into stages, and the models it refuses to cut.

A stage is a run of consecutive top-level sublayers of the model; a micro-batch goes through
them one after the other, each one's output the next one's input. Three kinds of model are cut:

1. An ``nn.Sequential`` of layers built inside ``fleet.device_guard("stage:N")`` (or put on
   stages by ``fleet.split_stages(model, split_points)``).
2. An ``nn.Sequential`` of stages: every top-level child is a whole stage, any Layer with any
   ``forward`` of its own (``nn.Sequential(Stage0(), Stage1())``), put on its stage by a
   ``device_guard`` around its construction or by ``fleet.split_stages(model)``.
3. A user-defined ``Layer`` whose parameters are all on stages and whose ``forward`` is a chain
   of its top-level sublayers: it calls each of them once, in registration order, the model's
   input into the first, each one's output into the next, and returns the last one's output.
   This is checked once, on the first micro-batch, by running the whole forward with every
   top-level sublayer watched (nothing recorded, buffers and the rank's random generator put
   back afterwards); a forward that does anything else is refused.

A top-level layer is on the stage of its parameters, else on the stage of its own
``device_guard``, else (a layer without parameters built outside any guard, an activation) on
the stage of the layer before it. Refused, with the layer named: parameters of one top-level
layer on two stages (a stage boundary must fall between top-level layers), parameters of the
model itself outside its sublayers, parameters without a stage beside parameters with one,
stages that do not rise from 0 to S-1 along the layers, a stage without parameters, and a
``forward`` that is not a chain of the top-level sublayers. A model without any stage is one
stage, whatever its ``forward``: the pipeline then only splits the batch into micro-batches.

With ``fuse_elewise_add_act_ops``/``fuse_bn_act_ops`` the layers of one stage of a Sequential
are fused as the Sequential fuses them; a fused pair never spans two stages (an activation
built inside the next stage's guard runs there, unfused). A user-defined Layer's stages call
its sublayers as its ``forward`` does, without fusing them.
"""
from fleetmpi.core import backend
from fleetmpi.autograd import as_array, no_grad
from fleetmpi.nn import Sequential
from fleetmpi.nn.pipeline_layer import pipeline_layer_of
from fleetmpi.core.rng_tracker import get_rng_state_tracker


def count_stages(parameters):
    """The number of stages the parameters' ``pipeline_stage`` tags make (1 when none is
    tagged); refuses untagged parameters beside tagged ones and stages without parameters."""
    tags = [p.pipeline_stage for p in parameters]
    if all(tag is None for tag in tags):
        return 1
    untagged = [p.name for p in parameters if p.pipeline_stage is None]
    if untagged:
        raise ValueError(f"pipeline: parameters {untagged} belong to no stage while others do; "
                         "build every layer with parameters inside fleet.device_guard("
                         "'stage:N') or assign stages with fleet.split_stages(model, points)")
    stages = max(tags) + 1
    empty = sorted(set(range(stages)) - set(tags))
    if empty:
        raise ValueError(f"pipeline: stages {empty} hold no parameters (stages used: "
                         f"{sorted(set(tags))}); stages are numbered 0..S-1 and each needs a "
                         "layer with parameters")
    return stages


def stage_count(parameters):
    """The pipeline stages of the model holding ``parameters``: its ``PipelineLayer``'s
    ``num_stages``, else what their stage tags make (``count_stages``)."""
    layer = pipeline_layer_of(parameters)
    return count_stages(parameters) if layer is None else layer.num_stages


def _parameter_stages(layer):
    """``{stage: [parameter name, ...]}`` over the parameters of ``layer`` and its sublayers
    that are on a stage."""
    stages = {}
    for member in [layer] + [sub for _, sub in layer.named_sublayers()]:
        for p in member.own_parameters():
            if p.pipeline_stage is not None:
                stages.setdefault(p.pipeline_stage, []).append(p.name)
    return stages


def layer_stages(model, stages):
    """``[(name, layer, stage), ...]`` for the top-level layers of ``model`` (module
    docstring), refusing a model that cannot be cut into ``stages`` stages."""
    kind = type(model).__name__
    own = [p.name for p in model.own_parameters()]
    if own:
        raise ValueError(f"pipeline: {kind} holds parameters {own} itself, outside its "
                         "top-level sublayers, so no stage can run them; a model is cut "
                         "between its top-level sublayers: create those parameters in a "
                         "sublayer")
    result, previous = [], 0
    for name, layer in model.named_children():
        tags = _parameter_stages(layer)
        if len(tags) > 1:
            where = "; ".join(f"stage {s}: {', '.join(names)}"
                              for s, names in sorted(tags.items()))
            raise ValueError(f"pipeline: the top-level layer {name!r} ({type(layer).__name__}) "
                             f"of {kind} holds parameters of stages {sorted(tags)} ({where}); "
                             "a stage boundary must fall between top-level layers: build each "
                             "top-level layer inside one device_guard, or make its parts "
                             "top-level layers of their own")
        if tags:
            stage = next(iter(tags))
        elif layer.pipeline_stage is not None:
            stage = layer.pipeline_stage
        else:
            stage = previous
        result.append((name, layer, stage))
        previous = stage
    order = [stage for _, _, stage in result]
    if order != sorted(order) or not order or order[0] != 0 or order[-1] != stages - 1:
        raise ValueError(f"pipeline: the stages of the top-level layers "
                         f"{[name for name, _, _ in result]} of {kind} are {order}; they must "
                         f"rise from 0 to {stages - 1} along the layers, in the order the model "
                         "registers (and its forward calls) them")
    return result


def is_chain_by_construction(model):
    """Whether ``model``'s forward is the chain of its top-level layers by construction (a
    Sequential that keeps Sequential's forward)."""
    return isinstance(model, Sequential) and type(model).forward is Sequential.forward


def stage_modules(model, stages, fusion):
    """One ``nn.Sequential`` per stage over its top-level layers of ``model``: fused as
    ``fusion`` (``(fuse_elewise_add_act_ops, fuse_bn_act_ops)``) when the model is a
    Sequential, unfused otherwise."""
    placed = layer_stages(model, stages)
    modules = []
    for stage in range(stages):
        module = Sequential(*[(name, layer) for name, layer, s in placed if s == stage])
        if is_chain_by_construction(model):
            module.configure_fusion(*fusion)
        modules.append(module)
    return modules


class _CallLog:
    """The calls of a model's top-level sublayers during one forward: ``[name, inputs,
    output]`` in call order, recorded by forward hooks."""

    def __init__(self, model):
        self.calls = []
        self._handles = []
        for name, layer in model.named_children():
            self._handles.append(layer.register_forward_pre_hook(self._pre(name)))
            self._handles.append(layer.register_forward_post_hook(self._post))

    def _pre(self, name):
        def hook(layer, inputs):
            self.calls.append([name, inputs, None])
        return hook

    def _post(self, layer, inputs, output):
        self.calls[-1][2] = output

    def remove(self):
        for handle in self._handles:
            handle.remove()


def _forward_watched(model, x):
    """``model(x)`` with nothing recorded and the calls of its top-level sublayers logged;
    the model's buffers and the rank's random generator are put back afterwards, so the run
    leaves no trace in the training."""
    buffers = [(b, b.copy()) for _, b in model.named_buffers()]
    draws = backend.rank_rng_snapshot()
    tracked = get_rng_state_tracker().get_states_tracker()
    log = _CallLog(model)
    try:
        with no_grad():
            output = model(x)
    finally:
        log.remove()
        for buffer, saved in buffers:
            buffer[...] = saved
        backend.restore_rank_rng(draws)
        get_rng_state_tracker().set_states_tracker(tracked)
    return output, log.calls


def check_chain(model, x):
    """Refuse ``model`` unless its forward on ``x`` calls each of its top-level sublayers
    once, in registration order, each on the output of the one before (the first on ``x``),
    and returns the last one's output."""
    if is_chain_by_construction(model):
        return
    kind = type(model).__name__
    names = [name for name, _ in model.named_children()]
    allowed = (f"a model is cut into pipeline stages when its forward calls each of its "
               f"top-level sublayers {names} once, in that (registration) order, passing "
               "the model's input to the first and each one's output to the next, and "
               "returns the last one's output; move any other computation into a sublayer "
               "(or give the model as an nn.Sequential of stages)")
    output, calls = _forward_watched(model, x)
    called = [name for name, _, _ in calls]
    if called != names:
        raise ValueError(f"pipeline: {kind}.forward calls its top-level sublayers in the order "
                         f"{called}; {allowed}")
    previous, source = as_array(x), "the model's input"
    for name, inputs, result in calls:
        if len(inputs) != 1 or as_array(inputs[0]) is not previous:
            raise ValueError(f"pipeline: in {kind}.forward the sublayer {name!r} does not get "
                             f"{source} as its one input (the forward computes something "
                             f"between its sublayers); {allowed}")
        previous, source = as_array(result), f"the output of {name!r}"
    if as_array(output) is not previous:
        raise ValueError(f"pipeline: {kind}.forward returns something other than {source} "
                         f"(it computes something after its last sublayer); {allowed}")

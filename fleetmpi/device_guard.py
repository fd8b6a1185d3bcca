"""Pipeline stages of layers: ``device_guard`` around their construction, or split points.

As in Paddle, the pipeline information comes from the user's program: every layer built inside
``with fleet.device_guard("stage:1"):`` (or ``"gpu:1"``, Paddle's spelling, read as stage 1)
belongs to stage 1, and so do its parameters. ``split_stages(model, split_points)`` assigns the
top-level layers of a model instead, cutting it before each split point (without split points,
every top-level layer is a stage of its own). Every rank builds the whole model (one SPMD
script); the pipeline strategy then runs on each rank only the layers of its own stage.
"""
import contextlib
import numbers
import re

from .nn.layer import register_construction_hook

_STAGE = re.compile(r"(stage|gpu):(\d+)")


def parse_stage(device):
    """The stage index ``device`` names: ``"stage:N"`` or ``"gpu:N"`` with N >= 0."""
    match = _STAGE.fullmatch(device) if isinstance(device, str) else None
    if match is None:
        raise ValueError(f"device_guard({device!r}): a pipeline stage is named 'stage:N' or "
                         "'gpu:N' with N a stage index 0, 1, 2, ...")
    return int(match.group(2))


@contextlib.contextmanager
def device_guard(device):
    """Layers constructed inside belong to the pipeline stage ``device`` names (an inner
    ``device_guard`` overrides an outer one)."""
    stage = parse_stage(device)

    def put_on_stage(layer):
        layer.pipeline_stage = stage

    hook = register_construction_hook(put_on_stage)
    try:
        yield
    finally:
        hook.remove()


def split_stages(model, split_points=None):
    """Put the top-level layers of ``model`` (an ``nn.Sequential``, or a Layer whose forward
    chains its top-level sublayers; see ``fleetmpi.strategies.pipeline_stages``) on stages,
    cutting before each split point: a top-level layer's index or name.
    ``split_stages(model, [3])`` puts layers 0-2 on stage 0 and the rest on stage 1;
    ``split_stages(model)`` puts every top-level layer on a stage of its own (a Sequential of
    stages). Returns the number of stages."""
    if not callable(getattr(model, "named_children", None)):
        raise TypeError(f"split_stages cuts a fleetmpi.nn.Layer, not {type(model).__name__}")
    named = model.named_children()
    names = [name for name, _ in named]
    if split_points is None:
        split_points = list(range(1, len(names)))
    if not isinstance(split_points, (list, tuple)):
        raise TypeError(f"split_points must be a list of layer indices or names, not "
                        f"{split_points!r}")
    starts = []
    for point in split_points:
        if isinstance(point, str) and point in names:
            starts.append(names.index(point))
        elif isinstance(point, numbers.Integral) and not isinstance(point, bool):
            starts.append(int(point))
        else:
            raise ValueError(f"split point {point!r} is neither a layer index nor one of the "
                             f"model's top-level layers {names}")
    stages = len(starts) + 1
    if len(names) < stages:
        raise ValueError(f"a model of {len(names)} top-level layers cannot be cut into "
                         f"{stages} pipeline stages: every stage needs at least one layer")
    if starts and (starts != sorted(set(starts)) or starts[0] < 1 or starts[-1] >= len(names)):
        raise ValueError(f"split points {list(split_points)} must be strictly increasing layer "
                         f"positions in 1..{len(names) - 1}, so that every one of the "
                         f"{stages} stages gets at least one of the {len(names)} layers")
    bounds = [0] + starts + [len(names)]
    for stage in range(stages):
        for _, layer in named[bounds[stage]:bounds[stage + 1]]:
            layer.set_pipeline_stage(stage)
    return stages

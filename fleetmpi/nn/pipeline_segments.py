"""Where ``PipelineLayer`` cuts its list of layers into stages (``seg_method``), as Paddle 2.4's
``SegmentLayers`` does.

``"uniform"``: every stage gets ``len(layers) // num_stages`` consecutive entries and the last
``len(layers) % num_stages`` stages one more each. ``"layer:<ClassName>"``: the entries whose
class name (of a ``LayerDesc``'s ``layer_func``, a built layer's class, a function's name)
contains ``ClassName`` (a case-insensitive regular expression search, as Paddle's) are counted,
and each stage gets the same number of them: a stage ends right after its last counted entry,
so entries before the first counted one go to the first stage and entries after the last
counted one to the last stage.

The result is Paddle's ``segment_parts``: ``num_stages + 1`` indices, stage ``s`` holding the
entries ``parts[s]:parts[s + 1]``.
"""
import re

SEG_METHODS = ("uniform", "layer:<ClassName>")


def entry_name(entry):
    """The class name ``"layer:<ClassName>"`` matches an entry of the list by: a description's
    ``layer_func``, a layer's class, a function's own name (None for other callables)."""
    layer_func = getattr(entry, "layer_func", None)
    if layer_func is not None:
        return layer_func.__name__
    if hasattr(entry, "named_sublayers"):
        return type(entry).__name__
    return getattr(entry, "__name__", None)


def uniform_parts(num_items, num_parts):
    """``"uniform"``: the last ``num_items % num_parts`` parts one entry longer."""
    size, extra = divmod(num_items, num_parts)
    parts = [0]
    for part in range(num_parts):
        parts.append(parts[-1] + size + (1 if part >= num_parts - extra else 0))
    return parts


def layer_parts(entries, num_parts, class_name):
    """``"layer:<class_name>"``: equal numbers of the matching entries per part."""
    try:
        pattern = re.compile(class_name, re.IGNORECASE)
    except re.error as error:
        raise ValueError(f"seg_method 'layer:{class_name}': {class_name!r} is not a regular "
                         f"expression ({error})") from None
    names = [entry_name(entry) for entry in entries]
    matches = [i for i, name in enumerate(names) if name and pattern.search(name)]
    if not matches:
        present = sorted({name for name in names if name})
        raise ValueError(f"seg_method 'layer:{class_name}': no layer's class name matches "
                         f"{class_name!r}; the classes in layers are {present}")
    if len(matches) % num_parts:
        raise ValueError(f"seg_method 'layer:{class_name}': {len(matches)} layers match "
                         f"{class_name!r}, which do not split evenly over {num_parts} stages; "
                         f"the count must be a multiple of num_stages")
    per_part = len(matches) // num_parts
    ends = [matches[per_part * (part + 1) - 1] + 1 for part in range(num_parts - 1)]
    return [0] + ends + [len(entries)]


def segment_parts(entries, num_parts, seg_method):
    """The ``num_parts + 1`` boundaries of ``seg_method`` over ``entries`` (module
    docstring); a ValueError naming the method, the counts and what is allowed."""
    if num_parts > len(entries):
        raise ValueError(f"PipelineLayer: {len(entries)} layers cannot fill {num_parts} "
                         f"stages; each stage needs at least one layer")
    if seg_method == "uniform":
        return uniform_parts(len(entries), num_parts)
    if isinstance(seg_method, str) and seg_method.startswith("layer:") and seg_method[6:]:
        return layer_parts(entries, num_parts, seg_method[6:])
    raise ValueError(f"PipelineLayer: seg_method={seg_method!r}; allowed: "
                     f"{', '.join(repr(m) for m in SEG_METHODS)}")

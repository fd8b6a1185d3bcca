"""``fleetmpi.summary``: Paddle's ``paddle.summary``, a table of a model's layers with the
shapes of their outputs and their parameter counts, from one forward pass."""
import numpy as np

from ..core import backend
from ..autograd import no_grad
from ..autograd.tensor import Tensor
from .containers import LayerDict, LayerList, Sequential

_CONTAINERS = (Sequential, LayerList, LayerDict)
_MB = 2.0 ** 20


def _shapes(value):
    """The shape of a tensor or array, or the list of the shapes of a tuple or list of them."""
    if isinstance(value, (tuple, list)):
        return [_shapes(v) for v in value]
    return list(value.shape) if hasattr(value, "shape") else "-"


def _elements(value):
    if isinstance(value, (tuple, list)):
        return sum(_elements(v) for v in value)
    return int(np.prod(value.shape)) if hasattr(value, "shape") else 0


def _inputs(input_size, dtypes, input):
    if input is not None:
        return list(input) if isinstance(input, (tuple, list)) else [input]
    if input_size is None:
        raise ValueError("summary needs input_size (a shape, or a list of shapes) or input")
    sizes = [input_size] if isinstance(input_size[0], (int, type(None))) else list(input_size)
    dtypes = dtypes if isinstance(dtypes, (tuple, list)) else [dtypes or "float32"] * len(sizes)
    if len(dtypes) != len(sizes):
        raise ValueError(f"{len(dtypes)} dtypes for {len(sizes)} inputs")
    made = []
    for size, dtype in zip(sizes, dtypes):
        shape = tuple(1 if d is None or d == -1 else d for d in size)
        if any(not isinstance(d, (int, np.integer)) or d < 1 for d in shape):
            raise ValueError(f"input_size {size!r}: each entry must be a positive integer "
                             "(or -1 / None for a batch of 1)")
        made.append(Tensor(backend.array_module().zeros(shape, dtype=dtype)))
    return made


def summary(net, input_size=None, dtypes=None, input=None):
    """Print the layers of ``net`` (every sublayer but the containers) in the order a forward
    pass on zeros of ``input_size`` (``-1`` or None: a batch of 1), or on ``input``, calls them,
    with their output shapes and own parameter counts, then the totals and the sizes in MB;
    returns ``{"total_params": ..., "trainable_params": ...}``. The pass runs in eval mode
    without a graph, so batch-norm statistics and the model's mode are left as they were."""
    inputs = _inputs(input_size, dtypes, input)
    rows, handles = [], []
    counters = {}

    def record(layer, _inputs, output):
        kind = type(layer).__name__
        counters[kind] = counters.get(kind, 0) + 1
        own = sum(p.size for p in layer.own_parameters())
        rows.append((f"{kind}-{counters[kind]}", _shapes(output), own, _elements(output)))

    for _, layer in net.named_sublayers():
        if not isinstance(layer, _CONTAINERS):
            handles.append(layer.register_forward_post_hook(record))
    modes = [(layer, layer.training) for _, layer in net.named_sublayers(include_self=True)]
    net.eval()
    try:
        with no_grad():
            net(*inputs)
    finally:
        for handle in handles:
            handle.remove()
        for layer, training in modes:
            layer.training = training
    parameters = net.parameters()
    total = sum(p.size for p in parameters)
    trainable = sum(p.size for p in parameters if not p.stop_gradient)
    itemsize = parameters[0].data.dtype.itemsize if parameters else 4
    activations = sum(r[3] for r in rows) * itemsize
    inputs_bytes = sum(t.size * t.data.dtype.itemsize for t in inputs)
    print(_table(rows, total, trainable, inputs_bytes / _MB, 2 * activations / _MB,
                 total * itemsize / _MB))
    return {"total_params": total, "trainable_params": trainable}


def _table(rows, total, trainable, input_mb, activations_mb, parameters_mb):
    header = ("Layer (type)", "Output Shape", "Param #")
    body = [(name, str(shape), f"{count:,}") for name, shape, count, _ in rows]
    widths = [max(len(r[i]) for r in [header] + body) + 2 for i in range(3)]
    rule = "-" * sum(widths)

    def line(row):
        return "".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                       enumerate(zip(row, widths)))
    return "\n".join([rule, line(header), "=" * sum(widths)] + [line(r) for r in body] + [
        "=" * sum(widths),
        f"Total params: {total:,}",
        f"Trainable params: {trainable:,}",
        f"Non-trainable params: {total - trainable:,}",
        rule,
        f"Input size (MB): {input_mb:.2f}",
        f"Forward/backward pass size (MB): {activations_mb:.2f}",
        f"Params size (MB): {parameters_mb:.2f}",
        f"Estimated Total Size (MB): {input_mb + activations_mb + parameters_mb:.2f}",
        rule])

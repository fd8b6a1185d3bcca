"""``NonFiniteError`` and Paddle's ``FLAGS_check_nan_inf``: every operation's outputs checked.

With ``FLAGS_check_nan_inf=1`` in the environment (read once, when fleetmpi is imported),
``Function.apply`` checks the arrays each forward returns and the engine the gradients each
backward returns, and the first one holding an inf or NaN raises ``NonFiniteError`` naming
the operator (its ``op_type``, Paddle's name, and the Function class), forward or backward,
and the layer whose ``forward`` was running when the operation was recorded (its dotted name in
the outermost layer called, as ``named_sublayers`` gives it). It is a debugging mode, as in
Paddle: each check reads a verdict on the host, so on a GPU every operation waits for the
device, and inside a CUDA graph capture the first check raises ``CaptureError``.

``NonFiniteError`` is also what the step's check of the gradients raises
(``fleetmpi.strategies.nonfinite``).
"""
import numpy as np

from ..core import backend, capture_checks, paddle_flags

enabled = paddle_flags.check_nan_inf()
# The layers whose forward is running, outermost first, while ``enabled`` (``in_layer``).
_layers = []


class NonFiniteError(FloatingPointError):
    """An inf or NaN where training needs finite values: an operation's output under
    ``FLAGS_check_nan_inf``, or a step's loss or gradients (``FLEETMPI_NONFINITE``)."""


class in_layer:
    """Marks ``layer``'s forward as running for the block (``nn.Layer.__call__`` enters it
    while ``enabled``)."""

    __slots__ = ("layer",)

    def __init__(self, layer):
        self.layer = layer

    def __enter__(self):
        _layers.append(self.layer)

    def __exit__(self, *exc):
        _layers.pop()


def running_layers():
    """The layers running now, outermost first (what a recorded call keeps to name its layer
    in backward)."""
    return tuple(_layers)


def layer_name(layers):
    """``layer "fc2" (Linear) of Net`` for the innermost of ``layers`` (outermost first), or
    ``no layer`` when none ran."""
    if not layers:
        return "no layer"
    root, inner = layers[0], layers[-1]
    if inner is root:
        return f"the model ({type(root).__name__})"
    for name, layer in root.named_sublayers():
        if layer is inner:
            return f'layer "{name}" ({type(inner).__name__}) of {type(root).__name__}'
    return f"a {type(inner).__name__} layer inside {type(root).__name__}"


def _counts(array):
    """``(NaN count, inf count, size)`` of a backend array."""
    values = backend.to_numpy(array)
    return int(np.isnan(values).sum()), int(np.isinf(values).sum()), int(values.size)


def check(function, arrays, layers, stage):
    """Raise ``NonFiniteError`` for the first floating array of ``arrays`` (the forward
    outputs or backward input gradients of ``function``, a recorded call) that holds an inf or
    NaN; ``stage``: ``"forward"`` or ``"backward"``."""
    for index, array in enumerate(arrays):
        if array is None or not hasattr(array, "dtype") or not backend.is_floating(array.dtype):
            continue
        capture_checks.check_host_read("FLAGS_check_nan_inf's check of an operation")
        if bool(backend.array_module().isfinite(array).all()):
            continue
        nans, infs, size = _counts(array)
        what = "output" if stage == "forward" else "gradient of input"
        cls = type(function)
        raise NonFiniteError(
            f"FLAGS_check_nan_inf: the {stage} of operator {cls.op_type or 'unnamed'} "
            f"({cls.__name__}) in {layer_name(layers)} gave {nans} NaN and {infs} inf of the "
            f"{size} values of its {what} {index}; set FLAGS_check_nan_inf=0 to train "
            "without the check")

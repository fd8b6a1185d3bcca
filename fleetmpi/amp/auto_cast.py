"""``fleetmpi.amp.auto_cast`` and ``decorate``: Paddle dygraph's mixed precision, over the
per-operator casts of the ``amp`` strategy.

``auto_cast`` makes the ``amp`` strategy's ``CastPolicy`` (its white and black lists, with the
custom lists resolved as ``amp_configs``' are) current for the block, so a model computes
under it exactly as under ``strategy.amp`` with the same lists, dtype and level. Parameters
stay float32 either way: they are the master weights, and an operator computing in float16 or
bfloat16 takes a recorded cast copy of them, whose gradient comes back in float32. So
``decorate(level="O2")`` has nothing to convert; it checks its arguments and the parameters
(float32, as level O2 keeps masters of them) and returns the models and optimizers it was
given.
"""
import numpy as np

from ..core import backend
from ..autograd import autocast
from ..nn import Layer
from ..optimizer import Optimizer
from ..parallel import DistributedOptimizer
from fleetmpi.strategies import amp as amp_strategy

LEVELS = ("O0", "O1", "O2")
DTYPES = ("float16", "bfloat16")
SAVE_DTYPES = (None, "float32")


def _level(level, where):
    if not isinstance(level, str) or level.upper() not in LEVELS:
        raise ValueError(f"{where} level={level!r}; allowed: 'O0' (float32), 'O1' (the white "
                         f"list in the low-precision dtype) or 'O2' (every operator but the "
                         f"black list's)")
    return level.upper()


def low_precision_dtype(dtype, where):
    """The NumPy/CuPy dtype ``dtype`` (``"float16"`` or ``"bfloat16"``) names, or a
    ValueError naming ``where`` and what is allowed."""
    if not isinstance(dtype, str) or dtype.lower() not in DTYPES:
        raise ValueError(f"{where} dtype={dtype!r}; allowed: 'float16' or 'bfloat16'")
    if dtype.lower() == "float16":
        return np.dtype(np.float16)
    try:
        return backend.bfloat16()
    except ValueError as exc:
        raise ValueError(f"{where} dtype='bfloat16': {exc}; or use dtype='float16'") from None


def _names(value, key):
    if value is None:
        return []
    if isinstance(value, str) or not hasattr(value, "__iter__"):
        raise TypeError(f"auto_cast {key}={value!r}: a set or list of operator names, or None")
    return list(value)


def cast_policy(custom_white_list=None, custom_black_list=None, level="O1", dtype="float16"):
    """The ``amp`` strategy's ``CastPolicy`` for ``auto_cast``'s arguments (None at level
    O0)."""
    level = _level(level, "auto_cast")
    array_dtype = low_precision_dtype(dtype, "auto_cast")
    white, black = amp_strategy.op_lists(_names(custom_white_list, "custom_white_list"),
                                         _names(custom_black_list, "custom_black_list"),
                                         where="auto_cast ")
    if level == "O0":
        return None
    return amp_strategy.CastPolicy(white, black, array_dtype, pure=level == "O2")


class auto_cast(autocast):
    """Paddle's ``paddle.amp.auto_cast(enable=True, custom_white_list=None,
    custom_black_list=None, level="O1", dtype="float16")``: operators run inside the block
    compute as the ``amp`` strategy's lists say (module docstring). ``enable=False`` (or
    level ``"O0"``) computes in the inputs' dtypes, also inside an enclosing ``auto_cast``.
    ``policy``: the ``CastPolicy`` in effect, None when disabled."""

    def __init__(self, enable=True, custom_white_list=None, custom_black_list=None, level="O1",
                 dtype="float16"):
        if not isinstance(enable, bool):
            raise TypeError(f"auto_cast enable={enable!r}: True or False")
        policy = cast_policy(custom_white_list, custom_black_list, level, dtype)
        super().__init__(policy if enable else None)

    def __enter__(self):
        super().__enter__()
        # Overflow to inf in float16 is expected under loss scaling and handled by skipping
        # the step, as the amp strategy does, so NumPy's warnings about it stay silent.
        self._errstate = np.errstate(over="ignore", invalid="ignore")
        self._errstate.__enter__()
        return self

    def __exit__(self, *exc):
        self._errstate.__exit__(*exc)
        return super().__exit__(*exc)



def _listed(value, kind, where):
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if not isinstance(item, kind):
            names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple)
                                                     else (kind,)))
            raise TypeError(f"decorate {where} takes a {names} or a list of them, not "
                            f"{type(item).__name__}")
    return items


def decorate(models, optimizers=None, level="O1", dtype="float16", master_weight=None,
             save_dtype=None):
    """Paddle's ``paddle.amp.decorate``: returns ``models``, or ``(models, optimizers)`` when
    optimizers are given, as they came (module docstring: the parameters already are float32
    master weights, so level O2 has nothing to convert). Checks the arguments: ``level``
    ``"O1"`` or ``"O2"``, ``dtype`` ``"float16"`` or ``"bfloat16"``, ``master_weight`` None or
    True (float32 masters are always kept), ``save_dtype`` None or ``"float32"`` (the saved
    parameters are the float32 masters), and at level O2 float32 parameters."""
    level = _level(level, "decorate")
    if level == "O0":
        raise ValueError("decorate level='O0'; allowed: 'O1' or 'O2' (O0 trains in float32 "
                         "and needs no decorating)")
    low_precision_dtype(dtype, "decorate")
    if master_weight not in (None, True):
        raise ValueError(f"decorate master_weight={master_weight!r}; allowed: None or True: "
                         "the parameters are the float32 master weights, and an operator "
                         "computing in low precision takes a cast copy of them")
    if save_dtype not in SAVE_DTYPES:
        raise ValueError(f"decorate save_dtype={save_dtype!r}; allowed: None or 'float32': "
                         "state_dict saves the float32 master weights; cast the saved arrays "
                         "to keep another dtype")
    layers = _listed(models, Layer, "models")
    if optimizers is not None:
        _listed(optimizers, (Optimizer, DistributedOptimizer), "optimizers")
    if level == "O2":
        for layer in layers:
            dtypes = sorted({p.dtype.name for p in layer.parameters()} - {"float32"})
            if dtypes:
                raise ValueError(f"decorate level='O2' keeps float32 master weights, but "
                                 f"{type(layer).__name__} has {', '.join(dtypes)} parameters; "
                                 "build the model with dtype='float32'")
    return models if optimizers is None else (models, optimizers)


__all__ = ["auto_cast", "decorate"]

"""Which precision amp computes in, and whether it scales the loss: Paddle's amp_configs names
resolved to one ``Precision``.

Paddle has two ways to say it, and both are keys of ``amp_configs`` here:

* Fleet's switches ``use_pure_fp16`` and ``use_pure_bf16``: pure (level O2) training in
  float16 or bfloat16 (Paddle's ``fleet.distributed_model`` decorates the model to level O2 in
  the dtype they name).
* ``dtype`` (``"float16"`` or ``"bfloat16"``) and ``level`` (``"O1"`` or ``"O2"``), the
  arguments of ``paddle.amp.auto_cast`` and the keys of Paddle's auto-parallel amp config.

A ``use_pure_*`` switch means level O2 in its dtype; ``dtype``, where it differs from its
default float16, must name the same dtype, and the two switches exclude each other.

Level O1 computes the white list in the low-precision dtype, the black list in float32 and
every other operator in the dtype its inputs come in; level O2 computes every operator but
those of the black list in the low-precision dtype. Either way the parameters stay float32
(the master weights, updated by the optimizer over the float32 flat buffers with float32
state), and an operator computing in float16 or bfloat16 takes a cast copy of them.

Loss scaling follows Paddle's rule for bfloat16 (its static amp decorator): bfloat16 has
float32's exponent range, so dynamic loss scaling is turned off and the scale is 1 (no scaling,
no overflow check, no skipped step); a fixed scale, ``use_dynamic_loss_scaling=False`` with an
``init_loss_scaling`` other than 1, is kept. float16 scales the loss as configured.
"""
from dataclasses import dataclass

import numpy as np

from fleetmpi.core import backend

FLOAT16 = "float16"
BFLOAT16 = "bfloat16"
PURE_SWITCHES = {"use_pure_fp16": FLOAT16, "use_pure_bf16": BFLOAT16}
GROWTH_KEYS = ("incr_every_n_steps", "decr_every_n_nan_or_inf", "incr_ratio", "decr_ratio")


@dataclass(frozen=True)
class Precision:
    """``dtype``: ``"float16"`` or ``"bfloat16"``; ``level``: ``"O1"`` or ``"O2"``."""

    dtype: str
    level: str

    @property
    def pure(self):
        return self.level == "O2"

    def array_dtype(self):
        """The NumPy/CuPy dtype; bfloat16 needs ml_dtypes (a ValueError naming the keys that
        chose it, what to install and what else is allowed)."""
        if self.dtype == FLOAT16:
            return np.dtype(np.float16)
        try:
            return backend.bfloat16()
        except ValueError as exc:
            raise ValueError(f"amp_configs selects bfloat16 (use_pure_bf16, or dtype "
                             f"'bfloat16'): {exc}; or use dtype 'float16' (use_pure_fp16 for "
                             "level O2), which NumPy and CuPy have") from None


def resolve(config):
    """The ``Precision`` that ``config`` (an ``AMPConfig``, ``fleetmpi.strategies.configs``)
    selects; a ValueError naming the keys when they contradict each other."""
    pure = [key for key in PURE_SWITCHES if getattr(config, key)]
    if len(pure) == 2:
        raise ValueError("amp_configs.use_pure_fp16 and use_pure_bf16 are both set; each "
                         "selects pure (level O2) training in its own dtype: set one")
    if not pure:
        return Precision(config.dtype, config.level)
    dtype = PURE_SWITCHES[pure[0]]
    if config.dtype not in (FLOAT16, dtype):
        raise ValueError(f"amp_configs.{pure[0]} selects {dtype}, but amp_configs.dtype is "
                         f"{config.dtype!r}; set one of them, or both to {dtype!r}")
    return Precision(dtype, "O2")


def scales_loss(use_dynamic_loss_scaling, init_loss_scaling, precision):
    """Whether amp scales the loss and checks the gradients for overflow (module docstring:
    always in float16; in bfloat16 only at a fixed scale other than 1)."""
    if precision.dtype == FLOAT16:
        return True
    return not use_dynamic_loss_scaling and init_loss_scaling != 1


def unused_keys(config, defaults):
    """``{"amp_configs.<key>": why}`` for the loss-scaling keys of ``config`` (an
    ``AMPConfig``) that are set away from ``defaults``' and change nothing: all of them under
    bfloat16's dynamic loss scaling, which Paddle turns off, and the growth keys at a fixed
    scale."""
    if config.precision.dtype == BFLOAT16 and config.use_dynamic_loss_scaling:
        keys = GROWTH_KEYS + ("init_loss_scaling",)
        why = ("bfloat16 keeps float32's exponent range, so, as in Paddle, dynamic loss "
               "scaling is off and the loss scale is 1 (use_dynamic_loss_scaling=False keeps "
               "a fixed init_loss_scaling)")
    elif not config.use_dynamic_loss_scaling:
        keys, why = GROWTH_KEYS, ("use_dynamic_loss_scaling is off: the loss scale stays at "
                                  "init_loss_scaling")
    else:
        return {}
    return {f"amp_configs.{key}": why for key in keys
            if getattr(config, key) != getattr(defaults, key)}

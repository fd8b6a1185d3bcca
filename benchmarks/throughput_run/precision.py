"""The precisions a model trains in, and how each trainer is asked for one.

fleetmpi: ``strategy.amp = True`` with amp's configs; ``request_amp`` is the one place that
asks for bfloat16, by Paddle's names for it (``BF16_REQUESTS``), so a fleetmpi without
bfloat16 amp gives a reason instead of a crash. PyTorch: ``torch.autocast`` of the dtype, and
a ``GradScaler`` for float16.
"""
import numpy as np

PRECISIONS = ("fp32", "amp-fp16", "amp-bf16")
# The dtype amp computes matrix products in, per precision.
AMP_DTYPES = {"amp-fp16": "float16", "amp-bf16": "bfloat16"}
# Paddle's ways of asking amp for bfloat16, tried in order: the ``dtype`` of paddle.amp's
# auto_cast and decorate, then Fleet's ``use_pure_bf16``.
BF16_REQUESTS = ({"dtype": "bfloat16"}, {"use_pure_bf16": True})


class Unsupported(Exception):
    """This trainer cannot train in the precision asked for; the message says why."""


def request_amp(strategy, precision):
    """Ask ``strategy`` (a ``DistributedStrategy``) for ``precision``: nothing for fp32, amp
    for the others, bfloat16 through the first of ``BF16_REQUESTS`` that amp_configs takes.
    Raises ``Unsupported`` when none is taken."""
    if precision == "fp32":
        return
    strategy.amp = True
    if precision != "amp-bf16":
        return
    for configs in BF16_REQUESTS:
        try:
            strategy.amp_configs = configs
            return
        except (KeyError, ValueError, TypeError):
            continue
    tried = ", ".join(f"{key}={value!r}" for configs in BF16_REQUESTS
                      for key, value in configs.items())
    raise Unsupported(f"fleetmpi's amp_configs takes none of Paddle's bfloat16 settings "
                      f"({tried}): its amp computes in float16 only")


def fleetmpi_reason(precision):
    """Why fleetmpi cannot train in ``precision``, or None when its strategy takes it."""
    import fleetmpi as fleet

    try:
        request_amp(fleet.DistributedStrategy(), precision)
    except Unsupported as exc:
        return str(exc)
    return None


def _dtype_name(dtype):
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def check_amp_dtype(opt, precision):
    """Raise ``Unsupported`` when the amp of distributed optimizer ``opt`` does not compute
    matrix products in ``precision``'s dtype (a config taken, but not acted on)."""
    if precision not in AMP_DTYPES:
        return
    policy = getattr(opt.strategies.get("amp"), "policy", None)
    if policy is None:
        return
    computed = _dtype_name(policy.dtype_for("matmul"))
    if computed != AMP_DTYPES[precision]:
        raise Unsupported(f"amp took the {precision} request, but matmul computes in "
                          f"{computed}")


def torch_autocast(precision, device_type):
    """The autocast context of ``precision`` (a disabled one for fp32)."""
    import torch

    dtype = getattr(torch, AMP_DTYPES.get(precision, "float32"))
    return torch.autocast(device_type, dtype=dtype, enabled=precision in AMP_DTYPES)


def torch_scaler(precision, device_type):
    """A ``GradScaler``, enabled for float16 only (bfloat16 has float32's range)."""
    import torch

    return torch.amp.GradScaler(device_type, enabled=precision == "amp-fp16")

"""The knobs of ``strategy.auto``, each an argument of ``distributed_optimizer`` and an
environment variable (the argument wins):

- ``auto_seconds`` / ``FLEETMPI_AUTO_SECONDS``: the most seconds the calibration may take
  (default 3). Every decision to measure more is taken against this bound, so calibration
  ends within it plus at most one training step.
- ``auto_allow`` / ``FLEETMPI_AUTO_ALLOW``: which strategies that change the training's
  arithmetic auto may choose, comma-separated, or ``none``. Settings that leave the arithmetic
  as it is (fusion size, the allreduce algorithm, recompute) are always candidates. The
  default, ``fp16_allreduce,amp``, allows float16 where it only rounds: gradients on the wire,
  compute on a GPU; the updates and the batch stay as asked. ``gradient_merge`` (fewer updates
  of a larger batch), ``dgc`` (sparse gradients), ``localsgd`` and ``adaptive_localsgd``
  (parameter averaging instead of gradient averaging) change convergence, and are candidates
  only when listed here.
- ``auto_memory_MB`` / ``FLEETMPI_AUTO_MEMORY_MB``: the activation memory one rank may hold;
  above it auto enables recompute. Default: the device's free memory on a GPU, and on CPU half
  the available host memory shared by the ranks of the node.
"""
import math
import numbers
import os

SECONDS_ENV = "FLEETMPI_AUTO_SECONDS"
ALLOW_ENV = "FLEETMPI_AUTO_ALLOW"
MEMORY_ENV = "FLEETMPI_AUTO_MEMORY_MB"
DEFAULT_SECONDS = 3.0
ROUNDING = ("fp16_allreduce", "amp")
CONVERGENCE = ("gradient_merge", "dgc", "localsgd", "adaptive_localsgd")
ALLOWABLE = ROUNDING + CONVERGENCE
DEFAULT_ALLOW = ROUNDING


class AutoKnobs:
    """``seconds``: the calibration bound; ``allow``: the frozenset of allowed strategies that
    change the arithmetic; ``memory_bytes``: the activation budget, None for the default."""

    def __init__(self, seconds, allow, memory_bytes):
        self.seconds = seconds
        self.allow = allow
        self.memory_bytes = memory_bytes


def _positive_number(name, value):
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} must be a positive number") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive number")
    return float(value)


def _allowed(name, value):
    if isinstance(value, str):
        text = value.strip()
        names = [] if text.lower() == "none" else [part.strip() for part in text.split(",")]
    elif isinstance(value, (list, tuple, set, frozenset)):
        names = list(value)
    else:
        raise ValueError(f"{name}={value!r} must be a comma-separated string or a list of "
                         f"strategy names")
    unknown = [n for n in names if n not in ALLOWABLE]
    if unknown:
        raise ValueError(f"{name}={value!r}: {', '.join(map(repr, unknown))} cannot be allowed; "
                         f"allowed: {', '.join(ALLOWABLE)}, or 'none'")
    return frozenset(names)


def _pick(argument, env, default):
    """``(name for messages, value)``: the argument when given, else the environment variable
    when set and not empty, else ``default``."""
    name, value = argument
    if value is not None:
        return name, value
    text = os.environ.get(env, "")
    return (env, text) if text != "" else (name, default)


def auto_knobs(auto_seconds=None, auto_allow=None, auto_memory_MB=None):
    """The knobs from the arguments and the environment; a bad value raises a ValueError that
    names it and what is allowed."""
    seconds = _positive_number(*_pick(("auto_seconds", auto_seconds), SECONDS_ENV,
                                      DEFAULT_SECONDS))
    allow = _allowed(*_pick(("auto_allow", auto_allow), ALLOW_ENV, DEFAULT_ALLOW))
    name, memory = _pick(("auto_memory_MB", auto_memory_MB), MEMORY_ENV, None)
    memory_bytes = None if memory is None else int(_positive_number(name, memory) * 2 ** 20)
    return AutoKnobs(seconds, allow, memory_bytes)

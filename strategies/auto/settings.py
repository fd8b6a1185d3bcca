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

The variables, their defaults and parsers are ``fleetmpi.core.knobs``' (``AUTO_SECONDS``,
``AUTO_ALLOW``, ``AUTO_MEMORY_MB``); an argument is checked by the same parser.
"""
from fleetmpi.core import knobs


class AutoKnobs:
    """``seconds``: the calibration bound; ``allow``: the frozenset of allowed strategies that
    change the arithmetic; ``memory_bytes``: the activation budget, None for the default."""

    def __init__(self, seconds, allow, memory_bytes):
        self.seconds = seconds
        self.allow = allow
        self.memory_bytes = memory_bytes


def _pick(knob, argument_name, argument):
    """The argument, checked by the knob's parser, when given; else the knob's value."""
    return knob.value() if argument is None else knob.parse(argument_name, argument)


def auto_knobs(auto_seconds=None, auto_allow=None, auto_memory_MB=None):
    """The knobs from the arguments and the environment; a bad value raises a ValueError that
    names it and what is allowed."""
    seconds = _pick(knobs.AUTO_SECONDS, "auto_seconds", auto_seconds)
    allow = _pick(knobs.AUTO_ALLOW, "auto_allow", auto_allow)
    memory = _pick(knobs.AUTO_MEMORY_MB, "auto_memory_MB", auto_memory_MB)
    memory_bytes = None if memory is None else int(memory * 2 ** 20)
    return AutoKnobs(seconds, allow, memory_bytes)

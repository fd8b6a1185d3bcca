"""Fields of DistributedStrategy that change nothing in collective training, found set in a
strategy, and reported once per process.

Which fields those are, and why, is ``field_effects.NO_EFFECT``. A field of it that a user set
away from its default is reported once per process, on the first worker, so it is never
silently ignored.
"""
from fleetmpi.core.log import logger
from .field_effects import NO_EFFECT

_reported = set()


def _value(strategy, path):
    value = strategy
    for part in path.split("."):
        value = getattr(value, part)
    return dict(value) if hasattr(value, "keys") else value


def inert_fields_set(strategy):
    """The ``NO_EFFECT`` fields ``strategy`` holds at something other than their default."""
    from fleetmpi.config.distributed_strategy import DistributedStrategy

    default = DistributedStrategy()
    return [path for path in NO_EFFECT if _value(strategy, path) != _value(default, path)]


def report_once(path, why, first_worker):
    """Warn (where ``first_worker``) that ``DistributedStrategy.<path>`` has no effect, once
    per process."""
    if path in _reported:
        return
    _reported.add(path)
    if first_worker:
        logger.warning("DistributedStrategy.%s is set but has no effect in fleetmpi: %s",
                       path, why)

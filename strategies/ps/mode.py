"""The training mode a ``DistributedStrategy`` asks of parameter-server mode.

``a_sync=False``: synchronous. ``a_sync=True`` with ``k_steps`` -1 or 0: asynchronous; with
``k_steps > 0``: GEO, pushing parameter deltas every ``k_steps`` local steps. What each
``a_sync_configs`` key does here is ``fleetmpi.strategies.field_effects``' (``EFFECTIVE_KEYS``,
``NO_EFFECT_KEYS``); keys that change nothing are listed by ``applied_strategy().not_applied``
with their reasons (``fleetmpi.strategies.applied.parameter_server_not_applied``) and warned
once.
"""
from fleetmpi.config.schema_view import ConfigError
from fleetmpi.strategies.compose import ORDER
from fleetmpi.strategies.configs import AsyncConfig

SYNC, ASYNC, GEO = "sync", "async", "geo"


def training_mode(strategy):
    """``SYNC``, ``ASYNC`` or ``GEO`` for ``strategy``; refuses what cannot run here."""
    # every collective strategy works on the gradient reduction of collective training, which
    # does not exist in parameter-server mode
    on = [name for name in ORDER if getattr(strategy, name)]
    if on:
        raise ConfigError(f"parameter-server mode cannot run the collective strategies "
                          f"{on}; switch them off or use fleet.init(is_collective=True)")
    k_steps = AsyncConfig.of(strategy).k_steps
    if not strategy.a_sync:
        if k_steps > 0:
            raise ConfigError(f"a_sync_configs k_steps={k_steps} selects GEO training, which "
                              "needs a_sync=True; a_sync=False is synchronous training")
        return SYNC
    return GEO if k_steps > 0 else ASYNC

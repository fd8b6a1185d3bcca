"""The training mode a ``DistributedStrategy`` asks of parameter-server mode, and what each
``a_sync_configs`` key does here.

``a_sync=False``: synchronous. ``a_sync=True`` with ``k_steps`` -1 or 0: asynchronous; with
``k_steps > 0``: GEO, pushing parameter deltas every ``k_steps`` local steps. Keys that change
nothing here are listed by ``applied_strategy().not_applied`` with these reasons
(``fleetmpi.strategies.applied.parameter_server_not_applied``) and warned once.
"""
from ...config_message import ConfigError
from ..compose import ORDER

SYNC, ASYNC, GEO = "sync", "async", "geo"

EFFECTIVE_KEYS = {
    "k_steps": "selects asynchronous (-1, 0) or GEO (> 0) training and GEO's push interval",
}

NO_EFFECT_KEYS = {
    "max_merge_var_num": "every step's gradient is pushed on its own",
    "send_queue_size": "a worker has one push per server in flight, sent as soon as it is made",
    "independent_recv_thread": "each push is answered with the parameters; there is no "
                               "receiving thread",
    "min_send_grad_num_before_recv": "each push is answered with the parameters",
    "thread_pool_size": "a server handles its messages one at a time",
    "send_wait_times": "pushes are never held back",
    "runtime_split_send_recv": "parameters are always cut into blocks when the servers start",
    "launch_barrier": "a worker's first pull waits for its servers anyway",
    "heter_worker_device_guard": "there are no heterogeneous workers",
    "lr_decay_steps": "each push carries the learning rate of the worker's optimizer, so a "
                      "scheduler steps where the script steps it",
    "use_ps_gpu": "servers keep their shards in host memory",
}

def training_mode(strategy):
    """``SYNC``, ``ASYNC`` or ``GEO`` for ``strategy``; refuses what cannot run here."""
    # every collective strategy works on the gradient reduction of collective training, which
    # does not exist in parameter-server mode
    on = [name for name in ORDER if getattr(strategy, name)]
    if on:
        raise ConfigError(f"parameter-server mode cannot run the collective strategies "
                          f"{on}; switch them off or use fleet.init(is_collective=True)")
    k_steps = strategy.a_sync_configs["k_steps"]
    if not strategy.a_sync:
        if k_steps > 0:
            raise ConfigError(f"a_sync_configs k_steps={k_steps} selects GEO training, which "
                              "needs a_sync=True; a_sync=False is synchronous training")
        return SYNC
    return GEO if k_steps > 0 else ASYNC

"""``Strategy``: the base of every strategy class, a step hook built from a DistributedStrategy.

A strategy is enabled by the DistributedStrategy field of its ``name`` and configured by the
``<name>_configs`` message when there is one, which it reads through its typed view
(``config_class``, built once as ``self.config``). It takes part in every training step through
the ``StepHook`` stages (forward, backward, on_gradient, reduce, update, after_step);
``compose`` puts the enabled ones in a fixed order around the gradient reduction, building and
placing each as its class attributes say (``communicator_scope``, ``lays_out_ranks``,
``is_gradient_reduction``, ``reduces_gradients``, ``local_steps``, ``checks_every_update``), so
that compose never asks a strategy for its name.
"""
from fleetmpi.optimizer import StepHook


class Strategy(StepHook):
    """One strategy of a ``DistributedOptimizer``.

    ``optimizers``: the optimizer classes it can wrap (None: any), checked by ``check`` before
    anything is built. ``communicator`` is None in a single-process job; strategies that
    communicate then have nothing to do across ranks and must still compute the same math.
    """

    name = None
    optimizers = None
    # The typed view of ``<name>_configs`` (``fleetmpi.strategies.configs``); None: no configs.
    config_class = None
    # The ranks it runs over: "world" (the communicator compose is given), "replicas" (those
    # holding the same part of the model: the replica communicator of a strategy that
    # ``lays_out_ranks``, else the world) or "agreement" (every rank that must share a
    # decision to skip a step, more than the world under a hybrid layout).
    communicator_scope = "world"
    # Lays the ranks out (pipeline): built before the others, over the world, it narrows the
    # optimizer to this rank's part, and its ``replica_communicator`` is the "replicas" scope.
    lays_out_ranks = False
    # A form of the gradient reduction (the plain or fp16 allreduce): compose runs it
    # innermost, over the replicas, wherever there is more than one and no strategy
    # ``reduces_gradients`` itself.
    is_gradient_reduction = False
    # Its own communication reduces the gradients (sharding's reduce-scatter): no gradient
    # reduction is added, and the non-finite check runs right before it.
    reduces_gradients = False
    # The ranks take steps of their own between exchanges (localsgd): a step whose gradients
    # are not synchronised needs no agreement on a non-finite verdict.
    local_steps = False
    # Checks every update for non-finite values itself (amp with loss scaling): no non-finite
    # check is added. An instance's answer, as it may depend on the configs.
    checks_every_update = False

    def __init__(self, strategy, optimizer, communicator):
        self.config = None if self.config_class is None else self.config_class.of(strategy)
        self.optimizer = optimizer
        self.communicator = communicator

    @property
    def world_size(self):
        return 1 if self.communicator is None else self.communicator.size

    @classmethod
    def check(cls, strategy, optimizer):
        """Raise a ValueError naming what in ``strategy`` or ``optimizer`` this strategy cannot
        work with."""
        if cls.optimizers is not None and not isinstance(optimizer, cls.optimizers):
            allowed = " or ".join(c.__name__ for c in cls.optimizers)
            raise ValueError(f"strategy {cls.name} works with a {allowed} optimizer, not "
                             f"{type(optimizer).__name__}")

    def allreduce_mean(self, arrays, compression=None):
        """Average ``arrays`` over the ranks in place (nothing to do alone)."""
        if self.world_size > 1 and arrays:
            self.communicator.allreduce_many(arrays, op="mean", compression=compression)

    def state_dict(self):
        """What this strategy keeps between steps, for checkpoints (host arrays and numbers)."""
        return {}

    def set_state_dict(self, state):
        if state:
            raise KeyError(f"strategy {self.name} keeps no state, got keys {sorted(state)}")

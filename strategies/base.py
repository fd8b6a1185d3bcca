"""``Strategy``: the base of every strategy class, a step hook built from a DistributedStrategy.

A strategy is enabled by the DistributedStrategy field of its ``name`` and configured by the
``<name>_configs`` dict when there is one. It takes part in every training step through the
``StepHook`` stages (forward, backward, on_gradient, reduce, update, after_step); ``compose``
puts the enabled ones in a fixed order around the gradient reduction.
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

    def __init__(self, strategy, optimizer, communicator):
        self.configs = dict(getattr(strategy, f"{self.name}_configs", {}))
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

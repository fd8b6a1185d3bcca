"""``localsgd`` and ``adaptive_localsgd``: after ``begin_step``, every rank updates its own copy
of the parameters from its own gradients, and the ranks average their parameters every k steps.

Steps are counted from 1. Steps up to ``begin_step`` are ordinary synchronous data parallel
(gradients averaged every step). After it, steps are local, and the parameters are averaged over
the ranks once ``k`` local steps have passed since the last averaging (Lin et al., "Don't Use
Large Mini-Batches, Use Local SGD", 2018). With k = 1 and an optimizer whose update is linear in
the gradient (SGD, Momentum), averaging the parameters after every local step is synchronous
SGD. Optimizer state (momentum) stays local, as in Paddle's LocalSGD.

``localsgd`` keeps k fixed at ``k_steps``. ``adaptive_localsgd`` starts from ``init_k_steps``
and chooses the next k at every averaging from the loss averaged over the ranks at that step and
the current learning rate, as in Wang & Joshi's AdaComm ("Adaptive Communication Strategies to
Achieve the Best Error-Runtime Trade-off in Local-Update SGD", 2019) and Paddle's
AdaptiveLocalSGD:

    k = ceil(sqrt(lr_0 * loss / (lr * loss_0) * init_k_steps)), clamped to [1, 16]

where ``loss_0`` and ``lr_0`` are the averaged loss and the learning rate of step
``max(begin_step, 1)`` (or of the first later step with a finite loss). A larger loss relative
to the start, or a smaller learning rate, means longer local periods. Where the ratio is
undefined (zero ``lr`` or ``loss_0``, a loss that is not finite) k is kept.
"""
import math

import numpy as np

from fleetmpi.core import backend
from .base import Strategy
from .configs import AdaptiveLocalSGDConfig, LocalSGDConfig

MAX_K_STEPS = 16


class LocalSGD(Strategy):
    """Fixed period: ``k_steps`` local steps between parameter averagings."""

    name = "localsgd"
    config_class = LocalSGDConfig
    local_steps = True
    capture_refusal = ("when to average the parameters (every k_steps after begin_step) is "
                       "decided on the host step by step, and a graph would replay the one "
                       "step it captured")

    def __init__(self, strategy, optimizer, communicator):
        super().__init__(strategy, optimizer, communicator)
        self.begin_step = self.config.begin_step
        self.k_steps = self._initial_k_steps()
        self.last_averaged_step = self.begin_step
        self.averagings = 0

    def _initial_k_steps(self):
        return self.config.k_steps

    def _local(self, ctx):
        return ctx.step + 1 > self.begin_step

    def forward(self, ctx, proceed):
        if self._local(ctx):
            ctx.sync_gradients = False
        return proceed(ctx)

    def after_step(self, ctx, proceed):
        step = ctx.step + 1
        self._observe(ctx, step)
        if self._local(ctx) and step - self.last_averaged_step >= self.k_steps:
            self.allreduce_mean([run.data for run in self.optimizer.runs])
            self.last_averaged_step = step
            self.averagings += 1
            self._adapt(ctx)
        return proceed(ctx)

    def _observe(self, ctx, step):
        """A hook for the adaptive schedule's reference point."""

    def _adapt(self, ctx):
        """A hook for the adaptive schedule: choose the next ``k_steps``."""

    def state_dict(self):
        return {"k_steps": self.k_steps, "last_averaged_step": self.last_averaged_step,
                "averagings": self.averagings}

    def set_state_dict(self, state):
        self.k_steps = int(state["k_steps"])
        self.last_averaged_step = int(state["last_averaged_step"])
        self.averagings = int(state["averagings"])


class AdaptiveLocalSGD(LocalSGD):
    """The period adapts at every averaging; ``k_steps`` is the current one and ``history``
    lists ``(step, averaged loss, learning rate, next k_steps)`` for every averaging."""

    name = "adaptive_localsgd"
    config_class = AdaptiveLocalSGDConfig

    def __init__(self, strategy, optimizer, communicator):
        super().__init__(strategy, optimizer, communicator)
        self.init_k_steps = self.config.init_k_steps
        self.loss_0 = None
        self.lr_0 = None
        self.history = []

    def _initial_k_steps(self):
        return self.config.init_k_steps

    def _average_loss(self, ctx):
        xp = backend.array_module()
        loss = xp.array(ctx.loss, dtype=np.float64).reshape(1)
        self.allreduce_mean([loss])
        return float(loss[0])

    def _observe(self, ctx, step):
        """Record the reference point at step ``max(begin_step, 1)``, or at the first step
        after it whose averaged loss is finite (an amp step that overflowed has none)."""
        if self.loss_0 is None and step >= max(self.begin_step, 1):
            loss = self._average_loss(ctx)
            if math.isfinite(loss):
                self.loss_0 = loss
                self.lr_0 = float(self.optimizer.get_lr())

    def _adapt(self, ctx):
        loss = self._average_loss(ctx)
        lr = float(self.optimizer.get_lr())
        self.k_steps = next_k_steps(self.init_k_steps, self.lr_0, self.loss_0, lr, loss,
                                    self.k_steps)
        self.history.append((self.last_averaged_step, loss, lr, self.k_steps))

    def state_dict(self):
        state = super().state_dict()
        state.update(loss_0=self.loss_0, lr_0=self.lr_0)
        return state

    def set_state_dict(self, state):
        super().set_state_dict(state)
        self.loss_0 = None if state["loss_0"] is None else float(state["loss_0"])
        self.lr_0 = None if state["lr_0"] is None else float(state["lr_0"])


def next_k_steps(init_k_steps, lr_0, loss_0, lr, loss, current):
    """AdaComm's next communication period, clamped to [1, ``MAX_K_STEPS``]; ``current`` when
    the ratio is undefined (no finite reference loss yet, zero learning rate or zero initial
    loss, or a loss that is not finite)."""
    if loss_0 is None or not lr or not loss_0 or not math.isfinite(loss):
        return current
    ratio = lr_0 * loss / (lr * loss_0) * init_k_steps
    return int(min(max(math.ceil(math.sqrt(max(ratio, 0.0))), 1), MAX_K_STEPS))

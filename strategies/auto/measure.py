"""The measuring side of ``strategy.auto``: training state put back after trial steps, a clock
every rank reads alike, and timings of collectives and of training steps.

Every number a decision rests on is the slowest rank's (a maximum over the ranks), so every rank
takes the same decisions in the same order and issues the same collectives.
"""
import time

import numpy as np

from fleetmpi.core import backend
from fleetmpi.autograd.recompute import held_activation_bytes
from fleetmpi.optimizer import StepContext, StepHook, run_step


class TrainingState:
    """A copy of what trial steps change: the model's parameters, gradients and buffers, the
    optimizer's state (step count and learning-rate schedule included) and the rank random
    generator (dropout masks), so ``restore`` puts the training back exactly where it was."""

    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer
        self._settle()
        self.flats = [(b.data.copy(), b.grad.copy()) for b in model.flat_buffers()]
        self.buffers = [b.copy() for _, b in model.named_buffers()]
        self.optimizer_state = optimizer.state_dict()
        self.rng = backend.rank_rng_snapshot()
        if backend.on_gpu():
            self.rng = self.rng.copy()

    def _settle(self):
        """Write the zeros that cleared gradients stand for, so the flat gradient buffers
        hold every gradient as it is (``Parameter.clear_gradient``)."""
        for p in self.model.parameters():
            p.settle_gradient()

    def restore(self):
        self._settle()
        for buffer, (data, grad) in zip(self.model.flat_buffers(), self.flats):
            buffer.data[...] = data
            buffer.grad[...] = grad
        for (_, b), saved in zip(self.model.named_buffers(), self.buffers):
            b[...] = saved
        self.optimizer.set_state_dict(self.optimizer_state)
        backend.restore_rank_rng(self.rng)


class Agreement:
    """Numbers every rank agrees on: the maximum over the ranks, or rank 0's choice."""

    def __init__(self, communicator):
        self.communicator = communicator
        self.world = 1 if communicator is None else communicator.size

    def max(self, values):
        values = np.asarray(values, dtype=np.float64).reshape(-1)
        if self.world == 1:
            return values
        return self.communicator.allreduce(values, op="max", algorithm="native")

    def from_rank0(self, index):
        if self.world == 1:
            return index
        value = np.array([index], dtype=np.int64)
        return int(self.communicator.broadcast(value, root=0, algorithm="native")[0])


class Clock:
    """Seconds since calibration began, the slowest rank's, against the bound."""

    def __init__(self, seconds, agreement):
        self.seconds = seconds
        self.agreement = agreement
        self.start = time.perf_counter()

    def elapsed(self):
        """Collective: every rank must call it at the same point."""
        return float(self.agreement.max([time.perf_counter() - self.start])[0])

    def left(self):
        return self.seconds - self.elapsed()


def time_allreduce(communicator, agreement, nbytes, algorithm, compression, share):
    """Seconds of one allreduce of ``nbytes`` of float32 with ``algorithm`` and
    ``compression``: the median of up to 5 timed calls after one untimed, as many as fit in
    ``share`` seconds (at least one)."""
    xp = backend.array_module()
    buffer = xp.zeros(max(nbytes // 4, 1), dtype=np.float32)

    def once():
        backend.synchronize()
        begin = time.perf_counter()
        communicator.allreduce(buffer, op="mean", algorithm=algorithm, compression=compression,
                               out=buffer)
        backend.synchronize()
        return time.perf_counter() - begin

    first = float(agreement.max([once()])[0])
    repeats = int(min(5, max(1, share / max(first, 1e-9) - 1)))
    times = agreement.max([once() for _ in range(repeats)])
    return float(np.median(times))


class StepTimer:
    """Times training steps of one model on one batch under given step hooks."""

    def __init__(self, model, loss_fn, x, y, optimizer):
        self.model = model
        self.loss_fn = loss_fn
        self.x = x
        self.y = y
        self.optimizer = optimizer

    def run(self, hooks, first, count):
        """This rank's seconds for ``count`` steps through ``hooks``, numbered from ``first``."""
        backend.synchronize()
        begin = time.perf_counter()
        for index in range(first, first + count):
            run_step(hooks, StepContext(self.model, self.loss_fn, self.x, self.y,
                                        self.optimizer, step=index))
        backend.synchronize()
        return time.perf_counter() - begin


class _ForwardOnly(StepHook):
    """Runs only the forward of a step, with the calls of the model's sublayers watched, and
    measures what the recorded graph of the model's output holds for backward; backward and
    the update do not run, so the graph is dropped with the step."""

    def __init__(self):
        self.held = 0
        self.calls = []

    def forward(self, ctx, proceed):
        handles = [layer.register_forward_post_hook(self._called(name))
                   for name, layer in ctx.model.named_sublayers()]
        try:
            proceed(ctx)
        finally:
            for handle in handles:
                handle.remove()
        self.held = held_activation_bytes(ctx.model, ctx.output)

    def _called(self, name):
        def hook(layer, inputs, output):
            self.calls.append(name)
        return hook

    def backward(self, ctx, proceed):
        return None

    def update(self, ctx, proceed):
        return None


def measure_forward(model, loss_fn, x, y, optimizer):
    """``(bytes, called)``: the device bytes one recorded forward of ``model`` on ``x`` holds
    for backward (``fleetmpi.autograd.recompute.ActivationMeter``), and the dotted names of
    the sublayers it called exactly once, in call order. Parameters and optimizer state are
    left alone; buffers (batch-norm statistics) and the rank generator move as in a step."""
    probe = _ForwardOnly()
    run_step([probe], StepContext(model, loss_fn, x, y, optimizer))
    counts = {}
    for name in probe.calls:
        counts[name] = counts.get(name, 0) + 1
    return probe.held, [name for name in counts if counts[name] == 1]

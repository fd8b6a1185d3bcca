"""``gradient_merge``: update the parameters once every ``k_steps`` steps, with the gradients of
those steps merged (``avg``: their mean, else their sum).

On the first ``k_steps - 1`` steps of a window each parameter's gradient is added to an
accumulator as backward reports it, and the step neither communicates nor updates. On the last
step the accumulator is folded into the fresh gradient as backward reports it, before the
gradient allreduce sees the bucket, so the merged gradient travels once, overlapped with backward
as usual. With ``avg`` and equal batches, k steps of batch b are exactly one step of batch k·b.

Under sharding stage 2 or 3 there is no full-size gradient to merge into: every step's
gradients are reduce-scattered as usual, and the window is merged in the optimizer's
``shard_gradient`` instead (``ctx.keep_gradients`` between updates; with ``avg`` divided by
``k_steps`` before the update), so a rank holds 1/N of the merged gradient.
"""
from fleetmpi.core import backend
from .base import Strategy
from .configs import GradientMergeConfig, ShardingConfig


class GradientMerge(Strategy):
    name = "gradient_merge"
    config_class = GradientMergeConfig
    capture_refusal = ("whether a step of the k_steps window updates is decided on the host "
                       "step by step, and a graph would replay the one step it captured")

    def __init__(self, strategy, optimizer, communicator):
        super().__init__(strategy, optimizer, communicator)
        self.k_steps = self.config.k_steps
        self.avg = self.config.avg
        self.micro_step = 0
        self.in_shard = strategy.sharding and ShardingConfig.of(strategy).partitions_gradients
        xp = backend.array_module()
        self._accumulators = [] if self.in_shard else [
            xp.zeros(run.stop - run.start, dtype=run.buffer.dtype) for run in optimizer.runs]
        self._views = {id(p): run.view(flat, p)
                       for run, flat in zip(optimizer.runs, self._accumulators)
                       for p in run.parameters}
        self._parameters = [p for run in optimizer.runs for p in run.parameters]
        self._merged = set()

    @property
    def boundary(self):
        """Whether the current step is the last of its window (the one that updates)."""
        return self.micro_step == self.k_steps - 1

    def forward(self, ctx, proceed):
        if not self.boundary:
            ctx.apply_update = False
            if self.in_shard:
                ctx.keep_gradients = True
            else:
                ctx.sync_gradients = False
        self._merged.clear()
        return proceed(ctx)

    def _merge(self, parameters):
        for p in parameters:
            accumulator = self._views.get(id(p))
            if accumulator is None or id(p) in self._merged:
                continue
            self._merged.add(id(p))
            if self.boundary:
                grad = p.grad.data
                grad += accumulator
                if self.avg and self.k_steps > 1:
                    grad *= 1.0 / self.k_steps
                accumulator[...] = 0
            else:
                accumulator += p.grad.data

    def on_gradient(self, ctx, parameters):
        if not self.in_shard:
            self._merge(parameters)

    def reduce(self, ctx, proceed):
        """Parameters backward never reported (no gradient this step) are merged here, before
        the gradient allreduce reduces the buckets left over."""
        if not self.in_shard:
            self._merge(self._parameters)
        return proceed(ctx)

    def update(self, ctx, proceed):
        if self.in_shard and self.boundary and self.avg and self.k_steps > 1:
            for _, grad in self.optimizer.flat_runs():
                grad *= 1.0 / self.k_steps
        return proceed(ctx)

    def after_step(self, ctx, proceed):
        self.micro_step = (self.micro_step + 1) % self.k_steps
        return proceed(ctx)

    def state_dict(self):
        state = {"micro_step": self.micro_step}
        for index, flat in enumerate(self._accumulators):
            state[f"accumulator.{index}"] = backend.to_numpy(flat).copy()
        return state

    def set_state_dict(self, state):
        self.micro_step = int(state["micro_step"])
        for index, flat in enumerate(self._accumulators):
            flat[...] = backend.asarray(state[f"accumulator.{index}"])

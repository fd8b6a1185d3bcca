"""``sync_batch_norm``: every BatchNorm layer of the model normalizes over the global batch.

In training, each BatchNorm combines the per-rank counts, sums and sums of squared deviations
into the mean and variance of the batch of all ranks, updates its running statistics from
those, and its recorded call sums the two per-channel gradient sums of its backward over the
ranks, so that after the gradient averaging every rank holds the gradients one process
computes on the global batch (``fleetmpi.nn.functional.norm.BatchNorm`` has the math). Eval
mode keeps using the running statistics and does not communicate. Alone (one rank, or
``local=True``) it is plain batch norm.

The strategy hands the communicator to the layers (``BatchNorm.sync_communicator``, which
the layer passes to ``F.batch_norm``) in the step's forward stage, which runs around the
model's forward in both training idioms: inside ``opt.minimize(model, loss_fn, x, y)``, and
when a model from ``distributed_model`` is called (``loss.backward(); opt.step()``). Each
recorded batch-norm call keeps the communicator it ran with, so its backward communicates
even though the layers get their own back in the after-step stage.
"""
from fleetmpi.core import job
from fleetmpi.core.log import logger
from fleetmpi.nn.norm import BatchNorm
from .base import Strategy


def batch_norm_layers(model):
    """``model`` itself if it is a BatchNorm, and every BatchNorm below it, at any depth."""
    layers = [model] + [layer for _, layer in model.named_sublayers()]
    return [layer for layer in layers if isinstance(layer, BatchNorm)]


def _first_worker():
    """Worker 0 of the job, or a process that never joined one (a world of one)."""
    try:
        return job.worker_index() == 0
    except RuntimeError:
        return True


class SyncBatchNorm(Strategy):
    """Gives every BatchNorm of the step's model the optimizer's communicator for the step
    (from the forward stage to the after-step stage, after which each layer gets back what it
    had; at once when the forward fails). ``layers``: the BatchNorm layers of the last step's
    model."""

    name = "sync_batch_norm"

    def __init__(self, strategy, optimizer, communicator):
        super().__init__(strategy, optimizer, communicator)
        self.layers = []
        self._previous = []
        self._warned = False

    def forward(self, ctx, proceed):
        if ctx.model is None:
            # No model runs in this step's forward stage (its backward ran outside a step the
            # model opened); the distributed optimizer refuses that step for this strategy.
            return proceed(ctx)
        self.layers = batch_norm_layers(ctx.model)
        if not self.layers:
            self._warn_nothing_to_do(ctx.model)
        communicator = self.communicator if self.world_size > 1 else None
        self._previous = [layer.sync_communicator for layer in self.layers]
        for layer in self.layers:
            layer.sync_communicator = communicator
        try:
            return proceed(ctx)
        except BaseException:
            self._restore()
            raise

    def after_step(self, ctx, proceed):
        self._restore()
        return proceed(ctx)

    def _restore(self):
        for layer, previous in zip(self.layers, self._previous):
            layer.sync_communicator = previous
        self._previous = []

    def _warn_nothing_to_do(self, model):
        if self._warned:
            return
        self._warned = True
        if _first_worker():
            logger.warning("sync_batch_norm is enabled but the model (%s) has no BatchNorm "
                           "layer; it has nothing to synchronise", type(model).__name__)

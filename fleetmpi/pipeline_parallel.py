"""``PipelineParallel``: what ``fleet.distributed_model`` returns for a ``PipelineLayer``, as
Paddle's ``fleet.meta_parallel.PipelineParallel``.

``train_batch([x, y], optimizer, lr_scheduler=None, scaler=None)`` trains one step of the
optimizer ``fleet.distributed_optimizer`` returned: its ``pipeline`` strategy (switched on by
``hybrid_configs["pp_degree"]``, or ``strategy.pipeline``) cuts the batch into
``pipeline_configs`` micro-batches (``accumulate_steps`` of ``micro_batch_size``, Paddle 2.4's
names; ``micro_batch`` is the seeds'), runs their forward and backward passes through the
stages in ``schedule_mode``'s order, sums the gradients of the weights shared between stages
over those stages, and its other strategies average the gradients over the data-parallel
replicas and update; then ``lr_scheduler.step()``. It returns the loss on every stage, as
Paddle's: the mean over the micro-batches of this replica's batch, computed by the last stage
and broadcast to the others. ``x`` matters on the first stage and ``y`` on the last; every
rank passes both. Either may be a tuple (or list) of tensors, cut into micro-batches item by
item, and a stage may hand a tuple of tensors on to the next (``strategies.pipeline_run``).

``eval_batch([x, y], compute_loss=False)`` runs the forwards alone (nothing recorded, the
layers in eval mode), in the micro-batches of the strategy given to ``fleet.init`` (Paddle
reads the same one): with ``compute_loss`` the mean loss on every stage, without it this
stage's output for each micro-batch (the model's outputs on the last stage), as Paddle's.

``scaler``: a ``fleetmpi.amp.GradScaler`` (or one ``fleet.distributed_scaler`` returned) scales
the loss as Paddle's PipelineParallel does: the last stage seeds each micro-batch's backward
with ``scale / accumulate_steps``, so the activation gradients travel back scaled; after the
schedule, the sum of the shared weights' gradients and the data-parallel averaging, the
gradients are unscaled and checked for inf and NaN, the verdict agreed by every rank of every
axis (the optimizer's agreement, or the world after ``distributed_scaler``), the update skipped
everywhere on overflow, and the scale updated (``GradScaler.minimize(optimizer, model,
loss_fn, x, y)``). Mixed precision is the caller's ``with fleetmpi.amp.auto_cast(...):``
around ``train_batch``, as PaddleNLP writes it: the forwards of the schedule compute under it
(the activations between stages travel in the dtype they are computed in), and so does the
loss on the last stage.
"""
from .autograd import Tensor, as_array
from .config.distributed_strategy import DistributedStrategy
from .nn.pipeline_layer import PipelineLayer
from .strategies.configs import PipelineConfig
from .strategies.pipeline import split_micro_batches
from .strategies.pipeline_run import StageLayout, StageSchedule, final_loss


def _arrays(value):
    """``value`` as an array, or a tuple of arrays for a tuple or list of tensors."""
    if isinstance(value, (list, tuple)):
        return tuple(as_array(item) for item in value)
    return as_array(value)


def _batch(data, where):
    """``(x, y)`` of Paddle's ``[x, y]`` as arrays, or tuples of arrays where Paddle's
    are tuples of tensors (the first stage gets the tuple); ``y`` may be None for
    eval_batch without a loss."""
    if not isinstance(data, (list, tuple)) or len(data) != 2:
        raise ValueError(f"{where} takes data as [inputs, labels], a list of two, not "
                         f"{type(data).__name__} {data!r:.60}")
    x, y = data
    return _arrays(x), None if y is None else _arrays(y)


class PipelineParallel:
    """A ``PipelineLayer`` trained by ``train_batch`` and evaluated by ``eval_batch`` (module
    docstring); everything else is the layer's (``parameters()``, ``state_dict()``, ...).
    ``strategy``: the one given to ``fleet.init`` (None: the default)."""

    def __init__(self, layers, strategy=None):
        if not isinstance(layers, PipelineLayer):
            raise TypeError(f"PipelineParallel wraps a PipelineLayer, not "
                            f"{type(layers).__name__}")
        self._layers = layers
        self._strategy = DistributedStrategy() if strategy is None else strategy

    def train_batch(self, data, optimizer, lr_scheduler=None, scaler=None):
        layer = self._layers
        x, y = _batch(data, "train_batch")
        if scaler is not None and not (callable(getattr(scaler, "minimize", None))
                                       and callable(getattr(scaler, "unscale_", None))):
            raise TypeError(f"train_batch scaler= takes a fleetmpi.amp.GradScaler (or the one "
                            f"fleet.distributed_scaler returned), not {type(scaler).__name__}")
        strategies = getattr(optimizer, "strategies", None)
        if strategies is None:
            raise TypeError(f"train_batch needs the optimizer fleet.distributed_optimizer "
                            f"returned, not {type(optimizer).__name__}")
        if "pipeline" not in strategies:
            raise ValueError("train_batch runs the pipeline schedule, but the optimizer's "
                             "strategy has no pipeline: set hybrid_configs['pp_degree'] to "
                             f"the PipelineLayer's num_stages ({layer.num_stages}), or "
                             "strategy.pipeline = True")
        if layer.loss_fn is None or y is None:
            raise ValueError("train_batch computes the loss on the last stage: build the "
                             "PipelineLayer with loss_fn=... and pass the labels as [x, y]")
        layer.train()
        if scaler is None:
            loss = optimizer.minimize(layer, layer.loss_fn, x, y)
        else:
            loss = scaler.minimize(optimizer, layer, layer.loss_fn, x, y)
        if lr_scheduler is not None:
            lr_scheduler.step()
        return Tensor(loss)

    def eval_batch(self, data, compute_loss=False):
        layer = self._layers
        x, y = _batch(data, "eval_batch")
        if compute_loss and (layer.loss_fn is None or y is None):
            raise ValueError("eval_batch(compute_loss=True) needs the PipelineLayer's loss_fn "
                             "and the labels in [x, y]")
        config = PipelineConfig.of(self._strategy)
        count, size = config.micro_batches, config.micro_batch_size
        xs = split_micro_batches(x, count, size, "input")
        ys = split_micro_batches(y, count, size, "labels")
        layout = StageLayout(layer.num_stages, layer.pipe_group)
        schedule = StageSchedule(layout, layer.pipe_group, config.schedule_mode, count,
                                 train=False)
        layer.eval()
        losses, outputs, _ = schedule.run([layer], xs, ys,
                                          layer.loss_fn if compute_loss else None, None)
        if compute_loss:
            return Tensor(final_loss(layout, layer.pipe_group, losses))
        return outputs

    def __getattr__(self, name):
        if name == "_layers":
            raise AttributeError(name)
        return getattr(self._layers, name)


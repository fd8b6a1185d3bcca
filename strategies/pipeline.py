"""``pipeline``: the layers of a model split into stages, one stage per rank, each mini-batch
split into micro-batches that flow through the stages (``pipeline_configs``: their number,
``micro_batch`` or Paddle 2.1's ``accumulate_steps``, and ``micro_batch_size``:
``split_micro_batches``).

Two kinds of model are split. A model built whole on every rank, cut by ``pipeline_stages``:
an ``nn.Sequential`` whose layers are marked with ``fleetmpi.device_guard``, an
``nn.Sequential`` of stages, or a user-defined Layer whose forward chains its top-level
sublayers (anything else is refused with the reason); a model without any stage is one stage.
The optimizer is narrowed to the rank's stage at construction, and a step runs only that
stage's layers. Or a ``PipelineLayer`` (``nn.pipeline_layer``), which builds only this rank's
stage and placed itself: its parameters are the optimizer's, it runs whole on its rank, its
communicator of the replica's stages carries the activations, and after the schedule the
gradients of the weights it shares between stages are summed over them. With S stages the
world is S x R ranks: rank r runs stage ``r % S`` of replica ``r // S``, so the stages of one
replica are neighbouring ranks (Paddle's layout: pipeline inside a node, data parallel across).
The passes themselves are ``pipeline_run``'s, which ``PipelineParallel`` shares.

Each micro-batch's forward on a stage is recorded like any forward: the activation received
from the previous stage becomes a Tensor that requires a gradient, the stage's layers run on
it, and the last stage computes the loss with the step's loss function. Its backward is the
engine's backward from the stage's output with the gradient received from the next stage (on
the last stage: from the loss, with the gradient ``loss_scale / micro-batches``), which leaves
the gradient of the received activation to send back. Every micro-batch in flight keeps its
own recorded graph until its backward frees it. Activations travel forward and their
gradients backward between neighbouring ranks through the comm layer's ``send``/``recv``, in
the order of ``pipeline_schedule`` (``schedule_mode`` "1F1B" by default, or "F-then-B").

The gradients are cleared once at the start of the schedule and the engine accumulates each
micro-batch's into them, so a step applies the gradient of the mean loss over the mini-batch:
the math of the unpipelined model with its gradients accumulated over the same micro-batches.
The schedule runs in the step's forward stage and marks the gradients ready
(``StepContext.gradients_ready``); the backward stage then reports the summed gradients to
every strategy's ``on_gradient`` (amp unscales them, gradient_merge merges them), and they are
averaged over the R replicas of the stage (the gradient reduction runs over a communicator of
those ranks). The loss ``minimize`` returns is the last stage's mean over the micro-batches,
broadcast to every stage of the replica. ``amp``'s autocast and loss scale wrap the whole
schedule; under ``recompute`` the checkpointed sublayers each micro-batch runs are recomputed
in its backward.

Without a communicator (``local=True``, or a world of one) all stages run in this process, one
after the other: the single-process math the ranks must match.
"""
import contextlib
import time

from fleetmpi.autograd import Tensor
from fleetmpi.nn import Sequential
from fleetmpi.nn.pipeline_layer import pipeline_layer_of
from fleetmpi.optimizer.clip import ClipGradByGlobalNorm
from fleetmpi.optimizer.step import loss_seed
from .base import Strategy
from .configs import PipelineConfig, RecomputeConfig
from .pipeline_run import StageLayout, StageSchedule, elapsed, final_loss
from .pipeline_schedule import check_schedule_mode
from .pipeline_stages import check_chain, count_stages, stage_modules
from .recompute import HostCheckpoints, checkpoint_forwards


def split_micro_batches(array, count, size, what):
    """``array`` cut along its first axis into ``count`` micro-batches: of ``size`` samples
    each, the batch holding exactly ``count`` x ``size`` (as Paddle checks), or with ``size``
    left at 1, of an equal share each. A tuple (or list) of arrays is cut item by item into
    a tuple per micro-batch."""
    if array is None:
        return None
    if isinstance(array, (tuple, list)):
        return list(zip(*(split_micro_batches(item, count, size, what) for item in array)))
    batch = array.shape[0]
    if size > 1 and batch != count * size:
        raise ValueError(f"pipeline: a batch of {batch} samples ({what}) is not "
                         f"accumulate_steps x micro_batch_size = {count} x {size} = "
                         f"{count * size}; give batches of that size, or leave "
                         "micro_batch_size at 1 to split any batch into equal micro-batches")
    if batch % count:
        raise ValueError(f"pipeline: a batch of {batch} samples ({what}) cannot be split into "
                         f"{count} equal micro-batches (pipeline_configs micro_batch={count}, "
                         f"or accumulate_steps={count})")
    share = batch // count
    return [array[k * share:(k + 1) * share] for k in range(count)]


# -- the strategy -----------------------------------------------------------------------------

class Pipeline(Strategy):
    """``pipeline`` (module docstring). ``layout`` tells this rank's stage and replica;
    ``replica_communicator`` averages the stage's gradients over its replicas (None with one
    replica); ``pipeline_communicator`` joins the stages of this rank's replica; ``layer``: the
    ``PipelineLayer`` whose parameters the optimizer holds, or None.
    ``compute_seconds``: the time the last step spent computing this stage's forward and
    backward passes (the loss included), without the waits and transfers;
    ``schedule_seconds``: the wall time of the last step's schedule, those passes with the
    waits and transfers between them (the optimizer update and the replica averaging come
    after it), so ``1 - compute_seconds / schedule_seconds`` is the step's bubble."""

    name = "pipeline"
    config_class = PipelineConfig
    lays_out_ranks = True
    capture_refusal = ("its micro-batch schedule exchanges shapes between the stages on the "
                       "host, which a graph cannot replay")

    def __init__(self, strategy, optimizer, communicator):
        super().__init__(strategy, optimizer, communicator)
        self.micro_batch = self.config.micro_batches
        self.micro_batch_size = self.config.micro_batch_size
        self.schedule_mode = check_schedule_mode(self.config.schedule_mode)
        build = strategy.build_strategy
        self._fusion = (bool(build.fuse_elewise_add_act_ops), bool(build.fuse_bn_act_ops))
        self.layer = pipeline_layer_of(optimizer.parameters())
        stages = count_stages(optimizer.parameters()) if self.layer is None else \
            self.layer.num_stages
        self.layout = StageLayout(stages, communicator)
        layout = self.layout
        self.pipeline_communicator = None
        self.replica_communicator = communicator
        if self.layer is not None:
            _check_layer_layout(self.layer, layout, communicator)
        if layout.stages > 1:
            if isinstance(optimizer.grad_clip, ClipGradByGlobalNorm):
                raise ValueError("pipeline: ClipGradByGlobalNorm needs the norm over the "
                                 "gradients of every stage, but each rank holds one stage's; "
                                 "use ClipGradByNorm (per tensor) or no clipping")
            if self.layer is None:
                optimizer.narrow([p for p in optimizer.parameters()
                                  if p.pipeline_stage == layout.stage])
                self.pipeline_communicator = communicator.split(layout.replica, layout.stage)
            else:
                self.pipeline_communicator = self.layer.pipe_group
            self.replica_communicator = (communicator.split(layout.stage, layout.replica)
                                         if layout.replicas > 1 else None)
        recompute = RecomputeConfig.of(strategy) if strategy.recompute else None
        self._checkpoints = [] if recompute is None else list(recompute.checkpoints)
        self._host = (HostCheckpoints(list(recompute.checkpoint_shape))
                      if recompute is not None and recompute.enable_offload else None)
        self._split = None
        self.compute_seconds = 0.0
        self.schedule_seconds = 0.0

    @classmethod
    def check(cls, strategy, optimizer):
        super().check(strategy, optimizer)
        check_schedule_mode(PipelineConfig.of(strategy).schedule_mode)

    # -- step stages ----------------------------------------------------------------------
    def forward(self, ctx, proceed):
        """Runs every micro-batch's forward and backward of this stage; the inner forward
        (one pass over the whole batch) is what this replaces. The backward stage then
        reports the gradients the schedule summed."""
        ctx.loss = Tensor(self._run_schedule(ctx))
        ctx.gradients_ready = True
        return None

    # -- the schedule -----------------------------------------------------------------------
    def _stage_modules(self, model, x):
        """The modules this rank runs on a micro-batch, one after the other: the model itself
        when it is one stage or a PipelineLayer (which holds this rank's stage, or every stage
        in one process), else its stage (every stage, without a communicator). The split is
        made, and the model's forward checked on the micro-batch ``x``, once per model."""
        if self.layer is not None:
            if model is not self.layer:
                raise ValueError(f"pipeline: the optimizer holds the parameters of a "
                                 f"PipelineLayer, but the step runs a {type(model).__name__}; "
                                 "train the PipelineLayer (model.train_batch)")
            return [model]
        stages = self.layout.model_stages
        if stages == 1:
            return [model]
        if self._split is None or self._split[0] is not model:
            modules = stage_modules(model, stages, self._fusion)
            check_chain(model, x)
            self._split = (model, modules)
        modules = self._split[1]
        return [modules[self.layout.stage]] if self.layout.stages > 1 else modules

    def _recomputed(self, model, modules):
        """recompute's checkpoints among the top-level layers of a Sequential model, applied
        to the stage modules this rank runs: the recompute strategy cuts the model's own
        forward at them, which the stages do not run. Deeper checkpoints are recomputed by
        the layers themselves, which the strategy gave a recomputed forward."""
        stack = contextlib.ExitStack()
        if not self._checkpoints or modules[0] is model or not isinstance(model, Sequential):
            return stack
        if self._host is not None:
            self._host.release_all()
        for module in modules:
            names = [name for name, _ in module.named_children() if name in self._checkpoints]
            if names:
                stack.enter_context(checkpoint_forwards(module, names, self._host))
        return stack

    def _run_schedule(self, ctx):
        """This stage's passes over the micro-batches (``StageSchedule``) after clearing the
        gradients, the shared weights' gradients summed over their stages, and the loss."""
        schedule_started = time.perf_counter()
        count, size = self.micro_batch, self.micro_batch_size
        xs = split_micro_batches(ctx.x, count, size, "input")
        ys = split_micro_batches(ctx.y, count, size, "labels")
        modules = self._stage_modules(ctx.model, xs[0])
        self.optimizer.clear_grad()
        schedule = StageSchedule(self.layout, self.pipeline_communicator, self.schedule_mode,
                                 count)
        with self._recomputed(ctx.model, modules):
            losses, _, busy = schedule.run(modules, xs, ys, ctx.loss_fn,
                                           lambda loss: loss_seed(loss, ctx.loss_scale, count))
        if self.layer is not None:
            self.layer.allreduce_shared_weight_gradients()
        loss = final_loss(self.layout, self.pipeline_communicator, losses)
        self.compute_seconds = busy
        self.schedule_seconds = elapsed(schedule_started)
        return loss


def _check_layer_layout(layer, layout, communicator):
    """Refuse a PipelineLayer placed otherwise than this optimizer runs it."""
    if layer.local and communicator is not None:
        raise ValueError("pipeline: the PipelineLayer was built with every stage in this "
                         "process (local=True, or before fleet.init joined the ranks), but the "
                         "optimizer trains over several ranks; build it after fleet.init "
                         "without local, or pass local=True to distributed_optimizer")
    if not layer.local and communicator is None:
        raise ValueError(f"pipeline: the PipelineLayer holds stage {layer.stage_id} of "
                         f"{layer.num_stages} only, but the optimizer runs every stage in this "
                         "process (local=True); build the PipelineLayer with local=True for a "
                         "single-process run")
    if not layer.local and (layout.stage, layout.stages) != (layer.stage_id, layer.num_stages):
        raise ValueError(f"pipeline: this rank runs stage {layout.stage} of {layout.stages}, "
                         f"but its PipelineLayer holds stage {layer.stage_id} of "
                         f"{layer.num_stages}; build the PipelineLayer and the optimizer under "
                         "the same layout (the strategy given to fleet.init)")

"""``pipeline``: the layers of a model split into stages, one stage per rank, each mini-batch
split into ``micro_batch`` micro-batches that flow through the stages.

Which models can be split, and how, is ``pipeline_stages``'s: an ``nn.Sequential`` whose
layers are marked with ``fleetmpi.device_guard``, an ``nn.Sequential`` of stages, or a
user-defined Layer whose forward chains its top-level sublayers (anything else is refused
with the reason); a model without any stage is one stage. With S stages the world is S x R
ranks: rank r runs stage ``r % S`` of replica ``r // S``, so the stages of one replica are
neighbouring ranks (Paddle's layout: pipeline inside a node, data parallel across). Every rank
builds the whole model; the optimizer is narrowed to the rank's stage at construction, and a
step runs only that stage's layers.

Each micro-batch's forward on a stage is recorded like any forward: the activation received
from the previous stage becomes a Tensor that requires a gradient, the stage's layers run on
it, and the last stage computes the loss with the step's loss function. Its backward is the
engine's backward from the stage's output with the gradient received from the next stage (on
the last stage: from the loss, with the gradient ``loss_scale / micro_batch``), which leaves
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

import numpy as np

from .. import backend
from ..comm.hybrid_topology import split_communicator
from ..autograd import Tensor, as_array, run_backward
from ..nn import Sequential
from ..optimizer.clip import ClipGradByGlobalNorm
from ..optimizer.step import loss_seed
from .base import Strategy
from .pipeline_schedule import FORWARD, check_schedule_mode, compute_order
from .pipeline_stages import check_chain, count_stages, stage_modules
from .recompute import HostCheckpoints, checkpoint_forwards

_HEADER = 34
_FLOAT_DTYPES = {np.dtype(t).num: np.dtype(t) for t in ("float16", "float32", "float64")}


# -- which stage this rank runs ---------------------------------------------------------------

class StageLayout:
    """Where this rank sits: ``stages`` x ``replicas`` ranks, this rank running ``stage`` of
    ``replica``. Without a communicator: one process running every stage."""

    def __init__(self, stages, communicator):
        self.model_stages = stages
        if communicator is None:
            self.stages, self.replicas, self.stage, self.replica = 1, 1, 0, 0
            return
        size, rank = communicator.size, communicator.rank
        if size % stages:
            raise ValueError(f"pipeline: {stages} stages do not fit a world of {size} ranks; "
                             "the world size must be a multiple of the stage count (world = "
                             "stages x replicas)")
        self.stages, self.replicas = stages, size // stages
        self.stage, self.replica = rank % stages, rank // stages

    @property
    def first(self):
        return self.stage == 0

    @property
    def last(self):
        return self.stage == self.stages - 1


# -- point to point between neighbouring stages ---------------------------------------------------

def send_array(communicator, array, dest):
    """Send ``array`` with a header of its dtype and shape, so the receiver can allocate it."""
    xp = backend.array_module()
    array = xp.ascontiguousarray(array)
    header = np.zeros(_HEADER, dtype=np.int64)
    header[:2] = (array.dtype.num, array.ndim)
    header[2:2 + array.ndim] = array.shape
    communicator.send(xp.asarray(header), dest)
    communicator.send(array, dest)


def recv_array(communicator, source):
    """The array ``send_array`` sent from ``source``."""
    xp = backend.array_module()
    header = xp.empty(_HEADER, dtype=np.int64)
    header = backend.to_numpy(communicator.recv(header, source))
    dtype, ndim = _FLOAT_DTYPES[int(header[0])], int(header[1])
    return communicator.recv(xp.empty(tuple(int(n) for n in header[2:2 + ndim]), dtype), source)


def _elapsed(started):
    """Seconds since ``started``, once the device has finished what was queued."""
    backend.synchronize()
    return time.perf_counter() - started


# -- the strategy -----------------------------------------------------------------------------

class Pipeline(Strategy):
    """``pipeline`` (module docstring). ``layout`` tells this rank's stage and replica;
    ``replica_communicator`` averages the stage's gradients over its replicas (None with one
    replica); ``pipeline_communicator`` joins the stages of this rank's replica.
    ``compute_seconds``: the time the last step spent computing this stage's forward and
    backward passes (the loss included), without the waits and transfers;
    ``schedule_seconds``: the wall time of the last step's schedule, those passes with the
    waits and transfers between them (the optimizer update and the replica averaging come
    after it), so ``1 - compute_seconds / schedule_seconds`` is the step's bubble."""

    name = "pipeline"
    capture_refusal = ("its micro-batch schedule exchanges shapes between the stages on the "
                       "host, which a graph cannot replay")

    def __init__(self, strategy, optimizer, communicator):
        super().__init__(strategy, optimizer, communicator)
        self.micro_batch = int(self.configs["micro_batch"])
        self.schedule_mode = check_schedule_mode(self.configs["schedule_mode"])
        build = strategy.build_strategy
        self._fusion = (bool(build.fuse_elewise_add_act_ops), bool(build.fuse_bn_act_ops))
        self.layout = StageLayout(count_stages(optimizer.parameters()), communicator)
        layout = self.layout
        self.pipeline_communicator = None
        self.replica_communicator = communicator
        if layout.stages > 1:
            if isinstance(optimizer.grad_clip, ClipGradByGlobalNorm):
                raise ValueError("pipeline: ClipGradByGlobalNorm needs the norm over the "
                                 "gradients of every stage, but each rank holds one stage's; "
                                 "use ClipGradByNorm (per tensor) or no clipping")
            optimizer.narrow([p for p in optimizer.parameters()
                              if p.pipeline_stage == layout.stage])
            self.pipeline_communicator = split_communicator(communicator, layout.replica,
                                                          layout.stage)
            self.replica_communicator = (split_communicator(communicator, layout.stage,
                                                          layout.replica)
                                         if layout.replicas > 1 else None)
        recompute = strategy.recompute_configs
        self._checkpoints = list(recompute["checkpoints"]) if strategy.recompute else []
        self._host = (HostCheckpoints(list(recompute["checkpoint_shape"]))
                      if strategy.recompute and recompute["enable_offload"] else None)
        self._split = None
        self.compute_seconds = 0.0
        self.schedule_seconds = 0.0

    @classmethod
    def check(cls, strategy, optimizer):
        super().check(strategy, optimizer)
        check_schedule_mode(strategy.pipeline_configs["schedule_mode"])

    # -- step stages ----------------------------------------------------------------------
    def forward(self, ctx, proceed):
        """Runs every micro-batch's forward and backward of this stage; the inner forward
        (one pass over the whole batch) is what this replaces. The backward stage then
        reports the gradients the schedule summed."""
        ctx.loss = Tensor(self._run_schedule(ctx))
        ctx.gradients_ready = True
        return None

    # -- the schedule -----------------------------------------------------------------------
    def _micro_batches(self, array, what):
        if array is None:
            return None
        if array.shape[0] % self.micro_batch:
            raise ValueError(f"pipeline: a batch of {array.shape[0]} samples ({what}) cannot "
                             f"be split into micro_batch={self.micro_batch} equal "
                             "micro-batches")
        size = array.shape[0] // self.micro_batch
        return [array[k * size:(k + 1) * size] for k in range(self.micro_batch)]

    def _stage_modules(self, model, x):
        """The modules this rank runs on a micro-batch, one after the other: the model itself
        when it is one stage, else its stage (every stage, without a communicator). The split
        is made, and the model's forward checked on the micro-batch ``x``, once per model."""
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
        schedule_started = time.perf_counter()
        xs = self._micro_batches(ctx.x, "input")
        ys = self._micro_batches(ctx.y, "labels")
        modules = self._stage_modules(ctx.model, xs[0])
        with self._recomputed(ctx.model, modules):
            losses, busy = self._schedule(ctx, modules, xs, ys)
        loss = self._loss(losses)
        self.compute_seconds = busy
        self.schedule_seconds = _elapsed(schedule_started)
        return loss

    def _schedule(self, ctx, modules, xs, ys):
        """Every micro-batch's forward and backward of this stage in the schedule's order,
        with the messages between them; returns the losses (on the last stage) and the
        seconds spent computing."""
        layout, m = self.layout, self.micro_batch
        xp = backend.array_module()
        comm = self.pipeline_communicator
        previous, following = layout.stage - 1, layout.stage + 1
        # the messages with the next stage, in the order both issue them
        right = (compute_order(self.schedule_mode, layout.stages, m, following)
                 if not layout.last else [])
        # Per micro-batch in flight: the received input (a leaf whose gradient goes back), the
        # root of its recorded graph (the stage's output, or the loss) and that root's gradient.
        inputs, roots, grads, unsent, losses = {}, {}, {}, {}, []
        forwarded = set()
        position = 0

        def flush(until=None):
            """Issue the messages to the next stage in its order: receives up to the gradient
            ``until``, and the sends of finished forwards, as far as they go."""
            nonlocal position
            while position < len(right):
                kind, k = right[position]
                if kind == FORWARD:
                    if k not in forwarded:
                        if until is not None:
                            raise RuntimeError(f"pipeline schedule: stage {layout.stage} needs "
                                               f"gradient {until} before its forward {k}")
                        return
                    send_array(comm, unsent.pop(k), following)
                elif until is None:
                    return
                else:
                    grads[k] = recv_array(comm, following)
                    if k == until:
                        until = None
                position += 1

        self.optimizer.clear_grad()
        busy = 0.0
        order = compute_order(self.schedule_mode, layout.stages, m, layout.stage)
        for kind, k in order:
            if kind == FORWARD:
                if layout.first:
                    x = xs[k]
                else:
                    x = inputs[k] = Tensor(recv_array(comm, previous), stop_gradient=False)
                started = time.perf_counter()
                y = x
                for module in modules:
                    y = module(y)
                if layout.last:
                    loss = ctx.loss_fn(y, ys[k])
                    losses.append(as_array(loss))
                    roots[k] = loss
                    grads[k] = loss_seed(loss, ctx.loss_scale, m)
                else:
                    roots[k] = y
                    unsent[k] = y.data
                busy += _elapsed(started)
                forwarded.add(k)
                flush()
            else:
                if not layout.last and k not in grads:
                    flush(until=k)
                started = time.perf_counter()
                run_backward([roots.pop(k)], [grads.pop(k)])
                busy += _elapsed(started)
                if not layout.first:
                    received = inputs.pop(k)
                    dx = received.grad if received.grad is not None else \
                        xp.zeros_like(received.data)
                    send_array(comm, dx, previous)
                flush()
        if position != len(right):
            raise RuntimeError(f"pipeline schedule: stage {layout.stage} left "
                               f"{len(right) - position} messages to stage {following} unsent")
        return losses, busy

    def _loss(self, losses):
        """The mean loss over the micro-batches, from the last stage to every stage."""
        xp = backend.array_module()
        loss = xp.stack(losses).mean() if losses else None
        if self.layout.stages == 1:
            return loss
        message = xp.zeros(2, dtype=np.float64)
        if self.layout.last:
            message[0], message[1] = loss, loss.dtype.num
        message = backend.to_numpy(self.pipeline_communicator.broadcast(
            message, root=self.layout.stages - 1))
        if self.layout.last:
            return loss
        return xp.asarray(message[0], dtype=_FLOAT_DTYPES[int(message[1])])

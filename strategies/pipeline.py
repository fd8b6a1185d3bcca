"""``pipeline``: the layers of an ``nn.Sequential`` split into stages, one stage per rank, each
mini-batch split into ``micro_batch`` micro-batches that flow through the stages.

Stages come from the program (``fleetmpi.device_guard``): every parameter carries the stage of
the layer that created it; a model without any stage is one stage. With S stages the world is
S x R ranks: rank r runs stage ``r % S`` of replica ``r // S``, so the stages of one replica
are neighbouring ranks (Paddle's layout: pipeline inside a node, data parallel across). Every
rank builds the whole model; the optimizer is narrowed to the rank's stage at construction, and
a step runs only that stage's layers. Activations travel forward and their gradients backward
between neighbouring ranks through the comm layer's ``send``/``recv``, in the order of
``pipeline_schedule`` (``schedule_mode`` "1F1B" by default, or "F-then-B"). Each micro-batch's
loss gradient is scaled by 1/micro_batch and the stage's gradients are summed over the
micro-batches, so a step applies the gradient of the mean loss over the mini-batch: the math of
the unpipelined model with its gradients accumulated over the same micro-batches. The summed
gradients are then reported to the other strategies (amp unscales them, gradient_merge merges
them) and averaged over the R replicas of the stage (the gradient reduction runs over a
communicator of those ranks). The loss ``minimize`` returns is the last stage's mean over the
micro-batches, broadcast to every stage of the replica.

A layer's activation caches are instance attributes (see ``recompute``), so while several
micro-batches are in flight on a stage, each one's caches are taken off the layers after its
forward and put back before its backward. Under ``recompute`` each micro-batch runs through its
own ``RecomputedModel`` over the stage's part of the checkpoint pieces. ``amp``'s casts and loss
scaling wrap the whole schedule, which runs innermost in the step.

Without a communicator (``local=True``, or a world of one) all stages run in this process, one
after the other: the single-process math the ranks must match.
"""
import time

import numpy as np

from .. import backend
from ..nn import Sequential
from ..nn.containers import backward_steps, forward_steps
from ..optimizer import Optimizer
from ..optimizer.clip import ClipGradByGlobalNorm
from .base import Strategy
from .pipeline_schedule import FORWARD, check_schedule_mode, compute_order, \
    messages_with_previous
from .recompute import Piece, RecomputedModel, _layer_tree, activation_arrays, drop_activations

_HEADER = 34
_FLOAT_DTYPES = {np.dtype(t).num: np.dtype(t) for t in ("float16", "float32", "float64")}


# -- which stage a parameter, a layer and a rank belong to --------------------------------------

def count_stages(parameters):
    """The number of stages the parameters' ``pipeline_stage`` tags make (1 when none is
    tagged); refuses untagged parameters beside tagged ones and stages without parameters."""
    tags = [p.pipeline_stage for p in parameters]
    if all(tag is None for tag in tags):
        return 1
    untagged = [p.name for p in parameters if p.pipeline_stage is None]
    if untagged:
        raise ValueError(f"pipeline: parameters {untagged} belong to no stage while others do; "
                         "build every layer with parameters inside fleet.device_guard("
                         "'stage:N') or assign stages with fleet.split_stages(model, points)")
    stages = max(tags) + 1
    empty = sorted(set(range(stages)) - set(tags))
    if empty:
        raise ValueError(f"pipeline: stages {empty} hold no parameters (stages used: "
                         f"{sorted(set(tags))}); stages are numbered 0..S-1 and each needs a "
                         "layer with parameters")
    return stages


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


def _stage_of_layer(layer, previous):
    """A top-level layer's stage: that of its parameters, else its own tag, else the stage of
    the layer before it."""
    tags = {p.pipeline_stage for member in _layer_tree(layer) for p in member.own_parameters()
            if p.pipeline_stage is not None}
    if len(tags) > 1:
        raise ValueError(f"pipeline: layer {type(layer).__name__} holds parameters of stages "
                         f"{sorted(tags)}; a stage boundary must fall between top-level layers "
                         "of the Sequential")
    if tags:
        return tags.pop()
    return layer.pipeline_stage if layer.pipeline_stage is not None else previous


def stage_plan_ranges(model, stages):
    """``[(first, stop), ...]``: the plan steps of ``model`` each stage runs."""
    if not isinstance(model, Sequential):
        raise TypeError(f"pipeline needs an nn.Sequential model (its top-level layers are cut "
                        f"into stages), not {type(model).__name__}")
    names = list(model._children)
    stage_of, previous = {}, 0
    for name, layer in model._children.items():
        previous = stage_of[id(layer)] = _stage_of_layer(layer, previous)
    order = [stage_of[id(layer)] for layer in model._children.values()]
    if order != sorted(order) or order[-1] >= stages:
        raise ValueError(f"pipeline: the stages of the top-level layers {names} are {order}; "
                         f"they must rise from 0 to {stages - 1} along the Sequential")
    plan_stages = [stage_of[id(layer)] for layer, _ in model._plan]
    ranges = []
    for stage in range(stages):
        indices = [i for i, s in enumerate(plan_stages) if s == stage]
        if not indices:
            raise ValueError(f"pipeline: stage {stage} has no layers to run (layer stages "
                             f"{order}); a model needs at least one layer per stage")
        ranges.append((indices[0], indices[-1] + 1))
    return ranges


def narrow_optimizer(optimizer, parameters):
    """Make ``optimizer`` hold only ``parameters`` (its stage's): runs and state rebuilt
    before any step, hyperparameters, learning rate and step count kept."""
    step_count = optimizer.step_count
    Optimizer.__init__(optimizer, optimizer._learning_rate, parameters, optimizer.weight_decay,
                       optimizer.grad_clip)
    optimizer.step_count = step_count


def sub_communicator(communicator, color, key):
    """A ``Communicator`` with the same knobs over the ranks of ``communicator`` that share
    ``color`` (MPI ``Comm.Split``), ranked by ``key``."""
    from ..comm import Communicator, Topology

    inter = communicator.hierarchical_allreduce_inter_nranks
    return Communicator(Topology(communicator.topology.world.Split(color, key)),
                        transport=communicator.transport_name,
                        nccl_comm_num=communicator.nccl_comm_num,
                        fuse_grad_size_in_MB=communicator.fuse_grad_size_in_MB,
                        fuse_broadcast_MB=communicator.fuse_broadcast_MB,
                        use_hierarchical_allreduce=communicator.use_hierarchical_allreduce,
                        hierarchical_allreduce_inter_nranks=inter,
                        chunk_bytes=communicator.chunk_bytes, check=communicator.check)


# -- point to point between neighbouring stages ---------------------------------------------------

def send_array(communicator, array, dest):
    """Send ``array`` with a header of its dtype and shape, so the receiver can allocate it."""
    xp = backend.array_module()
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


# -- one micro-batch on one stage ---------------------------------------------------------------

class _StageSteps:
    """Plan steps ``[first, stop)`` of a Sequential, run as ``Sequential`` runs them."""

    def __init__(self, steps, first):
        self.steps = steps
        self.first = first

    def forward(self, x):
        return forward_steps(self.steps, x)

    def backward(self, dy, on_gradient=None, input_grad=True):
        return backward_steps(self.steps, dy, on_gradient, input_grad, self.first)


def pieces_within(pieces, first, stop):
    """The parts of recompute ``pieces`` inside plan steps ``[first, stop)``."""
    result = []
    for piece in pieces:
        lo, hi = max(piece.first, first), min(piece.first + len(piece.steps), stop)
        if lo < hi:
            ends_inside = piece.first + len(piece.steps) <= stop
            result.append(Piece(piece.steps[lo - piece.first:hi - piece.first], lo,
                                piece.checkpoint if ends_inside else None))
    return result


class _Caches:
    """The activation caches of a stage's layers for one micro-batch: taken off the layers
    after its forward, put back before its backward."""

    def __init__(self, layers):
        self.layers = layers
        self.saved = [(member, activation_arrays(member)) for member in layers]
        drop_activations(layers)

    def restore(self):
        drop_activations(self.layers)
        for member, arrays in self.saved:
            for name, value in arrays:
                setattr(member, name, value)
        self.saved = None


class _Reporter:
    """Stands in for the model in the step's backward: reports the gradients the schedule
    summed, so every strategy's ``on_gradient`` sees them once."""

    def __init__(self, parameters):
        self.parameters = parameters

    def backward(self, dy, on_gradient=None, input_grad=True):
        if on_gradient is not None and self.parameters:
            on_gradient(self.parameters)


class _NoLossGradient:
    def backward(self, dloss=1.0):
        return None


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

    def __init__(self, strategy, optimizer, communicator):
        super().__init__(strategy, optimizer, communicator)
        self.micro_batch = int(self.configs["micro_batch"])
        self.schedule_mode = check_schedule_mode(self.configs["schedule_mode"])
        self.layout = StageLayout(count_stages(optimizer.parameters()), communicator)
        layout = self.layout
        self.pipeline_communicator = None
        self.replica_communicator = communicator
        if layout.stages > 1:
            if isinstance(optimizer.grad_clip, ClipGradByGlobalNorm):
                raise ValueError("pipeline: ClipGradByGlobalNorm needs the norm over the "
                                 "gradients of every stage, but each rank holds one stage's; "
                                 "use ClipGradByNorm (per tensor) or no clipping")
            narrow_optimizer(optimizer, [p for p in optimizer.parameters()
                                         if p.pipeline_stage == layout.stage])
            self.pipeline_communicator = sub_communicator(communicator, layout.replica,
                                                          layout.stage)
            self.replica_communicator = (sub_communicator(communicator, layout.stage,
                                                          layout.replica)
                                         if layout.replicas > 1 else None)
        self._parameters = sorted(optimizer.parameters(), key=lambda p: (id(p.buffer), p.offset))
        self.compute_seconds = 0.0
        self.schedule_seconds = 0.0

    @classmethod
    def check(cls, strategy, optimizer):
        super().check(strategy, optimizer)
        check_schedule_mode(strategy.pipeline_configs["schedule_mode"])

    # -- step stages ----------------------------------------------------------------------
    def forward(self, ctx, proceed):
        """Runs every micro-batch's forward and backward of this stage; the inner forward
        (one pass over the whole batch) is what this replaces."""
        ctx.loss = self._run_schedule(ctx)
        return None

    def backward(self, ctx, proceed):
        model, loss_fn = ctx.model, ctx.loss_fn
        ctx.model, ctx.loss_fn = _Reporter(self._parameters), _NoLossGradient()
        try:
            return proceed(ctx)
        finally:
            ctx.model, ctx.loss_fn = model, loss_fn

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

    def _runners(self, ctx):
        """A factory of the object that runs one micro-batch through this stage."""
        model = ctx.model
        recomputed = isinstance(model, RecomputedModel)
        base = model.model if recomputed else model
        ranges = stage_plan_ranges(base, self.layout.model_stages)
        if self.layout.stages == 1:
            first, stop = 0, len(base._plan)
        else:
            first, stop = ranges[self.layout.stage]
        steps = base._plan[first:stop]
        layers = [member for layer, _ in steps for member in _layer_tree(layer)]
        if recomputed:
            pieces = pieces_within(model.pieces, first, stop)
            return layers, lambda: RecomputedModel(base, pieces, model.host)
        return layers, lambda: _StageSteps(steps, first)

    def _run_schedule(self, ctx):
        schedule_started = time.perf_counter()
        layout, m = self.layout, self.micro_batch
        xs = self._micro_batches(ctx.x, "input")
        ys = self._micro_batches(ctx.y, "labels")
        layers, make_runner = self._runners(ctx)
        comm = self.pipeline_communicator
        previous, following = layout.stage - 1, layout.stage + 1
        right = (messages_with_previous(self.schedule_mode, layout.stages, m, following)
                 if not layout.last else [])
        runners, caches, outputs, grads, losses = {}, {}, {}, {}, []
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
                    send_array(comm, outputs.pop(k), following)
                elif until is None:
                    return
                else:
                    grads[k] = recv_array(comm, following)
                    if k == until:
                        until = None
                position += 1

        accumulated = None
        busy = 0.0
        order = compute_order(self.schedule_mode, layout.stages, m, layout.stage)
        for kind, k in order:
            if kind == FORWARD:
                x = xs[k] if layout.first else recv_array(comm, previous)
                started = time.perf_counter()
                runners[k] = make_runner()
                y = runners[k].forward(x)
                if layout.last:
                    losses.append(ctx.loss_fn.forward(y, ys[k]))
                    grads[k] = ctx.loss_fn.backward(1.0 / m)
                else:
                    outputs[k] = y
                caches[k] = _Caches(layers)
                busy += _elapsed(started)
                forwarded.add(k)
                flush()
            else:
                if not layout.last and k not in grads:
                    flush(until=k)
                started = time.perf_counter()
                caches.pop(k).restore()
                dx = runners.pop(k).backward(grads.pop(k), None, input_grad=False)
                drop_activations(layers)
                accumulated = self._accumulate(accumulated, m)
                busy += _elapsed(started)
                if not layout.first:
                    send_array(comm, dx, previous)
                flush()
        if position != len(right):
            raise RuntimeError(f"pipeline schedule: stage {layout.stage} left "
                               f"{len(right) - position} messages to stage {following} unsent")
        if accumulated is not None:
            for (_, grad), total in zip(self.optimizer.flat_runs(), accumulated):
                grad[...] = total
        loss = self._loss(losses)
        self.compute_seconds = busy
        self.schedule_seconds = _elapsed(schedule_started)
        return loss

    def _accumulate(self, accumulated, m):
        """The stage's gradients summed over the micro-batches so far (None with one
        micro-batch: the gradient buffer already holds the sum)."""
        if m == 1:
            return None
        grads = [grad for _, grad in self.optimizer.flat_runs()]
        if accumulated is None:
            return [g.copy() for g in grads]
        for total, grad in zip(accumulated, grads):
            total += grad
        return accumulated

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

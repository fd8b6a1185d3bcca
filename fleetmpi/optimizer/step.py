"""One training step as a chain of stages that hooks can wrap.

``run_step`` runs forward, backward, gradient reduction, update and after-step. Each hook
(a ``StepHook``) may wrap any stage: its method receives the step context and ``proceed``, the
rest of the chain, and decides whether and how to call it. During backward every hook's
``on_gradient`` sees each group of parameters as soon as their gradients are final, which is
where a reducer can start on a bucket before backward has finished.

Forward, backward and update (with every hook's part in them) are events of the timeline
(``fleetmpi.core.timeline``, lane ``compute``), each with the step's index.
"""
import numpy as np

from ..core import backend, capture_checks, timeline
from ..autograd import as_array, run_backward


def minimize_loss(args):
    """The two call forms of ``minimize``: the loss of ``minimize(loss)`` (Paddle dygraph), or
    None for ``minimize(model, loss_fn, x, y)`` (one whole step); any other count of
    arguments is a TypeError."""
    if len(args) == 1:
        return args[0]
    if len(args) != 4:
        raise TypeError("minimize takes (loss) or (model, loss_fn, x, y), got "
                        f"{len(args)} arguments")
    return None


class StepContext:
    """What one step works on and produces: model, loss function, batch, loss, and what the
    strategies decided for this step.

    ``step`` counts the steps run before this one (from 0). ``sync_gradients``: whether the
    gradients are averaged over the ranks this step (a strategy that communicates something
    else, or nothing, turns it off). ``apply_update``: whether the optimizer updates the
    parameters this step (off while gradients are being merged, or when they overflowed).
    ``gradients_ready``: set by a strategy whose forward stage already computed this step's
    gradients into the parameters (pipeline's micro-batch schedule); the backward stage then
    reports them to the hooks instead of running the loss's backward. ``keep_gradients``: the
    reduced gradients of this step are kept for the next steps to add to (gradient_merge's
    window, where the gradient lives in a shard: sharding stages 2 and 3). ``found_inf``:
    None, or amp's overflow flag for this step (a one-element int32 backend array) when amp
    leaves the verdict on the device: the update is then launched and skips itself where the
    flag is set (``Optimizer.step``). ``loss_scale``: the loss gradient's seed, a number, or a
    one-element backend array where amp keeps its scale on the device. ``overflow_checked``:
    a loss scaler outside the strategies (``fleetmpi.amp.GradScaler``) checks this step's
    gradients for inf and NaN after the reduction and skips the update itself, so the
    non-finite check stands aside, as it does for amp. ``contributors``: None when every rank
    trains this step, else how many ranks contributed a batch to it (the others have joined,
    ``fleetmpi.strategies.join``): the gradient averages divide by it."""

    def __init__(self, model, loss_fn, x, y, optimizer, step=0):
        self.model = model
        self.loss_fn = loss_fn
        self.x = x
        self.y = y
        self.optimizer = optimizer
        self.step = step
        self.sync_gradients = True
        self.apply_update = True
        self.loss = None
        self.output = None
        self.loss_scale = 1
        self.gradients_ready = False
        self.keep_gradients = False
        self.found_inf = None
        self.overflow_checked = False
        self.contributors = None


class StepHook:
    """Base of anything that takes part in a step; every method passes straight through.

    ``capture_refusal``: None, or why the hook's part of a step cannot be captured in a CUDA
    graph (it decides on the host from step to step); a step run inside a capture with such a
    hook raises ``CaptureError`` with the reason (``fleetmpi.core.capture_checks``)."""

    capture_refusal = None

    def forward(self, ctx, proceed):
        return proceed(ctx)

    def backward(self, ctx, proceed):
        return proceed(ctx)

    def on_gradient(self, ctx, parameters):
        """``parameters``' gradients are final for this step."""

    def reduce(self, ctx, proceed):
        return proceed(ctx)

    def update(self, ctx, proceed):
        return proceed(ctx)

    def after_step(self, ctx, proceed):
        return proceed(ctx)


def _forward(ctx):
    ctx.output = ctx.model(ctx.x)
    ctx.loss = ctx.loss_fn(ctx.output, ctx.y)


def gradient_reporter(hooks, ctx):
    """What the engine calls as each leaf's gradient becomes final: every hook's
    ``on_gradient`` with the leaf, when it is a parameter of the step's optimizer."""
    owns = ctx.optimizer.owns

    def report(leaf):
        if owns(leaf):
            for hook in hooks:
                hook.on_gradient(ctx, [leaf])
    return report


def loss_seed(loss, scale, divisor=1):
    """The gradient that starts the backward of ``loss`` (an array): ``scale / divisor`` in
    its shape and dtype, the quotient in float64 as Python numbers give it. ``scale``: amp's
    loss scale, a number, or a one-element backend array read on the device (no host wait);
    ``divisor``: pipeline's micro-batch count."""
    if hasattr(scale, "shape"):
        scale = (scale.astype(np.float64) / divisor).reshape(())
    else:
        scale = scale / divisor
    seed = backend.array_module().empty(loss.shape, dtype=loss.dtype)
    seed[...] = scale
    return seed


def backward_pass(hooks, ctx):
    """``ctx.loss``'s backward, its gradient scaled by ``ctx.loss_scale`` (amp), reporting
    each parameter of the optimizer to the hooks as its gradient becomes final."""
    grad = None
    if hasattr(ctx.loss_scale, "shape") or ctx.loss_scale != 1:
        grad = loss_seed(ctx.loss.data, ctx.loss_scale)
    run_backward([ctx.loss], [grad], gradient_reporter(hooks, ctx) if hooks else None)
    ctx.optimizer.settle_grads()


def report_gradients(hooks, ctx):
    """Every hook's ``on_gradient`` with all of the optimizer's parameters at once, for
    gradients that are already final."""
    ctx.optimizer.settle_grads()
    parameters = ctx.optimizer.parameters()
    for hook in hooks:
        hook.on_gradient(ctx, parameters)


def _backward_with(hooks):
    def backward(ctx):
        if ctx.gradients_ready:
            report_gradients(hooks, ctx)
            return
        ctx.optimizer.clear_grad()
        backward_pass(hooks, ctx)
    return backward


def _update(ctx):
    if not ctx.apply_update:
        return
    if ctx.found_inf is None:
        ctx.optimizer.step()
    else:
        ctx.optimizer.step(found_inf=ctx.found_inf)


def _nothing(ctx):
    return None


def _chain(hooks, stage, innermost):
    """``innermost`` wrapped by each hook's ``stage`` method, the first hook outermost."""
    call = innermost
    for hook in reversed(hooks):
        method = getattr(hook, stage)
        call = (lambda method, inner: lambda ctx: method(ctx, inner))(method, call)
    return call


def _refuse_uncapturable(hooks):
    """Inside a CUDA graph capture, raise ``CaptureError`` for the first hook with a
    ``capture_refusal``."""
    if capture_checks.current is None:
        return
    for hook in hooks:
        if hook.capture_refusal is not None:
            capture_checks.refuse(f"strategy {getattr(hook, 'name', type(hook).__name__)}",
                                  hook.capture_refusal)


def run_forward(hooks, ctx, forward=_forward):
    _refuse_uncapturable(hooks)
    with timeline.span("forward", step=ctx.step):
        _chain(hooks, "forward", forward)(ctx)


def run_backward_stage(hooks, ctx, backward=None):
    with timeline.span("backward", step=ctx.step):
        _chain(hooks, "backward", backward or _backward_with(hooks))(ctx)


def run_reduce_stage(hooks, ctx):
    """The gradient reduction stage, after backward."""
    _refuse_uncapturable(hooks)
    _chain(hooks, "reduce", _nothing)(ctx)


def finish_step(hooks, ctx, reduced=False):
    """The stages after backward: gradient reduction (unless ``reduced`` already), update,
    after-step."""
    if reduced:
        _refuse_uncapturable(hooks)
    else:
        run_reduce_stage(hooks, ctx)
    with timeline.span("update", step=ctx.step) as event:
        _chain(hooks, "update", _update)(ctx)
        if event:
            event.args["applied"] = bool(ctx.apply_update)
    _chain(hooks, "after_step", _nothing)(ctx)


_running = 0


def step_running():
    """Whether a ``run_step`` is under way (a model called inside it is part of that step)."""
    return _running > 0


def run_step(hooks, ctx):
    """Run one step through ``hooks``; returns the local mean loss (a 0-d backend array)."""
    global _running
    _running += 1
    try:
        run_forward(hooks, ctx)
        run_backward_stage(hooks, ctx)
        finish_step(hooks, ctx)
    finally:
        _running -= 1
    return as_array(ctx.loss)

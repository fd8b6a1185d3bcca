"""One training step as a chain of stages that hooks can wrap.

``run_step`` runs forward, backward, gradient reduction, update and after-step. Each hook
(a ``StepHook``) may wrap any stage: its method receives the step context and ``proceed``, the
rest of the chain, and decides whether and how to call it. During backward every hook's
``on_gradient`` sees each group of parameters as soon as their gradients are final, which is
where a reducer can start on a bucket before backward has finished.

Forward, backward and update (with every hook's part in them) are events of the timeline
(``fleetmpi.timeline``, lane ``compute``), each with the step's index.
"""
from .. import timeline



class StepContext:
    """What one step works on and produces: model, loss function, batch, loss, and what the
    strategies decided for this step.

    ``step`` counts the steps run before this one (from 0). ``sync_gradients``: whether the
    gradients are averaged over the ranks this step (a strategy that communicates something
    else, or nothing, turns it off). ``apply_update``: whether the optimizer updates the
    parameters this step (off while gradients are being merged, or when they overflowed)."""

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


class StepHook:
    """Base of anything that takes part in a step; every method passes straight through."""

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
    ctx.output = ctx.model.forward(ctx.x)
    ctx.loss = ctx.loss_fn.forward(ctx.output, ctx.y)


def _backward_with(hooks):
    def backward(ctx):
        def report(parameters):
            for hook in hooks:
                hook.on_gradient(ctx, parameters)

        ctx.model.backward(ctx.loss_fn.backward(), report if hooks else None, input_grad=False)
    return backward


def _update(ctx):
    if ctx.apply_update:
        ctx.optimizer.step()


def _nothing(ctx):
    return None


def _chain(hooks, stage, innermost):
    """``innermost`` wrapped by each hook's ``stage`` method, the first hook outermost."""
    call = innermost
    for hook in reversed(hooks):
        method = getattr(hook, stage)
        call = (lambda method, inner: lambda ctx: method(ctx, inner))(method, call)
    return call


def run_step(hooks, ctx):
    """Run one step through ``hooks``; returns the local mean loss (a 0-d backend array)."""
    with timeline.span("forward", step=ctx.step):
        _chain(hooks, "forward", _forward)(ctx)
    with timeline.span("backward", step=ctx.step):
        _chain(hooks, "backward", _backward_with(hooks))(ctx)
    _chain(hooks, "reduce", _nothing)(ctx)
    with timeline.span("update", step=ctx.step) as event:
        _chain(hooks, "update", _update)(ctx)
        if event:
            event.args["applied"] = bool(ctx.apply_update)
    _chain(hooks, "after_step", _nothing)(ctx)
    return ctx.loss

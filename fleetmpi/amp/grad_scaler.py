"""``fleetmpi.amp.GradScaler`` and ``fleet.distributed_scaler``: Paddle dygraph's dynamic loss
scaling, over the ``amp`` strategy's (``strategies.loss_scaling``: the scale, the counters, the
``update_loss_scaling`` rule and the check of a step are one code for both).

The arguments are the ``amp_configs`` keys of the same names: their defaults and allowed
ranges come from ``AMPConfig`` in ``distributed_strategy.proto`` (Paddle 2.4's defaults:
``init_loss_scaling=2**15``, ``incr_every_n_steps=1000``, ``decr_every_n_nan_or_inf=2``).

How a step goes (Paddle's ``scale``, ``unscale_``, ``step``, ``update``, ``minimize``):
``scale(loss)`` multiplies the loss by the scale (a recorded product in float32, outside any
``auto_cast``, so its backward seeds the scale as the strategy's does); ``unscale_(opt)``
divides the gradients the update uses by the scale and checks them for inf and NaN;
``step(opt)`` unscales if that was not done, and updates unless the check found one (the
gradients are then zeroed, and the step counted in ``skipped_steps``); ``update()`` moves the
scale by the rule; ``minimize(opt, scaled)`` is ``step`` and ``update``;
``minimize(opt, model, loss_fn, x, y)`` is one whole step of a distributed optimizer with the
loss scaled inside it (what ``PipelineParallel.train_batch(..., scaler=...)`` runs: the last
stage seeds the backward of each micro-batch with the scale).

With a plain optimizer the gradients are this process's, checked here alone, unless
``fleet.distributed_scaler(scaler)`` made the scaler agree the verdict with every rank (one
4-byte allreduce): that is what a rank whose gradients differ from the others' needs (tensor,
pipeline or sharding parallelism), so that all skip together. With a ``DistributedOptimizer``
the check runs inside its step, after the gradient reduction (``reduce_gradients``), over the
ranks that share its steps (every rank of a hybrid layout), as the ``amp`` strategy's does;
the non-finite check of its steps then leaves the overflow to the scaler.
"""
from ..core import backend
from ..autograd import Tensor, autocast, cast
from ..autograd.autocast import current_policy
from ..core.log import logger
from ..optimizer import Optimizer, StepHook
from ..parallel import DistributedOptimizer
from fleetmpi.proto import distributed_strategy_pb2 as schema
from ..config.schema_view import coerce, default_of
from fleetmpi.strategies import amp_precision
from fleetmpi.strategies.loss_scaling import LossScaling, check_step

_FIELDS = schema.AMPConfig.DESCRIPTOR.fields_by_name
_KEYS = ("init_loss_scaling", "incr_ratio", "decr_ratio", "incr_every_n_steps",
         "decr_every_n_nan_or_inf", "use_dynamic_loss_scaling")
DEFAULTS = {key: default_of(_FIELDS[key]) for key in _KEYS}
INIT, UNSCALED, STEPPED = "init", "unscaled", "stepped"
_SETTINGS = ("incr_ratio", "decr_ratio", "incr_every_n_steps", "decr_every_n_nan_or_inf",
             "use_dynamic_loss_scaling")


def _checked(values):
    """``values`` (GradScaler's arguments) coerced by ``AMPConfig``'s fields; a ConfigError
    or TypeError naming the argument and what is allowed."""
    return {key: coerce(_FIELDS[key], value, f"GradScaler {key}")
            for key, value in values.items()}


class _ScaledStep(StepHook):
    """The scaler's part of a ``DistributedOptimizer``'s step, outermost in its chain: when
    ``armed`` (by ``unscale_``, ``step`` or ``minimize``), after the gradient reduction of a
    step that updates, the check of ``check_step`` and the update skipped on overflow. With
    ``seeds_loss`` (a whole step, ``GradScaler.minimize(opt, model, loss_fn, x, y)``) the
    step's forward stage also makes the scale the loss gradient's seed
    (``StepContext.loss_scale``), which a pipeline's last stage seeds its micro-batches'
    backwards with."""

    name = "grad_scaler"

    def __init__(self, scaler, optimizer):
        self.scaler = scaler
        self.optimizer = optimizer
        self.armed = False
        self.seeds_loss = False

    def forward(self, ctx, proceed):
        if self.seeds_loss:
            ctx.loss_scale = self.scaler._scaling.seed()
        return proceed(ctx)

    def reduce(self, ctx, proceed):
        if not self.armed:
            return proceed(ctx)
        self.armed = False
        ctx.overflow_checked = True
        result = proceed(ctx)
        if ctx.apply_update:
            found, skipped = self.scaler._check(self.optimizer.inner,
                                                self.scaler._agreement(self.optimizer), ctx.step)
            if skipped is None:
                ctx.found_inf = found
            elif skipped:
                ctx.apply_update = False
        return result


class GradScaler:
    """Paddle's ``paddle.amp.GradScaler`` (module docstring). ``enable=False``: ``scale``
    returns the loss as it is, and ``step``/``minimize`` are the optimizer's own. Observable:
    ``loss_scaling``, ``good_steps``, ``bad_steps``, ``skipped_steps``, ``distributed``
    (whether ``fleet.distributed_scaler`` made it agree the verdict over every rank)."""

    def __init__(self, enable=True, init_loss_scaling=DEFAULTS["init_loss_scaling"],
                 incr_ratio=DEFAULTS["incr_ratio"], decr_ratio=DEFAULTS["decr_ratio"],
                 incr_every_n_steps=DEFAULTS["incr_every_n_steps"],
                 decr_every_n_nan_or_inf=DEFAULTS["decr_every_n_nan_or_inf"],
                 use_dynamic_loss_scaling=DEFAULTS["use_dynamic_loss_scaling"]):
        if not isinstance(enable, bool):
            raise TypeError(f"GradScaler enable={enable!r}: True or False")
        self._enable = enable
        self._settings = _checked({
            "init_loss_scaling": init_loss_scaling, "incr_ratio": incr_ratio,
            "decr_ratio": decr_ratio, "incr_every_n_steps": incr_every_n_steps,
            "decr_every_n_nan_or_inf": decr_every_n_nan_or_inf,
            "use_dynamic_loss_scaling": use_dynamic_loss_scaling})
        self._scaling = self._new_scaling(self._settings["init_loss_scaling"])
        self._states = {}
        self._hooks = {}
        self._found = self._skipped = None
        self.distributed = False
        self._communicator = None

    def _new_scaling(self, init_loss_scaling):
        s = self._settings
        return LossScaling(init_loss_scaling, s["incr_ratio"], s["decr_ratio"],
                           s["incr_every_n_steps"], s["decr_every_n_nan_or_inf"],
                           s["use_dynamic_loss_scaling"])

    loss_scaling = property(lambda self: self._scaling.loss_scaling)
    good_steps = property(lambda self: self._scaling.good_steps)
    bad_steps = property(lambda self: self._scaling.bad_steps)
    skipped_steps = property(lambda self: self._scaling.skipped_steps)

    def is_enable(self):
        return self._enable

    def is_use_dynamic_loss_scaling(self):
        return self._enable and self._scaling.dynamic

    # -- the step ---------------------------------------------------------------------------
    def scale(self, var):
        """``var`` (the loss) times the scale, in float32, as a recorded product; ``var`` as
        it is when the scaler is disabled. Under an ``auto_cast`` in bfloat16 with dynamic
        loss scaling the scaler disables itself, as Paddle's does (bfloat16 keeps float32's
        exponent range; ``amp_precision.scales_loss``)."""
        if not isinstance(var, Tensor):
            raise TypeError(f"GradScaler.scale takes the loss Tensor, not "
                            f"{type(var).__name__}")
        self._disable_for_bfloat16()
        if not self._enable:
            return var
        with autocast(None):
            loss = var if var.dtype.name == "float32" else cast(var, "float32")
            return loss * Tensor(self._scaling.scale.reshape(()).copy())

    def _disable_for_bfloat16(self):
        policy = current_policy()
        if not self._enable or policy is None or policy.dtype.name != amp_precision.BFLOAT16:
            return
        precision = amp_precision.Precision(amp_precision.BFLOAT16,
                                            "O2" if policy.pure else "O1")
        if not amp_precision.scales_loss(self._settings["use_dynamic_loss_scaling"],
                                         self._settings["init_loss_scaling"], precision):
            self._enable = False
            logger.warning("GradScaler: dynamic loss scaling is off under auto_cast in "
                           "bfloat16 (its exponent range is float32's), as in Paddle; "
                           "use_dynamic_loss_scaling=False keeps a fixed scale")

    def _agreement(self, optimizer):
        """The ranks that agree the verdict: every rank after ``distributed_scaler``, a
        distributed optimizer's own, else none."""
        if self.distributed:
            return self._communicator
        return optimizer.agreement if isinstance(optimizer, DistributedOptimizer) else None

    def _check(self, inner, communicator, step=None):
        """Unscale and check ``inner``'s gradients (the ones its update uses); ``step``: the
        step's number, where a distributed optimizer's step gives one."""
        inner.settle_grads()
        grads = [grad for _, grad in inner.flat_runs()]
        found, skipped = check_step(self._scaling, grads, communicator, step=step)
        self._found, self._skipped = found, skipped
        return found, skipped

    def _skips(self):
        """Whether the checked step is skipped: what its check read on the host, once (inside
        a CUDA graph capture it read nothing, and the read here is refused, naming it)."""
        if self._skipped is None:
            return bool(backend.to_numpy(self._found)[0])
        return self._skipped

    def _state(self, optimizer):
        if not isinstance(optimizer, (Optimizer, DistributedOptimizer)):
            raise TypeError(f"GradScaler takes a fleetmpi optimizer (or one from "
                            f"fleet.distributed_optimizer), not {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer) and "amp" in optimizer.strategies:
            raise ValueError("this optimizer's strategy has amp on, which scales the loss and "
                             "skips overflowing steps itself; use either strategy.amp or "
                             "auto_cast with a GradScaler")
        return self._states.get(id(optimizer), INIT)

    def _hook(self, optimizer):
        """The ``_ScaledStep`` armed in ``optimizer``'s chain (put there the first time)."""
        hook = self._hooks.get(id(optimizer))
        if hook is None:
            hook = self._hooks[id(optimizer)] = _ScaledStep(self, optimizer)
            optimizer.add_hook(hook, first=True)
        hook.armed = True
        return hook

    def unscale_(self, optimizer):
        """Divide the gradients ``optimizer`` updates with by the scale and check them (a
        distributed optimizer's after its reduction, which runs now)."""
        state = self._state(optimizer)
        if not self._enable:
            return
        if state == UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since "
                               "the last update()")
        if state == STEPPED:
            raise RuntimeError("unscale_() is being called after step(); call update() first")
        if isinstance(optimizer, DistributedOptimizer):
            self._hook(optimizer)
            optimizer.reduce_gradients()
        else:
            self._check(optimizer, self._agreement(optimizer))
        self._states[id(optimizer)] = UNSCALED

    def step(self, optimizer):
        """Update with the unscaled gradients, unless they held an inf or NaN (then they are
        zeroed and the step is counted in ``skipped_steps``)."""
        state = self._state(optimizer)
        if not self._enable:
            return optimizer.step()
        if state == STEPPED:
            raise RuntimeError("step() has already been called since the last update()")
        if isinstance(optimizer, DistributedOptimizer):
            if state == INIT:
                self._hook(optimizer)
            optimizer.step()
        else:
            if state == INIT:
                self._check(optimizer, self._agreement(optimizer))
            if not self._skips():
                optimizer.step()
        self._states[id(optimizer)] = STEPPED
        if not self._scaling.dynamic:
            self._states.clear()

    def update(self):
        """Move the scale by the rule after the step checked since the last update (nothing
        when none was, or the scale is fixed)."""
        if not self._enable:
            return
        if self._found is not None:
            self._scaling.update_loss_scaling(self._found)
            self._found = self._skipped = None
        self._states.clear()

    def minimize(self, optimizer, *args, **kwargs):
        """``step(optimizer)`` then ``update()``; the loss arguments Paddle passes on to the
        optimizer are not needed: backward has already run.

        ``minimize(optimizer, model, loss_fn, x, y)``, with an optimizer from
        ``fleet.distributed_optimizer``: one whole step, ``optimizer.minimize(model, loss_fn,
        x, y)`` with the loss scaled (its gradient seeded with the scale, on a pipeline's last
        stage for each micro-batch), the gradients unscaled and checked after the step's
        gradient reduction (the verdict agreed as ``step``'s), then ``update()``; returns the
        step's loss, unscaled. ``PipelineParallel.train_batch(..., scaler=scaler)`` runs
        this, as Paddle's scales the loss on the last stage and steps the scaler after the
        schedule."""
        if len(args) == 4 and not kwargs:
            return self._whole_step(optimizer, *args)
        if not self._enable:
            return optimizer.minimize(*args, **kwargs)
        self.step(optimizer)
        self.update()

    def _whole_step(self, optimizer, model, loss_fn, x, y):
        state = self._state(optimizer)
        if not isinstance(optimizer, DistributedOptimizer):
            raise TypeError(f"GradScaler.minimize(optimizer, model, loss_fn, x, y) runs a whole "
                            f"step of the optimizer fleet.distributed_optimizer returned, not "
                            f"of a {type(optimizer).__name__}; with a plain optimizer scale "
                            "the loss (scaler.scale(loss).backward()) and call "
                            "scaler.minimize(optimizer, scaled)")
        self._disable_for_bfloat16()
        if not self._enable:
            return optimizer.minimize(model, loss_fn, x, y)
        if state != INIT:
            raise RuntimeError("GradScaler.minimize(optimizer, model, loss_fn, x, y) runs a "
                               "whole step, but unscale_() or step() was already called on "
                               "this optimizer since the last update()")
        hook = self._hook(optimizer)
        hook.seeds_loss = True
        try:
            loss = optimizer.minimize(model, loss_fn, x, y)
        finally:
            hook.armed = hook.seeds_loss = False
        self._states[id(optimizer)] = STEPPED
        self.update()
        return loss

    # -- state ------------------------------------------------------------------------------
    def state_dict(self):
        """Paddle's keys (``scale``, ``incr_ratio``, ``decr_ratio``, ``incr_every_n_steps``,
        ``decr_every_n_nan_or_inf``, ``incr_count``, ``decr_count``,
        ``use_dynamic_loss_scaling``), and ``skipped_steps``; empty when disabled."""
        if not self._enable:
            return {}
        state = {key: self._settings[key] for key in _SETTINGS}
        state.update(scale=backend.to_numpy(self._scaling.scale).copy(),
                     incr_count=self.good_steps, decr_count=self.bad_steps,
                     skipped_steps=self.skipped_steps)
        return state

    def load_state_dict(self, state_dict):
        if not self._enable:
            return
        if not state_dict:
            raise RuntimeError("the state dict is empty, possibly because it was saved from a "
                               "disabled GradScaler")
        missing = sorted({"scale", "incr_count", "decr_count", *_SETTINGS} - set(state_dict))
        if missing:
            raise KeyError(f"GradScaler state dict misses {missing}")
        self._settings.update(_checked({key: state_dict[key] for key in _SETTINGS}))
        self._scaling = self._new_scaling(float(state_dict["scale"][0]))
        self._scaling.set_state_dict({
            "loss_scaling": float(state_dict["scale"][0]),
            "good_steps": state_dict["incr_count"], "bad_steps": state_dict["decr_count"],
            "skipped_steps": state_dict.get("skipped_steps", 0)}, what="GradScaler")

    set_state_dict = load_state_dict


def distributed_scaler(scaler):
    """Paddle's ``fleet.distributed_scaler``: ``scaler`` agreeing its overflow verdict with
    every rank of the job (the data, model, pipeline and sharding axes together: the world),
    so that a step skipped on one rank is skipped on all. Returns ``scaler``."""
    if not isinstance(scaler, GradScaler):
        raise TypeError(f"distributed_scaler takes a fleetmpi.amp.GradScaler, not "
                        f"{type(scaler).__name__}")
    from .. import world

    if world.worker_num() > 1:
        from fleetmpi.comm import get_communicator

        scaler._communicator = get_communicator()
    scaler.distributed = True
    return scaler


__all__ = ["GradScaler", "distributed_scaler"]

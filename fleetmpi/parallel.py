"""Data-parallel training: ``distributed_model`` and ``distributed_optimizer``.

Every rank holds the whole model and trains on its own shard of each global batch. Parameters
start identical (one fused broadcast of the flat buffers from rank 0), and after backward the
gradients are averaged over the ranks, bucket by bucket as backward completes them, so with equal
per-rank batches every rank applies the gradient of the mean loss over the global batch.

Two ways to train, with the same strategies:

* ``opt.minimize(model, loss_fn, x, y)``: one whole step.
* Paddle dygraph's ``loss = loss_fn(model(x), y); loss.backward(); opt.step();
  opt.clear_grad()``. A model from ``distributed_model`` opens a step of the optimizer that
  owns its parameters when it is called (training, recording on): the strategies' forward
  stages run around the model's forward, ``loss.backward()`` runs their backward stages with
  the gradient hooks that start each bucket's reduction, and ``opt.step()`` reduces what is
  left, updates and closes the step. Gradients accumulate until ``clear_grad()``, as in Paddle.
"""
import weakref

from .core import backend, paddle_flags
from . import hybrid, world
from .autograd import engine, is_grad_enabled
from .config.distributed_strategy import DistributedStrategy
from .core.log import logger
from .nn import lazy
from .nn.pipeline_layer import PipelineLayer
from .nn.functional import cudnn
from .optimizer import Optimizer, StepContext, run_step
from .pipeline_parallel import PipelineParallel
from .training.model_agreement import check_same_model
from .optimizer.step import (backward_pass, finish_step, minimize_loss, report_gradients,
                             run_backward_stage, run_forward, run_reduce_stage, step_running)
from .strategies import applied
from .strategies.compose import build_strategies
from .strategies.configs import ShardingConfig
from .strategies.nonfinite import NonFiniteCheck

_STRATEGY_STATE = "strategy."
_applied = None
# id(parameter) -> the DistributedOptimizer built last over it, whose step a call of a model
# holding the parameter opens.
_owners = weakref.WeakValueDictionary()
# Strategies whose forward stage changes how the model computes (casts, recomputation,
# global batch statistics), so the forward must run inside their step.
_FORWARD_STRATEGIES = frozenset({"amp", "recompute", "sync_batch_norm"})


def applied_strategy():
    """The ``AppliedStrategy`` of the most recent ``distributed_optimizer``: the strategy that
    runs (``auto`` resolved into what its calibration chose, so it can be saved with
    ``save_to_prototxt`` and reused without calibrating), ``active`` (the strategies whose
    hooks run), ``not_applied`` (every field set that changes nothing here, and why) and
    ``calibration`` (auto's measurements, or None). Under ``auto`` it exists after the first
    ``minimize`` call, which calibrates."""
    if _applied is None:
        raise RuntimeError("no strategy is applied yet: call fleet.distributed_optimizer first "
                           "(with strategy.auto, also one minimize call, which calibrates)")
    return _applied


def _configure_cudnn(strategy):
    """Hand ``strategy``'s cuDNN fields to the cuDNN path (process-wide, as Paddle's flags)."""
    cudnn.configure(strategy.cudnn_exhaustive_search, strategy.conv_workspace_size_limit)


def _world_communicator(communicator):
    if communicator is not None:
        return communicator
    world.topology()
    from .comm import get_communicator

    return get_communicator()


def strategy_communicator(strategy):
    """The world's ``Communicator`` configured by the strategy's allreduce fields
    (``hybrid.strategy_communicator``)."""
    world.topology()
    return hybrid.strategy_communicator(strategy)


def distributed_model(model, communicator=None):
    """Make ``model``'s parameters and buffers identical on every rank (rank 0's values, one
    broadcast per flat buffer and one for the buffers) and return it; a ``PipelineLayer``
    comes back as a ``PipelineParallel`` (``train_batch``, ``eval_batch``), its stage's
    parameters made identical over the stage's data-parallel replicas. Parameters built under
    ``LazyGuard`` stay without values: ``distributed_optimizer`` gives them theirs, the same
    on every rank (``nn.lazy``). In parameter-server mode
    nothing is broadcast: the model is remembered, and workers take its parameters from the
    servers in ``fleet.init_worker()``."""
    if world.roles() is not None:
        from .strategies.ps.runtime import register_model

        return register_model(model)
    if not model.parameters():
        raise ValueError(f"distributed_model got a {type(model).__name__} with no parameters: a "
                         "Layer registers the sublayers and parameters assigned to its "
                         "attributes after super().__init__(); check that its __init__ assigns "
                         "them there")
    if isinstance(model, PipelineLayer):
        _broadcast_state(model, model.data_parallel_group)
        return PipelineParallel(model, world.init_strategy())
    _broadcast_state(model, hybrid.parameter_communicator(_world_communicator(communicator)))
    if not isinstance(model.__dict__.get("forward"), _StepForward):
        model.forward = _StepForward(model, model.forward)
    return model


def owner_of(model):
    """The ``DistributedOptimizer`` built last over ``model``'s parameters, or None: the one
    whose step a call of the model opens."""
    params = model.parameters()
    return _owners.get(id(params[0])) if params else None


def _broadcast_state(model, comm):
    """Give ``model``'s parameters and buffers rank 0's values over ``comm`` (None: alone)."""
    if comm is None:
        return
    check_same_model(model, comm)
    # A buffer built under LazyGuard has no values yet; every rank draws the same ones.
    flats = [buffer.data for buffer in model.flat_buffers() if not buffer.deferred]
    if flats:
        comm.broadcast_many(flats, root=0)
    states = [b for _, b in model.named_buffers()]
    if states:
        comm.broadcast_many(states, root=0)


class _StepForward:
    """The forward of a model from ``distributed_model``: opens a step of the distributed
    optimizer that owns the model's parameters, when called outside ``minimize`` while
    training with recording on (module docstring); otherwise the model's own forward."""

    def __init__(self, model, forward):
        self._model = weakref.ref(model)
        self._forward = forward

    def __call__(self, *inputs, **kwargs):
        model = self._model()
        owner = None
        if model is not None and model.training and is_grad_enabled() and not step_running():
            owner = owner_of(model)
        if owner is None:
            return self._forward(*inputs, **kwargs)
        return owner.open_step(model, lambda: self._step_forward(model)(*inputs, **kwargs))

    def _step_forward(self, model):
        """The forward the step runs: one a strategy gave the model for the step's forward
        stage (recompute's), else the model's own."""
        current = vars(model).get("forward", self)
        return self._forward if current is self else current


class DistributedOptimizer:
    """An optimizer whose ``minimize`` runs one step through the hooks of the strategies
    ``strategy`` enables (``fleetmpi.strategies.compose`` orders them and refuses combinations
    that cannot work), ending with the gradient averaging over the ranks; everything else is
    the wrapped optimizer's. ``strategies`` maps each enabled strategy's name to its object,
    where its state can be observed (amp's loss scaling, adaptive_localsgd's current k)."""

    def __init__(self, optimizer, strategy=None, communicator=None, local=False,
                 auto_seconds=None, auto_allow=None, auto_memory_MB=None):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"distributed_optimizer wraps a fleetmpi.optimizer optimizer, "
                            f"not {type(optimizer).__name__}")
        strategy = DistributedStrategy() if strategy is None else strategy
        if not isinstance(strategy, DistributedStrategy):
            raise TypeError(f"strategy must be a fleetmpi.DistributedStrategy, not "
                            f"{type(strategy).__name__}")
        strategy = paddle_flags.with_flags(strategy)
        knobs = (auto_seconds, auto_allow, auto_memory_MB)
        self._calibration = None
        if strategy.auto:
            from .strategies.auto import auto_knobs

            knobs = auto_knobs(*knobs)
            narrowing = [name for name in ("pipeline", "sharding") if getattr(strategy, name)]
            narrowing += ["hybrid_configs"] if hybrid.is_hybrid(strategy) else []
            if narrowing:
                raise ValueError(f"strategy.auto cannot be combined with {narrowing[0]}, which "
                                 "narrows the optimizer to this rank's part for good, while "
                                 "auto builds every candidate on the whole optimizer; set the "
                                 "strategy by hand")
        elif any(value is not None for value in knobs):
            raise ValueError("auto_seconds, auto_allow and auto_memory_MB configure "
                             "strategy.auto, which is off")
        self.inner = optimizer
        _materialize_unless_stage3(optimizer, strategy)
        if local:
            communicator = None
        elif world.worker_num() > 1 or communicator is not None:
            communicator = communicator or strategy_communicator(strategy)
        # Under hybrid_configs the strategies run over this rank's model-parallel coordinate.
        self.hybrid = hybrid.run_of(strategy, optimizer, communicator, local)
        if self.hybrid is not None:
            strategy, communicator = self.hybrid.strategy, self.hybrid.communicator
        self.communicator = communicator
        self.step_count = 0
        self._configured = set()
        self._open = None
        self._backward_done = False
        self._reduced = False
        for p in optimizer.parameters():
            _owners[id(p)] = self
        if strategy.auto:
            from .strategies.auto import Calibration, resolved

            self._calibration = Calibration(strategy, knobs, optimizer, communicator,
                                            strategy_communicator, _local_size(local))
            strategy = resolved(strategy, {})
        self._apply(strategy)

    def _apply(self, strategy, calibration=None):
        """Build the step hooks of ``strategy`` and report what it applies."""
        global _applied
        agreement = None if self.hybrid is None else self.hybrid.agreement
        self.hooks = build_strategies(strategy, self.inner, self.communicator, agreement)
        self.strategy = strategy
        self.strategies = {hook.name: hook for hook in self.hooks}
        build = strategy.build_strategy
        _configure_cudnn(strategy)
        self.inner.fuse_all_optimizer_ops = bool(build.fuse_all_optimizer_ops)
        self._fusion = (bool(build.fuse_elewise_add_act_ops), bool(build.fuse_bn_act_ops))
        reasons = applied.not_applied(strategy, self.communicator, backend.on_gpu(), self.hooks)
        self.applied_strategy = applied.AppliedStrategy.of(
            strategy, [hook.name for hook in self.hooks if hook.name != NonFiniteCheck.name],
            reasons, calibration)
        if self._calibration is None:
            _applied = self.applied_strategy
            applied.report(self.applied_strategy)

    def _calibrate(self, model, loss_fn, x, y):
        """Run auto's calibration on this batch and apply the strategy it chose."""
        calibration, self._calibration = self._calibration, None
        strategy, report = calibration.run(model, loss_fn, x, y)
        self.communicator = calibration.communicator_for(strategy)
        calibration.release(keep=self.communicator)
        self._configured.clear()
        self._apply(strategy, report)
        if self.communicator is None or self.communicator.rank == 0:
            print(report.text(), flush=True)

    def _configure(self, model):
        """Switch ``model``'s fused kernels as the strategy asks (once per model and strategy)
        and report each fusion field the model has nothing to fuse for."""
        global _applied
        if id(model) in self._configured:
            return
        model.configure_fusion(*self._fusion)
        self._configured.add(id(model))
        reasons = applied.unfused(self.strategy, model)
        if reasons:
            updated = self.applied_strategy.with_reasons(reasons)
            if _applied is self.applied_strategy:
                _applied = updated
            self.applied_strategy = updated
            applied.report(updated)

    @property
    def agreement(self):
        """The ranks that must share a decision to skip a step (every rank of a hybrid
        layout, else the optimizer's communicator; None alone)."""
        if self.hybrid is not None and self.hybrid.agreement is not None:
            return self.hybrid.agreement
        return self.communicator

    @property
    def calibrating(self):
        """Whether ``strategy.auto`` has yet to calibrate (on the first ``minimize`` call)."""
        return self._calibration is not None

    @property
    def step_open(self):
        """Whether a step opened by calling the model waits for its ``step()``."""
        return self._open is not None

    def add_hook(self, hook, first=False):
        """Put ``hook`` into the step chain (outermost when ``first``)."""
        if first:
            self.hooks.insert(0, hook)
        else:
            self.hooks.append(hook)

    def minimize(self, *args):
        """``minimize(loss)``: ``loss.backward()`` and ``step()``. ``minimize(model, loss_fn,
        x, y)``: one training step; returns this rank's mean loss as a 0-d array. Under
        ``strategy.auto`` the first such call calibrates on its batch first (module
        ``fleetmpi.strategies.auto``), leaving parameters and optimizer state as they were."""
        loss = minimize_loss(args)
        if loss is not None:
            if not self._backward_done:
                loss.backward()
            self.step()
            return None
        if self._open is not None:
            raise RuntimeError("minimize(model, loss_fn, x, y) while a step opened by calling "
                               "the model is not finished; call opt.step() first")
        model, loss_fn, x, y = args
        if self._calibration is not None:
            self._configure(model)
            self._calibrate(model, loss_fn, x, y)
        self._configure(model)
        ctx = StepContext(model, loss_fn, x, y, self.inner, step=self.step_count)
        loss = run_step(self.hooks, ctx)
        self.step_count += 1
        return loss

    # -- Paddle dygraph's idiom: model(x), loss.backward(), step(), clear_grad() -------------
    def _refuse_dygraph(self):
        if self._calibration is not None:
            raise RuntimeError("strategy.auto calibrates on a whole step: train the first step "
                               "with opt.minimize(model, loss_fn, x, y), which calibrates, "
                               "then either idiom")
        if "pipeline" in self.strategies:
            raise RuntimeError("pipeline runs its micro-batch schedule itself: train with "
                               "opt.minimize(model, loss_fn, x, y)")

    def open_step(self, model, forward):
        """Run ``forward()`` (the model's) as the forward stage of a new step, or of the open
        one when backward has not run yet (several forwards feeding one loss)."""
        if self._open is not None and not self._backward_done:
            return forward()
        if self._open is not None:
            raise RuntimeError("the model was called again after loss.backward() without "
                               "opt.step() in between; call opt.step() (and opt.clear_grad()) "
                               "each step, or merge gradients with strategy.gradient_merge")
        self._refuse_dygraph()
        self._configure(model)
        ctx = StepContext(model, None, None, None, self.inner, step=self.step_count)

        def run(ctx):
            ctx.output = forward()
        run_forward(self.hooks, ctx, run)
        self._open, self._backward_done = ctx, False
        engine.set_step_driver(self._backward)
        return ctx.output

    def _backward(self, loss, grad):
        """``loss.backward(grad)`` inside the open step: the strategies' backward stages and
        the gradient hooks."""
        ctx = self._open
        if self._backward_done:
            raise RuntimeError("a second backward() in one step of the distributed optimizer: "
                               "call opt.step() between backwards, or merge gradients over "
                               "steps with strategy.gradient_merge")
        if grad is not None:
            raise ValueError("loss.backward(grad) with an explicit grad is not supported in a "
                             "distributed step; backward a one-element loss")
        ctx.loss = loss
        run_backward_stage(self.hooks, ctx, lambda ctx: backward_pass(self.hooks, ctx))
        self._backward_done = True

    def _late_step(self):
        """A step whose backward ran outside any open step (the model was not passed through
        distributed_model): the strategies' forward stages with nothing to run, and every
        parameter reported as final at once, in buffer order."""
        self._refuse_dygraph()
        during_forward = sorted(set(self.strategies) & _FORWARD_STRATEGIES)
        if during_forward:
            raise RuntimeError(f"strategy {', '.join(during_forward)} acts while the model runs "
                               "forward, but this step's backward ran without a step opened by "
                               "calling the model: pass the model through "
                               "fleet.distributed_model(model) before training")
        ctx = StepContext(None, None, None, None, self.inner, step=self.step_count)
        self.inner.settle_grads()
        run_forward(self.hooks, ctx, lambda ctx: None)

        def report(ctx):
            for hook in self.hooks:
                for p in self.inner.parameters():
                    hook.on_gradient(ctx, [p])
        run_backward_stage(self.hooks, ctx, report)
        return ctx

    def _ready_step(self, what):
        """The step whose backward ran, to reduce or finish (``what`` names the call)."""
        if self._open is not None and not self._backward_done:
            raise RuntimeError(f"opt.{what}() before loss.backward(): the step's forward ran "
                               "but its backward did not")
        if self._open is None:
            self._open, self._backward_done = self._late_step(), True
            self._reduced = False
        return self._open

    def reduce_gradients(self):
        """Run the open step's gradient reduction now, before ``step()`` (which then updates
        and closes the step): the gradients the update will use are then final, for a loss
        scaler to unscale (``fleetmpi.amp.GradScaler.unscale_``)."""
        ctx = self._ready_step("reduce_gradients")
        if self._reduced:
            raise RuntimeError("the gradients of this step are already reduced; call "
                               "opt.step() to finish it")
        run_reduce_stage(self.hooks, ctx)
        self._reduced = True

    def shadow_step(self, contributors):
        """The step of the ranks still training, taken by a rank that has joined
        (``fleetmpi.Join``): no forward, zero gradients, every parameter reported as final at
        once, then the reduction (averaged over the ``contributors``), update and after-step of
        the same hooks, so every collective the others' step makes is answered."""
        ctx = StepContext(None, None, None, None, self.inner, step=self.step_count)
        ctx.contributors = contributors
        self.inner.clear_grad()
        run_forward(self.hooks, ctx, lambda ctx: None)
        run_backward_stage(self.hooks, ctx, lambda ctx: report_gradients(self.hooks, ctx))
        finish_step(self.hooks, ctx)
        self.step_count += 1

    def step(self):
        """Finish the open step: reduce the gradients not reduced yet, update, after-step."""
        ctx = self._ready_step("step")
        self._open = None
        engine.set_step_driver(None)
        finish_step(self.hooks, ctx, reduced=self._reduced)
        self._reduced = False
        self.step_count += 1

    def clear_grad(self):
        self.inner.clear_grad()

    clear_gradients = clear_grad

    def state_dict(self):
        """The wrapped optimizer's state, the step counter, and each strategy's state under
        ``"strategy.<name>.<key>"``."""
        state = self.inner.state_dict()
        state["distributed_step_count"] = self.step_count
        for name, hook in self.strategies.items():
            for key, value in hook.state_dict().items():
                state[f"{_STRATEGY_STATE}{name}.{key}"] = value
        return state

    def set_state_dict(self, state):
        own = {k: v for k, v in state.items() if not k.startswith(_STRATEGY_STATE)
               and k != "distributed_step_count"}
        self.inner.set_state_dict(own)
        self.step_count = int(state.get("distributed_step_count", 0))
        for name, hook in self.strategies.items():
            prefix = f"{_STRATEGY_STATE}{name}."
            hook.set_state_dict({k[len(prefix):]: v for k, v in state.items()
                                 if k.startswith(prefix)})

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _materialize_unless_stage3(optimizer, strategy):
    """Give the parameters of a model built under ``LazyGuard`` their values whole, unless
    ``strategy`` is sharding stage 3, which produces only this rank's shard of them
    (``Optimizer.shard``); says so when it does."""
    if strategy.sharding and ShardingConfig.of(strategy).stage == 3:
        return
    sizes = {id(p.buffer): p.buffer.size * p.buffer.dtype.itemsize
             for p in optimizer.parameters() if p.buffer is not None and p.buffer.deferred}
    if lazy.materialize(optimizer.parameters()):
        logger.warning("the model was built under LazyGuard, but this strategy keeps every "
                       "parameter whole on each rank (only sharding stage 3 partitions them), "
                       "so it is materialised whole: %.2f MiB of parameters and as much of "
                       "gradients on this rank", sum(sizes.values()) / 2 ** 20)


def _local_size(local):
    """The ranks sharing this node's memory: 1 for a process training alone."""
    return 1 if local or world.worker_num() == 1 else world.local_size()


def _parameter_server_optimizer(optimizer, strategy):
    """``distributed_optimizer`` in parameter-server mode, with its ``applied_strategy``."""
    global _applied
    from .strategies.ps.runtime import make_optimizer

    strategy = DistributedStrategy() if strategy is None else strategy
    if strategy.auto:
        raise NotImplementedError("strategy.auto calibrates collective training; in "
                                  "parameter-server mode set a_sync and a_sync_configs")
    ps_optimizer = make_optimizer(optimizer, strategy)
    _configure_cudnn(strategy)
    _applied = applied.AppliedStrategy.of(
        strategy, [f"parameter_server ({ps_optimizer.mode})"],
        applied.parameter_server_not_applied(strategy, backend.on_gpu()))
    applied.report(_applied)
    return ps_optimizer


def distributed_optimizer(optimizer, strategy=None, communicator=None, local=False,
                          auto_seconds=None, auto_allow=None, auto_memory_MB=None):
    """Wrap ``optimizer`` for distributed training under ``strategy``; when None, the one
    given to ``fleet.init(strategy=...)`` (as Paddle's), else the default
    ``DistributedStrategy``. ``local=True`` runs the strategies on this process
    alone, with no communication: the single-process math a multi-rank run must match.

    ``strategy.auto = True`` chooses the strategy by measuring it on the first ``minimize``
    call; ``auto_seconds``, ``auto_allow`` and ``auto_memory_MB`` bound the calibration's time,
    admit strategies that change the arithmetic, and set the activation memory budget (each
    also an environment variable; ``fleetmpi.strategies.auto.settings``). ``applied_strategy()``
    then returns what was chosen, and for every strategy what runs and what does not.

    In parameter-server mode (``fleet.init(is_collective=False)``) it returns a
    ``ParameterServerOptimizer``: ``a_sync`` and ``a_sync_configs`` choose synchronous,
    asynchronous or GEO training (see ``fleetmpi.strategies.ps``)."""
    if strategy is None:
        strategy = world.init_strategy()
    if not local and world.roles() is not None:
        return _parameter_server_optimizer(optimizer, strategy)
    return DistributedOptimizer(optimizer, strategy, communicator, local, auto_seconds,
                                auto_allow, auto_memory_MB)

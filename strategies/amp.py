"""amp: automatic mixed precision with float32 master weights and dynamic loss scaling.

Every ``Function`` of the trainer names the Paddle operator it computes (``op_type``).
Operators on the white list (``matmul`` and ``conv2d``, plus ``custom_white_list``) compute in
the low-precision dtype, float16 or bfloat16, those on the black list (``batch_norm`` and
``softmax_with_cross_entropy``, plus ``custom_black_list``) in float32, and the rest (gray) in
the dtype their inputs come in, or at level O2 in the low-precision dtype too (the dtype and
level come from Paddle's names for them, ``amp_precision``). A custom white-list entry takes
the operator off the default black list; a custom black-list entry wins over every white list.
The policy is applied per operator call (``fleetmpi.autograd``'s ``autocast``) from the step's
forward stage to the end of its backward stage, so it covers any model, built-in layers or a
user's own ``forward``, and the loss computed after the model in the dygraph idiom. The casts
are recorded operations: the parameters stay float32 (the master weights, with float32
optimizer state in the flat buffers), a low-precision operator computes with a cast copy of
them, and the gradient of that copy comes back through the cast as float32 into the float32
gradient buffer. A fused activation (``fuse_elewise_add_act_ops``, ``fuse_bn_act_ops``) runs in
the dtype of the operator it is fused into. ``softmax_with_cross_entropy`` takes float16 logits
without the cast: it computes in float32 whatever it is given, so the cast would only copy the
logits (``F.cross_entropy``).

Loss scaling (float16; bfloat16 only at a fixed scale, ``amp_precision.scales_loss``): the loss
gradient is ``loss_scaling`` instead of 1 (``StepContext.loss_scale``) so that small gradients
do not flush to zero in float16. The gradients stay scaled through backward, gradient_merge and
the reduction, as with Paddle's GradScaler (a power-of-two scale, which the defaults keep,
gives the same bits as unscaling before the reduction). After the gradient reduction, on a step
that would update, one pass over the gradients the update uses divides them by the scale and
checks them for inf and NaN (``kernels.multi_tensor_unscale``: one launch per dtype on a GPU,
writing a device flag); the flag is combined over the ranks (so every rank agrees even when
gradients were not averaged this step). The update cannot share that pass: whether to skip it
depends on every gradient element of every rank.
A step that overflowed anywhere is skipped everywhere: gradients zeroed, no optimizer update,
parameters and optimizer state untouched, and the layers' buffers (batch-norm running
statistics) set back to what they were before the forward passes that led to it, so an
overflowing forward leaves no inf or NaN in them. The scale then follows Paddle's
``update_loss_scaling`` rule (``strategies.loss_scaling``, shared with the dygraph
``fleetmpi.amp.GradScaler``).
``use_dynamic_loss_scaling=False`` keeps ``init_loss_scaling`` fixed; overflowing steps are
still skipped. Steps that overflow at the lowest scale end the run (``loss_scaling``'s
docstring says after how many). Outside a CUDA graph capture rank 0 logs each skipped step as a warning with
the new loss scale, at most one line per ``SKIP_LOG_SECONDS`` (the next line counts those held
back). Steps that do not update (gradient_merge's steps between its updates) are not
checked and leave the scale alone. Without loss scaling (bfloat16) amp checks nothing and
skips no step; the non-finite check of every step (``fleetmpi.strategies.nonfinite``) does.

The scale and Paddle's counters live in device arrays (``LossScaling``). Inside a CUDA graph capture the verdict is never read:
the gradients and buffers of a skipped step are put back by selects (``kernels.where_found``),
and the update is launched with the flag (``StepContext.found_inf``) and skips itself on the
device, so an amp step can be captured. Outside a capture the flag is read once (the step's one
host sync, free on the CPU), the resets branch on it on the host, and a skipped step does not
call the update, which keeps every update a strategy may put in its place (dgc's, lars's and
lamb's) seeing ``apply_update`` as before.
"""
import numpy as np

from fleetmpi.autograd import Function, autocast
from fleetmpi.core.log import RateLimited
from .base import Strategy
from .configs import AMPConfig
from .loss_scaling import LossScaling, check_step

# Paddle's other names of the operators this trainer computes.
ALIASES = {"mul": "matmul", "matmul_v2": "matmul", "lookup_table_v2": "lookup_table"}
DEFAULT_WHITE_LIST = frozenset({"matmul", "conv2d"})
DEFAULT_BLACK_LIST = frozenset({"batch_norm", "softmax_with_cross_entropy"})
FLOAT16 = np.dtype("float16")
FLOAT32 = np.dtype("float32")
# Level O2 computes every operator in the low-precision dtype but these: the black list's and
# the cast that amp's own casts are recorded as.
NEVER_CAST = frozenset({"cast"})
# At most one line per this many seconds about skipped steps (rank 0's); a burst of them, as
# while the scale falls from its initial value, is counted in the next line.
SKIP_LOG_SECONDS = 10.0


def known_operators():
    """Every operator name the lists may hold: the ``op_type`` of each Function defined so
    far (a user's own included) and Paddle's aliases of them."""
    return (set(Function.op_types()) - {"cast"}) | set(ALIASES)


def _operators(key, names):
    """The operators ``names`` (the custom list ``key`` names) refer to, aliases resolved."""
    known = sorted(known_operators())
    for name in names:
        if name not in known:
            raise ValueError(f"{key} names {name!r}, which is not an operator of this trainer; "
                             f"known operators: {', '.join(known)}")
    return {ALIASES.get(name, name) for name in names}


def op_lists(custom_white_list, custom_black_list, where="amp_configs."):
    """``(white, black)``: the operators amp runs in the low-precision dtype and in float32,
    from the names of ``custom_white_list`` and ``custom_black_list`` (named ``where`` + the
    key in errors)."""
    white = _operators(f"{where}custom_white_list", custom_white_list)
    black = _operators(f"{where}custom_black_list", custom_black_list)
    both = sorted(white & black)
    if both:
        raise ValueError(f"{where}custom_white_list and custom_black_list both name "
                         f"{', '.join(both)}; an operator runs either in the low-precision "
                         "dtype (white) or in float32 (black)")
    return (DEFAULT_WHITE_LIST | white) - black, (DEFAULT_BLACK_LIST - white) | black


class CastPolicy:
    """The autocast policy of amp's lists: ``dtype`` (float16 by default, or bfloat16) for a
    white-list operator, float32 for a black-list one, and for the rest None (the inputs'
    dtype), or with ``pure`` (level O2) ``dtype`` too."""

    def __init__(self, white_list, black_list, dtype=FLOAT16, pure=False):
        self.white_list, self.black_list = frozenset(white_list), frozenset(black_list)
        self.dtype, self.pure = np.dtype(dtype), bool(pure)

    def dtype_for(self, op):
        if op in self.white_list:
            return self.dtype
        if op in self.black_list:
            return FLOAT32
        if self.pure and op not in NEVER_CAST:
            return self.dtype
        return None


class AMP(Strategy):
    """``amp``. Observable: ``precision`` (the ``amp_precision.Precision``: dtype and level),
    ``scales_loss`` (whether the loss is scaled and the gradients checked), ``loss_scaling``
    (the scale the next step uses), ``good_steps`` and ``bad_steps`` (Paddle's consecutive
    finite and overflowing step counters), ``skipped_steps`` (steps skipped for overflow so
    far), ``white_list`` and ``black_list`` (the operators run in the low-precision dtype and
    in float32), and ``policy``, the ``CastPolicy`` of those lists that is current from a
    step's forward stage to the end of its backward stage."""

    name = "amp"
    config_class = AMPConfig
    communicator_scope = "agreement"

    def __init__(self, strategy, optimizer, communicator):
        super().__init__(strategy, optimizer, communicator)
        config = self.config
        self.white_list, self.black_list = op_lists(config.custom_white_list,
                                                    config.custom_black_list)
        self.precision = config.precision
        self.scales_loss = config.scales_loss
        self.use_dynamic_loss_scaling = config.use_dynamic_loss_scaling and self.scales_loss
        self.policy = CastPolicy(self.white_list, self.black_list,
                                 self.precision.array_dtype(), self.precision.pure)
        self._autocast = None
        self._saved_buffers = None
        self.scaling = LossScaling(
            config.init_loss_scaling if self.scales_loss else 1, config.incr_ratio,
            config.decr_ratio, config.incr_every_n_steps, config.decr_every_n_nan_or_inf,
            self.use_dynamic_loss_scaling)
        self.rank = 0 if communicator is None else communicator.rank
        self._skip_log = RateLimited(SKIP_LOG_SECONDS)

    @classmethod
    def check(cls, strategy, optimizer):
        super().check(strategy, optimizer)
        config = AMPConfig.of(strategy)
        op_lists(config.custom_white_list, config.custom_black_list)
        config.precision.array_dtype()
        dtypes = sorted({p.dtype.name for p in optimizer.parameters()} - {FLOAT32.name})
        if dtypes:
            raise ValueError(f"amp keeps float32 master weights and needs float32 parameters, "
                             f"but the optimizer has {', '.join(dtypes)} parameters; build the "
                             "model with dtype='float32'")

    checks_every_update = property(lambda self: self.scales_loss)
    loss_scaling = property(lambda self: self.scaling.loss_scaling)
    good_steps = property(lambda self: self.scaling.good_steps)
    bad_steps = property(lambda self: self.scaling.bad_steps)
    skipped_steps = property(lambda self: self.scaling.skipped_steps)

    def update_loss_scaling(self, found_inf):
        """The loss-scaling rule after a step (``LossScaling.update_loss_scaling``)."""
        self.scaling.update_loss_scaling(found_inf)

    # -- the policy for one step ------------------------------------------------------------
    def _enter(self, ctx):
        self._leave()
        ctx.loss_scale = self.scaling.seed()
        self._autocast = autocast(self.policy)
        self._autocast.__enter__()

    def _leave(self):
        if self._autocast is not None:
            self._autocast.__exit__(None, None, None)
            self._autocast = None

    # -- step stages ------------------------------------------------------------------------
    # Overflow to inf or NaN in float16 is expected under loss scaling and handled by skipping
    # the step, so NumPy's overflow warnings are silenced while layers compute.
    def forward(self, ctx, proceed):
        self._enter(ctx)
        if self.scales_loss and self._saved_buffers is None and ctx.model is not None:
            self._save_buffers(ctx.model)
        try:
            with np.errstate(over="ignore", invalid="ignore"):
                return proceed(ctx)
        except BaseException:
            self._leave()
            raise

    def backward(self, ctx, proceed):
        try:
            with np.errstate(over="ignore", invalid="ignore"):
                return proceed(ctx)
        finally:
            self._leave()

    def reduce(self, ctx, proceed):
        result = proceed(ctx)
        if ctx.apply_update and self.scales_loss:
            # Outside a capture the verdict is read on the host once (the step's one host
            # read), and the skipped step's resets branch on it there: a select over every
            # gradient on the device would be a pass over them on every step, overflowed or
            # not. Inside a capture the flag stays on the device.
            grads = [grad for _, grad in self.optimizer.flat_runs()]
            found, skipped = check_step(self.scaling, grads, self.communicator,
                                        self._saved_buffers or (), ctx.step)
            self._saved_buffers = None
            self.scaling.update_loss_scaling(found)
            if skipped is None:
                ctx.found_inf = found
            elif skipped:
                ctx.apply_update = False
                if self.rank == 0:
                    self._skip_log.warning("amp: step %d skipped: the gradients held an inf or "
                                           "NaN on some rank; the loss scale is now %g",
                                           ctx.step, self.loss_scaling)
        return result

    def _save_buffers(self, model):
        """Copies of the model's buffers as the first forward since the last update (or
        skipped update) finds them: one step's, or a gradient_merge window's."""
        self._saved_buffers = [(buffer, buffer.copy()) for _, buffer in model.named_buffers()]

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self):
        return self.scaling.state_dict()

    def set_state_dict(self, state):
        self.scaling.set_state_dict(state)

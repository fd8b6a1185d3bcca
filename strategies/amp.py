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
``update_loss_scaling`` rule, in float32 like Paddle's: after ``decr_every_n_nan_or_inf``
consecutive overflowing steps it is multiplied by ``decr_ratio`` (never below 1), after
``incr_every_n_steps`` consecutive finite steps by ``incr_ratio`` (kept only while finite), each
counter restarting from zero when the other kind of step comes or the scale changes.
``use_dynamic_loss_scaling=False`` keeps ``init_loss_scaling`` fixed; overflowing steps are
still skipped. Outside a CUDA graph capture rank 0 logs each skipped step as a warning with
the new loss scale, at most one line per ``SKIP_LOG_SECONDS`` (the next line counts those held
back). Steps that do not update (gradient_merge's steps between its updates) are not
checked and leave the scale alone. Without loss scaling (bfloat16) amp checks nothing and
skips no step; the non-finite check of every step (``fleetmpi.strategies.nonfinite``) does.

The scale and Paddle's counters live in device arrays moved by elementwise operations from
the flag, with no read on the host (``loss_scaling``, ``good_steps``, ``bad_steps`` and
``skipped_steps`` read them when asked). Inside a CUDA graph capture the verdict is never read:
the gradients and buffers of a skipped step are put back by selects (``kernels.where_found``),
and the update is launched with the flag (``StepContext.found_inf``) and skips itself on the
device, so an amp step can be captured. Outside a capture the flag is read once (the step's one
host sync, free on the CPU), the resets branch on it on the host, and a skipped step does not
call the update, which keeps every update a strategy may put in its place (dgc's, lars's and
lamb's) seeing ``apply_update`` as before.
"""
import numpy as np

from .. import backend, capture_checks, kernels
from ..autograd import Function, autocast
from ..log import RateLimited
from . import amp_precision
from .base import Strategy

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
_STATE_KEYS = ("loss_scaling", "good_steps", "bad_steps", "skipped_steps")


def known_operators():
    """Every operator name the lists may hold: the ``op_type`` of each Function defined so
    far (a user's own included) and Paddle's aliases of them."""
    return (set(Function.op_types()) - {"cast"}) | set(ALIASES)


def _operators(key, names):
    """The operators ``names`` (a custom list of amp_configs) refer to, aliases resolved."""
    known = sorted(known_operators())
    for name in names:
        if name not in known:
            raise ValueError(f"amp_configs.{key} names {name!r}, which is not an operator of "
                             f"this trainer; known operators: {', '.join(known)}")
    return {ALIASES.get(name, name) for name in names}


def op_lists(configs):
    """``(white, black)``: the operators amp runs in float16 and in float32."""
    white = _operators("custom_white_list", configs["custom_white_list"])
    black = _operators("custom_black_list", configs["custom_black_list"])
    both = sorted(white & black)
    if both:
        raise ValueError(f"amp_configs.custom_white_list and custom_black_list both name "
                         f"{', '.join(both)}; an operator runs either in float16 (white) or in "
                         "float32 (black)")
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

    def __init__(self, strategy, optimizer, communicator):
        super().__init__(strategy, optimizer, communicator)
        configs = self.configs
        self.white_list, self.black_list = op_lists(configs)
        self.precision = amp_precision.resolve(configs)
        self.scales_loss = amp_precision.scales_loss(configs, self.precision)
        self.use_dynamic_loss_scaling = (bool(configs["use_dynamic_loss_scaling"])
                                         and self.scales_loss)
        self.incr_every_n_steps = int(configs["incr_every_n_steps"])
        self.decr_every_n_nan_or_inf = int(configs["decr_every_n_nan_or_inf"])
        self.incr_ratio = np.float32(configs["incr_ratio"])
        self.decr_ratio = np.float32(configs["decr_ratio"])
        self.policy = CastPolicy(self.white_list, self.black_list,
                                 self.precision.array_dtype(), self.precision.pure)
        self._autocast = None
        self._saved_buffers = None
        # On the device (a GPU's, or NumPy's): the scale, Paddle's counters (good_steps,
        # bad_steps) and skipped_steps, and the overflow flag the unscale pass writes.
        xp = backend.array_module()
        self._scale = xp.full(1, configs["init_loss_scaling"] if self.scales_loss else 1,
                              dtype=FLOAT32)
        self._counts = xp.zeros(3, dtype=np.int64)
        self._found = xp.zeros(1, dtype=np.int32)
        self.rank = 0 if communicator is None else communicator.rank
        self._skip_log = RateLimited(SKIP_LOG_SECONDS)

    @classmethod
    def check(cls, strategy, optimizer):
        super().check(strategy, optimizer)
        op_lists(strategy.amp_configs)
        amp_precision.resolve(strategy.amp_configs).array_dtype()
        dtypes = sorted({p.dtype.name for p in optimizer.parameters()} - {FLOAT32.name})
        if dtypes:
            raise ValueError(f"amp keeps float32 master weights and needs float32 parameters, "
                             f"but the optimizer has {', '.join(dtypes)} parameters; build the "
                             "model with dtype='float32'")

    @property
    def loss_scaling(self):
        return float(backend.to_numpy(self._scale)[0])

    def _read_count(self, index):
        """Count ``index`` of ``_counts`` (good_steps, bad_steps, skipped_steps), read from
        the device when asked."""
        return int(backend.to_numpy(self._counts)[index])

    good_steps = property(lambda self: self._read_count(0))
    bad_steps = property(lambda self: self._read_count(1))
    skipped_steps = property(lambda self: self._read_count(2))

    # -- the policy for one step ------------------------------------------------------------
    def _enter(self, ctx):
        self._leave()
        # The loss gradient's seed: a host value where the scale is host memory (nothing
        # waits), else the device scalar itself, as inside a capture (the host stand-in of a
        # CUDA graph then seeds as a replay does).
        host = isinstance(self._scale, np.ndarray) and capture_checks.current is None
        ctx.loss_scale = float(self._scale[0]) if host else self._scale
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
            found = self._unscale_and_check()
            # Outside a capture the verdict is read on the host once (the step's one host
            # read), and the skipped step's resets branch on it there: a select over every
            # gradient on the device would be a pass over them on every step, overflowed or
            # not. Inside a capture the flag stays on the device.
            outside = capture_checks.current is None
            verdict = backend.to_numpy(found) if outside else found
            grads = [grad for _, grad in self.optimizer.flat_runs()]
            saved = self._saved_buffers or ()
            kernels.where_found(verdict, grads + [buffer for buffer, _ in saved],
                                [grad.dtype.type(0) for grad in grads] + [s for _, s in saved])
            self._saved_buffers = None
            self._count_step(found)
            if outside:
                ctx.apply_update = not int(verdict[0])
                if not ctx.apply_update and self.rank == 0:
                    self._skip_log.warning("amp: step %d skipped: the gradients held an inf or "
                                           "NaN on some rank; the loss scale is now %g",
                                           ctx.step, self.loss_scaling)
            else:
                ctx.found_inf = found
        return result

    def _save_buffers(self, model):
        """Copies of the model's buffers as the first forward since the last update (or
        skipped update) finds them: one step's, or a gradient_merge window's."""
        self._saved_buffers = [(buffer, buffer.copy()) for _, buffer in model.named_buffers()]

    def _unscale_and_check(self):
        """Divide the gradients the update uses by the loss scale and check them for inf and
        NaN in one pass; the flag (1 where any rank's hold one: one tiny allreduce with more
        than one rank), on the device."""
        self._found[...] = 0
        grads = [grad for _, grad in self.optimizer.flat_runs()]
        kernels.multi_tensor_unscale(grads, np.float32(1) / self._scale, self._found)
        if self.world_size > 1:
            return self.communicator.allreduce(self._found, op="max")
        return self._found

    def _count_step(self, found):
        """``skipped_steps`` and the loss scale after a checked step (``found``: its overflow
        flag), on the device."""
        self._counts[2:3] += found
        if self.use_dynamic_loss_scaling:
            self.update_loss_scaling(found)

    def update_loss_scaling(self, found_inf):
        """Paddle's ``update_loss_scaling`` rule after a step that overflowed or not
        (``found_inf``: a bool, or the step's overflow flag on the device), in float32 like
        Paddle's, by elementwise operations on the device arrays (no read on the host)."""
        xp = backend.array_module()
        good_steps, bad_steps = self._counts[0:1], self._counts[1:2]
        bad = xp.asarray(found_inf) != 0
        good = xp.where(bad, 0, good_steps + 1)
        overflows = xp.where(bad, bad_steps + 1, 0)
        decrease = bad & (overflows == self.decr_every_n_nan_or_inf)
        increase = ~bad & (good == self.incr_every_n_steps)
        with np.errstate(over="ignore"):
            increased = self._scale * self.incr_ratio
        decreased = xp.maximum(self._scale * self.decr_ratio, np.float32(1))
        scale = xp.where(decrease, decreased, self._scale)
        self._scale[...] = xp.where(increase & xp.isfinite(increased), increased, scale)
        good_steps[...] = xp.where(increase, 0, good)
        bad_steps[...] = xp.where(decrease, 0, overflows)

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self):
        return {"loss_scaling": self.loss_scaling, "good_steps": self.good_steps,
                "bad_steps": self.bad_steps, "skipped_steps": self.skipped_steps}

    def set_state_dict(self, state):
        missing = sorted(set(_STATE_KEYS) - set(state))
        unexpected = sorted(set(state) - set(_STATE_KEYS))
        if missing or unexpected:
            raise KeyError(f"amp state does not match: missing {missing}, unexpected "
                           f"{unexpected}")
        self._scale[...] = backend.asarray(np.full(1, state["loss_scaling"], dtype=FLOAT32))
        self._counts[...] = backend.asarray(np.array(
            [int(state[key]) for key in _STATE_KEYS[1:]], dtype=np.int64))

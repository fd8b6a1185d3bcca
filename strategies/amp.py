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
gradients were not averaged this step) and read once, the step's one host sync. The update
cannot share that pass: whether to skip it depends on every gradient element of every rank.
A step that overflowed anywhere is skipped everywhere: gradients zeroed, no optimizer update,
parameters and optimizer state untouched, and the layers' buffers (batch-norm running
statistics) set back to what they were before the forward passes that led to it, so an
overflowing forward leaves no inf or NaN in them. The scale then follows Paddle's
``update_loss_scaling`` rule, in float32 like Paddle's: after ``decr_every_n_nan_or_inf``
consecutive overflowing steps it is multiplied by ``decr_ratio`` (never below 1), after
``incr_every_n_steps`` consecutive finite steps by ``incr_ratio`` (kept only while finite), each
counter restarting from zero when the other kind of step comes or the scale changes.
``use_dynamic_loss_scaling=False`` keeps ``init_loss_scaling`` fixed; overflowing steps are
still skipped. Steps that do not update (gradient_merge's steps between its updates) are not
checked and leave the scale alone. Without loss scaling (bfloat16) nothing is checked, and no
step is skipped: the host never waits on the device for amp's sake.
"""
import numpy as np

from .. import backend, kernels
from ..autograd import Function, autocast
from ..capture_checks import check_host_read
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
        self._scale = np.float32(configs["init_loss_scaling"] if self.scales_loss else 1)
        self.good_steps = 0
        self.bad_steps = 0
        self.skipped_steps = 0
        self.policy = CastPolicy(self.white_list, self.black_list,
                                 self.precision.array_dtype(), self.precision.pure)
        self._inverse = np.float32(1)
        self._autocast = None
        self._saved_buffers = None
        # The overflow flag the unscale pass writes (a device array on a GPU) and the token
        # that marks this step's finding in it.
        self._found = backend.array_module().zeros(1, dtype=np.int32)
        self._token = 0

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
        return float(self._scale)

    # -- the policy for one step ------------------------------------------------------------
    def _enter(self, ctx):
        self._leave()
        self._inverse = np.float32(1) / self._scale
        ctx.loss_scale = float(self._scale)
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
            found_inf = self._unscale_and_check()
            if found_inf:
                for _, grad in self.optimizer.flat_runs():
                    grad[...] = 0
                self._restore_buffers()
                ctx.apply_update = False
                self.skipped_steps += 1
            self._saved_buffers = None
            if self.use_dynamic_loss_scaling:
                self.update_loss_scaling(found_inf)
        return result

    def _save_buffers(self, model):
        """Copies of the model's buffers as the first forward since the last update (or
        skipped update) finds them: one step's, or a gradient_merge window's."""
        self._saved_buffers = [(buffer, buffer.copy()) for _, buffer in model.named_buffers()]

    def _restore_buffers(self):
        for buffer, saved in self._saved_buffers or ():
            buffer[...] = saved

    def _unscale_and_check(self):
        """Divide the gradients the update uses by the loss scale and check them for inf and
        NaN in one pass; whether any rank's hold one (one tiny allreduce with more than one
        rank, then one read of the flag: the step's one host sync)."""
        self._token += 1
        grads = [grad for _, grad in self.optimizer.flat_runs()]
        kernels.multi_tensor_unscale(grads, self._inverse, self._found, self._token)
        flag = self._found
        if self.world_size > 1:
            flag = self.communicator.allreduce(flag, op="max")
        check_host_read("amp's inf/nan check (its verdict skips the step on the host and, "
                        "with use_dynamic_loss_scaling, changes the loss scale there)")
        return int(flag[0]) == self._token

    def update_loss_scaling(self, found_inf):
        """Paddle's ``update_loss_scaling`` rule."""
        if found_inf:
            self.good_steps = 0
            self.bad_steps += 1
            if self.bad_steps == self.decr_every_n_nan_or_inf:
                self._scale = max(self._scale * self.decr_ratio, np.float32(1))
                self.bad_steps = 0
        else:
            self.bad_steps = 0
            self.good_steps += 1
            if self.good_steps == self.incr_every_n_steps:
                with np.errstate(over="ignore"):
                    increased = self._scale * self.incr_ratio
                if np.isfinite(increased):
                    self._scale = increased
                self.good_steps = 0

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self):
        return {"loss_scaling": float(self._scale), "good_steps": self.good_steps,
                "bad_steps": self.bad_steps, "skipped_steps": self.skipped_steps}

    def set_state_dict(self, state):
        missing = sorted(set(_STATE_KEYS) - set(state))
        unexpected = sorted(set(state) - set(_STATE_KEYS))
        if missing or unexpected:
            raise KeyError(f"amp state does not match: missing {missing}, unexpected "
                           f"{unexpected}")
        self._scale = np.float32(state["loss_scaling"])
        self.good_steps = int(state["good_steps"])
        self.bad_steps = int(state["bad_steps"])
        self.skipped_steps = int(state["skipped_steps"])

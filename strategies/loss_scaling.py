"""Dynamic loss scaling: the scale, Paddle's counters and its ``update_loss_scaling`` rule,
and the pass that unscales gradients and checks them for overflow.

One home for the rule, used by the ``amp`` strategy (``strategies.amp``) and by the dygraph
``fleetmpi.amp.GradScaler``, so that the two train alike step for step. The rule, in float32
like Paddle's: after ``decr_every_n_nan_or_inf`` consecutive overflowing steps the scale is
multiplied by ``decr_ratio`` (never below 1), after ``incr_every_n_steps`` consecutive finite
steps by ``incr_ratio`` (kept only while finite), each counter restarting from zero when the
other kind of step comes or the scale changes.

The scale and the counters live in device arrays moved by elementwise operations from the
overflow flag, with no read on the host (``loss_scaling``, ``good_steps``, ``bad_steps`` and
``skipped_steps`` read them when asked), so that a step using them can be captured in a CUDA
graph.

Skipping has an end. Once the scale is at its floor of 1, ``decr_every_n_nan_or_inf`` more
consecutive steps that still overflow raise ``NonFiniteError`` on every rank (the verdict is
agreed, so every rank raises at the same step), naming the step, the scale and how many steps
in a row were skipped: a smaller scale cannot make such gradients finite, so the inf or NaN
comes from the data, the model or the learning rate, and a run that skipped every step would
otherwise end with status 0 having trained nothing. From ``init_loss_scaling`` that is the
``decr_every_n_nan_or_inf * (h + 1)``-th consecutive overflowing step, ``h`` the decreases by
``decr_ratio`` that take it to 1: the 32nd with the defaults (``32768``, ``0.5``, ``2``). A
fixed scale (``use_dynamic_loss_scaling=False``) stops after that many consecutive
overflowing steps too. DeepSpeed likewise raises once its scale is at its minimum
(``raise_error_at_min_scale``); Paddle and PyTorch skip for ever. Inside a CUDA graph capture
the verdict is not read, and nothing is raised (``skipped_steps`` still counts).
"""
import math

import numpy as np

from fleetmpi.autograd.nan_inf import NonFiniteError
from fleetmpi.core import backend, capture_checks
from fleetmpi import kernels

FLOAT32 = np.dtype("float32")
STATE_KEYS = ("loss_scaling", "good_steps", "bad_steps", "skipped_steps")


class LossScaling:
    """The scale (``init_loss_scaling`` at first), Paddle's ``good_steps`` and ``bad_steps``,
    and ``skipped_steps``; ``dynamic`` False keeps the scale fixed."""

    def __init__(self, init_loss_scaling, incr_ratio, decr_ratio, incr_every_n_steps,
                 decr_every_n_nan_or_inf, dynamic=True):
        self.incr_ratio = np.float32(incr_ratio)
        self.decr_ratio = np.float32(decr_ratio)
        self.incr_every_n_steps = int(incr_every_n_steps)
        self.decr_every_n_nan_or_inf = int(decr_every_n_nan_or_inf)
        self.dynamic = bool(dynamic)
        xp = backend.array_module()
        self._scale = xp.full(1, init_loss_scaling, dtype=FLOAT32)
        self._counts = xp.zeros(3, dtype=np.int64)
        self._found = xp.zeros(1, dtype=np.int32)
        # Host counts of the checks read on the host: steps checked, consecutive skipped ones,
        # and how many of those came at the floor (``note``).
        self._checked = self._skipped_run = self._floor_run = 0
        self.stop_after = self.decr_every_n_nan_or_inf * (1 + decreases_to_floor(
            init_loss_scaling, decr_ratio))

    @property
    def scale(self):
        """The scale as a one-element float32 backend array (read on the device)."""
        return self._scale

    @property
    def loss_scaling(self):
        return float(backend.to_numpy(self._scale)[0])

    def _read_count(self, index):
        return int(backend.to_numpy(self._counts)[index])

    good_steps = property(lambda self: self._read_count(0))
    bad_steps = property(lambda self: self._read_count(1))
    skipped_steps = property(lambda self: self._read_count(2))

    def seed(self):
        """The loss gradient's seed: a host number where the scale is host memory (nothing
        waits), else the device scalar itself, as inside a capture (the host stand-in of a
        CUDA graph then seeds as a replay does)."""
        if isinstance(self._scale, np.ndarray) and capture_checks.current is None:
            return float(self._scale[0])
        return self._scale

    def unscale_and_check(self, grads, communicator=None):
        """Divide ``grads`` by the scale in place and check them for inf and NaN in one pass
        (``kernels.multi_tensor_unscale``: one launch per dtype on a GPU); the flag (1 where
        any rank of ``communicator`` found one: one tiny allreduce when it has more than one
        rank), on the device."""
        self._found[...] = 0
        kernels.multi_tensor_unscale(grads, np.float32(1) / self._scale, self._found)
        if communicator is not None and communicator.size > 1:
            return communicator.allreduce(self._found, op="max")
        return self._found

    def count_skipped(self, found):
        """Count a step skipped where ``found`` (a step's overflow flag) is set."""
        self._counts[2:3] += found

    def note(self, skipped, step=None):
        """Count a checked step whose verdict was read on the host (``skipped``), before the
        rule moves the scale; raise ``NonFiniteError`` where skipping ends (module
        docstring). ``step``: the step's number for the message (None: the count of steps
        checked here, from 0)."""
        self._checked += 1
        if not skipped:
            self._skipped_run = self._floor_run = 0
            return
        self._skipped_run += 1
        scale = self.loss_scaling
        self._floor_run = self._floor_run + 1 if scale <= 1 else 0
        if self.dynamic and self._floor_run >= self.decr_every_n_nan_or_inf:
            where = (f"the last {self._floor_run} at a loss scale of {scale:g}, the lowest it "
                     f"goes (the floor of dynamic loss scaling)")
        elif not self.dynamic and self._skipped_run >= self.stop_after:
            where = (f"at the fixed loss scale of {scale:g} (use_dynamic_loss_scaling is "
                     f"False), as many as dynamic scaling from init_loss_scaling skips before "
                     f"it stops at its floor of 1")
        else:
            return
        raise NonFiniteError(
            f"amp: step {self._checked - 1 if step is None else step}: the gradients held an "
            f"inf or NaN on some rank at {self._skipped_run} consecutive steps, {where}; a "
            f"smaller scale cannot make them finite, so the inf or NaN comes from the data, "
            f"the model or the learning rate (FLAGS_check_nan_inf=1 names the first operator "
            f"that makes one). Stopping instead of skipping every step "
            f"(decr_every_n_nan_or_inf={self.decr_every_n_nan_or_inf} overflowing steps at the "
            f"floor end the run)")

    def update_loss_scaling(self, found_inf):
        """Paddle's ``update_loss_scaling`` rule (module docstring) after a step that
        overflowed or not (``found_inf``: a bool, or the step's overflow flag on the device),
        by elementwise operations on the device arrays; nothing when the scale is fixed."""
        if not self.dynamic:
            return
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

    def set_scale(self, value):
        self._scale[...] = backend.asarray(np.full(1, value, dtype=FLOAT32))

    def state_dict(self):
        return {"loss_scaling": self.loss_scaling, "good_steps": self.good_steps,
                "bad_steps": self.bad_steps, "skipped_steps": self.skipped_steps}

    def set_state_dict(self, state, what="amp"):
        """Load ``state_dict``'s keys; a KeyError naming ``what`` and the keys that differ."""
        missing = sorted(set(STATE_KEYS) - set(state))
        unexpected = sorted(set(state) - set(STATE_KEYS))
        if missing or unexpected:
            raise KeyError(f"{what} state does not match: missing {missing}, unexpected "
                           f"{unexpected}")
        self.set_scale(state["loss_scaling"])
        self._counts[...] = backend.asarray(np.array(
            [int(state[key]) for key in STATE_KEYS[1:]], dtype=np.int64))


def decreases_to_floor(scale, ratio):
    """How many decreases by ``ratio`` (in (0, 1)) take ``scale`` to 1, the rule's floor."""
    return max(0, math.ceil(math.log(scale) / -math.log(ratio) - 1e-9))


def check_step(scaling, grads, communicator=None, saved_buffers=(), step=None):
    """After the gradient reduction of a step that updates: unscale ``grads`` and check them
    (``LossScaling.unscale_and_check``), and where any rank of ``communicator`` found an inf or
    NaN zero them and put ``saved_buffers`` (``(buffer, copy)`` pairs: batch-norm statistics
    as the step's forward found them) back, counting the step as skipped. Returns ``(found,
    skipped)``: the device flag, and outside a CUDA graph capture whether the step is
    skipped, read on the host once (None inside a capture, where the flag stays on the device
    and the selects of ``kernels.where_found`` do the resets). Raises ``NonFiniteError``
    where ``LossScaling.note`` says skipping has ended (``step`` names the step)."""
    found = scaling.unscale_and_check(grads, communicator)
    outside = capture_checks.current is None
    verdict = backend.to_numpy(found) if outside else found
    saved = list(saved_buffers)
    kernels.where_found(verdict, list(grads) + [buffer for buffer, _ in saved],
                        [grad.dtype.type(0) for grad in grads] + [copy for _, copy in saved])
    scaling.count_skipped(found)
    if not outside:
        return found, None
    skipped = bool(int(verdict[0]))
    scaling.note(skipped, step)
    return found, skipped

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
"""
import numpy as np

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


def check_step(scaling, grads, communicator=None, saved_buffers=()):
    """After the gradient reduction of a step that updates: unscale ``grads`` and check them
    (``LossScaling.unscale_and_check``), and where any rank of ``communicator`` found an inf or
    NaN zero them and put ``saved_buffers`` (``(buffer, copy)`` pairs: batch-norm statistics
    as the step's forward found them) back, counting the step as skipped. Returns ``(found,
    skipped)``: the device flag, and outside a CUDA graph capture whether the step is
    skipped, read on the host once (None inside a capture, where the flag stays on the device
    and the selects of ``kernels.where_found`` do the resets)."""
    found = scaling.unscale_and_check(grads, communicator)
    outside = capture_checks.current is None
    verdict = backend.to_numpy(found) if outside else found
    saved = list(saved_buffers)
    kernels.where_found(verdict, list(grads) + [buffer for buffer, _ in saved],
                        [grad.dtype.type(0) for grad in grads] + [copy for _, copy in saved])
    scaling.count_skipped(found)
    return found, (bool(int(verdict[0])) if outside else None)

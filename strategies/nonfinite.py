"""The check that no step trains on an inf or NaN (``FLEETMPI_NONFINITE``: stop, skip, off).

It runs in every step of ``distributed_optimizer`` that amp's loss scaling, or a
``GradScaler``'s, does not check already (they skip an overflowing step themselves). Each rank checks its own loss (in the backward
stage, before any gradient travels) and its own gradients before they travel: the gradient
reduction calls ``check_bucket`` on each bucket just before reducing it (one read of the
bucket, ``kernels.multi_tensor_check_finite``, amp's overflow check without the unscale), and
where the gradients do not go through that reduction this step (one process, gradient_merge's
steps between updates, localsgd's local steps, dgc's compressed steps, sharding's reduction)
the check reads the flat gradients itself before the reduction stage. This rank's verdict
(bit 1: a gradient, bit 2: the loss) stays on the device and is kept until the next update,
so a gradient_merge window is covered whole.

On a step whose gradients the reduction averages whole, the reduction itself carries the
verdicts: a rank whose bucket holds an inf or NaN writes a NaN into the bucket's last
element before it travels, and a rank whose verdict is set by then for any reason (its loss,
an earlier step of the window) does the same to the plan's last bucket. A sum of values of
which one is NaN is NaN on every rank, and an inf stays an inf or becomes a NaN, so after the
reduction every rank reads the same answer from the buckets' last elements (one small read,
``carried``), with no communication of its own; a finite run writes nothing. Only where one is
set (every rank alike) do the ranks exchange their verdicts, to name the culprits: each writes
its own into its slot of a vector of one int32 per rank, and one tiny allreduce (max) gives
every rank every rank's verdict. Where the gradients were not reduced whole (sharding's
reduce-scatter, the steps of a strategy that exchanges something else) that exchange runs on
every update (4 bytes per rank, as amp's flag). On localsgd's local steps, where each rank's
update is its own, each rank decides on its verdict alone and sends nothing.

Outside a CUDA graph capture the answer is read on the host once per update (free on the
CPU, where the flags are host memory and the check branches on them instead of selecting).
Where a rank's verdict was set, ``stop`` raises ``NonFiniteError`` on every rank that
decided, naming the ranks, what was not finite, the step and the first parameter whose
gradient here holds an inf or NaN (with its gradient bucket), and the job ends through the
failure path of an uncaught exception; ``skip`` zeroes the gradients, puts the layers'
buffers back as the step's first forward found them (batch-norm statistics), updates
nothing, and rank 0 logs a warning. Inside a capture nothing is read: in both modes the step
is skipped on the device as amp's is (``kernels.where_found``, the update launched with
``ctx.found_inf``), buffers put back under ``skip`` only, and ``skipped_steps`` counts it;
the check is then the device flag alone.
"""
import numpy as np

from fleetmpi.core import backend, capture_checks
from fleetmpi import kernels
from fleetmpi.autograd import NonFiniteError, as_array
from fleetmpi.core.knobs import NONFINITE
from fleetmpi.core.log import logger
from fleetmpi.optimizer import StepHook

GRADIENT, LOSS = 1, 2


def nonfinite_mode():
    """``stop``, ``skip`` or ``off`` (``FLEETMPI_NONFINITE``)."""
    return NONFINITE.value()


def describe(verdicts, step, first, agreed):
    """``step 7: rank 1 (loss and local gradient) held an inf or NaN; ...``: what a step
    whose ``verdicts`` (one int per rank; only this rank's where the ranks did not agree,
    ``agreed`` False) hold a set bit found; ``first``: what names the first parameter
    affected, or None. No bit set: the reduced gradient alone held one (a sum beyond the
    range of the format on the wire)."""
    culprits = []
    for rank, verdict in enumerate(verdicts):
        what = [name for flag, name in ((LOSS, "loss"), (GRADIENT, "local gradient"))
                if verdict & flag]
        if what:
            culprits.append(f"rank {rank} ({' and '.join(what)})")
    where = (f"; the first parameter of the gradient buffer whose gradient holds one after the "
             f"reduction is {first}" if first else "")
    alone = "" if agreed else " (an update of this rank alone: no verdict exchanged)"
    if not culprits:
        return f"step {step}: the reduced gradient held an inf or NaN, no rank's own did{where}"
    return f"step {step}{alone}: {', '.join(culprits)} held an inf or NaN{where}"


class NonFiniteCheck(StepHook):
    """The check of the module docstring, for ``optimizer`` with ``mode`` ``stop`` or
    ``skip``. ``communicator``: the ranks that agree on the verdict (None alone);
    ``local_steps_alone``: whether a step whose gradients are not synchronised is each rank's
    own (localsgd); ``buckets``: the gradient reduction's buckets, when it calls
    ``check_bucket`` on each (``compose.with_nonfinite_check``), and ``carries``: whether that
    reduction runs over the same ranks as ``communicator``, so that it can carry the verdicts
    (not under pipeline, whose replicas of a stage reduce apart); ``bucket_of(parameter)``: the
    gradient bucket of a parameter, or None. Observable: ``skipped_steps``, ``verdict_bytes``
    (one exchange of the verdicts), ``exchanged_bytes`` (all of them so far)."""

    name = "nonfinite_check"

    def __init__(self, mode, optimizer, communicator, local_steps_alone=False):
        if mode not in ("stop", "skip"):
            raise ValueError(f"the non-finite check's mode must be stop or skip, not {mode!r}")
        self.mode = mode
        self.optimizer = optimizer
        self.communicator = communicator
        self.local_steps_alone = local_steps_alone
        self.bucket_of = None
        self.buckets = None
        self.carries = False
        self.exchanged_bytes = 0
        self._agreed = False
        self._carried_found = False
        self._saved_buffers = None
        xp = backend.array_module()
        size = 1 if communicator is None else communicator.size
        self.rank = 0 if communicator is None else communicator.rank
        self.local = xp.zeros(1, dtype=np.int32)
        self._found = xp.zeros(1, dtype=np.int32)
        self._verdicts = xp.zeros(size, dtype=np.int32)
        self._skipped = xp.zeros(1, dtype=np.int64)

    @property
    def verdict_bytes(self):
        """What one exchange of the verdicts hands to the allreduce: one int32 per rank."""
        return int(self._verdicts.nbytes)

    @property
    def skipped_steps(self):
        return int(backend.to_numpy(self._skipped)[0])

    def check_local(self, grads):
        """OR into this rank's verdict whether ``grads`` (this rank's own, before they
        travel) hold an inf or NaN; no read on the host."""
        kernels.multi_tensor_check_finite(grads, self.local)

    def check_bucket(self, bucket):
        """``bucket`` of ``buckets`` is about to be reduced: check it as ``check_local`` does,
        and where the reduction ``carries`` the verdicts, write a NaN into its last element
        where it holds an inf or NaN, or, for the plan's last bucket, where this rank's verdict
        is set by then (module docstring). Host arrays are branched on (``_on_host``); on a
        device, a select, nothing read on the host."""
        grad = bucket.grad
        last = bucket.index == len(self.buckets) - 1
        if self._on_host():
            if not kernels.reference.all_finite(grad):
                self.local[0] |= GRADIENT
                found = True
            else:
                found = last and bool(self.local[0])
            if found and self.carries:
                grad[-1:] = np.nan
            return
        found = self._found
        found[...] = 0
        kernels.multi_tensor_check_finite([grad], found)
        self.local |= found
        if not self.carries:
            return
        if last:
            found = self.local
        kernels.where_found(found, [grad[-1:]], [grad.dtype.type(np.nan)])

    def _on_host(self):
        """Whether the verdicts are host memory read by a branch (``kernels.reads_flag``):
        a NumPy flag outside a CUDA graph capture. A few Python operations then do what a
        select does on a device, which matters where a step costs milliseconds."""
        return kernels.reads_flag(self.local)

    # -- step stages ------------------------------------------------------------------------
    def forward(self, ctx, proceed):
        if self.mode == "skip" and self._saved_buffers is None and ctx.model is not None:
            self._saved_buffers = [(b, b.copy()) for _, b in ctx.model.named_buffers()]
        return proceed(ctx)

    def backward(self, ctx, proceed):
        if ctx.loss is None:
            return proceed(ctx)
        loss = as_array(ctx.loss)
        if self._on_host():
            if not np.isfinite(loss).all():
                self.local[0] |= LOSS
        else:
            xp = backend.array_module()
            self.local |= xp.where(xp.isfinite(loss).all(), 0, LOSS).astype(np.int32)
        return proceed(ctx)

    def reduce(self, ctx, proceed):
        if ctx.overflow_checked:
            # A loss scaler skips an overflowing step itself (StepContext.overflow_checked).
            result = proceed(ctx)
            self.local[...] = 0
            self._saved_buffers = None
            return result
        checked = self.buckets is not None and ctx.sync_gradients
        if not checked:
            self.check_local([grad for _, grad in self.optimizer.flat_runs()])
        result = proceed(ctx)
        if ctx.apply_update:
            self._decide(ctx, self._agree(ctx, checked and self.carries))
        return result

    def _carried(self):
        """Whether a reduced bucket's last element is not finite (the same on every rank): a
        bool on the host (``_on_host``), else a one-element int32 flag on the device."""
        if self._on_host():
            return not all(np.isfinite(bucket.grad[-1:]).all() for bucket in self.buckets)
        found = self._found
        found[...] = 0
        kernels.multi_tensor_check_finite([bucket.grad[-1:] for bucket in self.buckets], found)
        return found

    def _agree(self, ctx, carried):
        """Every rank's verdict (this rank's alone on a local step), on the device; after a
        reduction that carried the verdicts, their one-element answer inside a capture; None
        where none is set (read on the host: the carried answer, or this rank's own verdict
        where it decides alone). This rank's own is cleared for the next update."""
        exchange = self.communicator is not None and self.communicator.size > 1 and (
            ctx.sync_gradients or not self.local_steps_alone)
        if not exchange and self._on_host() and not self.local[0]:
            return None
        found = self._carried() if carried else None
        if found is not None:
            if capture_checks.current is not None:
                self.local[...] = 0
                return found
            if not (found if isinstance(found, bool) else backend.to_numpy(found)[0]):
                self.local[...] = 0
                return None
        self._verdicts[...] = 0
        self._verdicts[self.rank:self.rank + 1] = self.local
        self.local[...] = 0
        self._agreed = exchange
        if exchange:
            self.communicator.allreduce(self._verdicts, op="max", out=self._verdicts)
            self.exchanged_bytes += self.verdict_bytes
        self._carried_found = found is not None
        return self._verdicts

    def _decide(self, ctx, verdicts):
        saved, self._saved_buffers = self._saved_buffers or (), None
        if verdicts is None:
            return
        grads = [grad for _, grad in self.optimizer.flat_runs()]
        if capture_checks.current is not None:
            found = (verdicts.max(keepdims=True) != 0).astype(np.int32)
            kernels.where_found(found, grads + [b for b, _ in saved],
                                [g.dtype.type(0) for g in grads] + [s for _, s in saved])
            self._skipped += found
            ctx.found_inf = found if ctx.found_inf is None else ctx.found_inf | found
            return
        host = backend.to_numpy(verdicts)
        if not (host.any() or self._carried_found):
            return
        first = self._first_affected() if (host & GRADIENT).any() else None
        message = describe(host.tolist(), ctx.step, first, self._agreed)
        if self.mode == "stop":
            raise NonFiniteError(f"non-finite values at {message}. FLEETMPI_NONFINITE=skip "
                                 "skips such steps instead of stopping; FLAGS_check_nan_inf=1 "
                                 "names the operation that produced the first")
        for grad in grads:
            grad[...] = 0
        for buffer, copy in saved:
            buffer[...] = copy
        self._skipped += 1
        ctx.apply_update = False
        if self.rank == 0:
            logger.warning("FLEETMPI_NONFINITE=skip: skipped %s", message)

    def _first_affected(self):
        """``"fc1.weight" (gradient bucket 2)``: the first parameter whose gradient holds an
        inf or NaN now, or None (a gradient held in a shard, which whole parameters do not map
        onto). Called only where some rank's own gradient held one: a NaN written for a loss
        alone sits in the last element of the plan's last bucket, after every other."""
        if self.optimizer.shard_gradient is not None:
            return None
        for run in self.optimizer.runs:
            for p in run.parameters:
                if not bool(np.isfinite(backend.to_numpy(run.view(run.grad, p))).all()):
                    bucket = self.bucket_of(p) if self.bucket_of else None
                    where = "" if bucket is None else f" (gradient bucket {bucket.index})"
                    return f'"{p.name}"{where}'
        return None

    def state_dict(self):
        return {}

    def set_state_dict(self, state):
        if state:
            raise KeyError(f"the non-finite check keeps no state, got keys {sorted(state)}")

"""``dgc``: Deep Gradient Compression (Lin et al., ICLR 2018), Paddle's DGCMomentumOptimizer.

Steps count optimizer updates (steps whose ``ctx.apply_update`` is on). Before
``rampup_begin_step`` updates the step is plain data-parallel Momentum: the dense gradient
allreduce, then the optimizer's update. From then on the dense allreduce is off, and on every
update each rank, for each parameter tensor, with its own momentum ``u`` and residual ``v``:

1. clips its gradient to ``clip_norm / sqrt(N)`` when the optimizer has a ``ClipGradByNorm``
   (local gradient clipping: N independent gradients of that norm sum to about ``clip_norm``),
   then adds the weight decay, ``g += weight_decay * p``;
2. momentum correction: ``u = m * u + g``, and residual accumulation: ``v += u``
   (Nesterov, as Paddle's dgc op: ``u = m * (u + g)``, ``v += u + g``);
3. selects the ``k = max(1, ceil(numel * (1 - sparsity)))`` entries of largest ``|v|``, sends
   their (int32 index, value) pairs and sets ``v`` there to 0;
4. momentum factor masking (below) on ``u``.

All tensors' pairs travel in one allgather per step (the sizes are equal on every rank, as
``k`` depends only on ``numel`` and the step); each rank adds every rank's pairs, in rank order,
into a dense gradient, divides by N, leaves it in the gradient buffer and updates
``p -= lr * G``: the momentum is already inside ``G``. The optimizer's own ``grad_clip`` is not
applied again to ``G``.

``sparsity`` follows ``rampup_step`` as in Paddle: ``t = update - rampup_begin_step`` uses
``sparsity[min(t * len(sparsity) // rampup_step, len(sparsity) - 1)]``, so ``[0.75, 0.9375,
0.984375, 0.996, 0.999]`` with ``rampup_step=100`` keeps 25% for t in 0..19, 6.25% for 20..39,
and so on, and 0.1% from t = 80 on.

Momentum factor masking, as done here: the paper zeroes ``u`` at every coordinate sent, to stop
the momentum of gradients that were delayed in ``v`` from pushing on after they have been
applied. Zeroing it where nothing was delayed would also cut the momentum of gradients sent
on time; at ``sparsity [0]`` (everything sent every step) that turns DGC into plain SGD. So
``u`` is zeroed only at the sent coordinates whose residual held delayed values from earlier
steps (``v`` was nonzero there before this step's ``u`` was added). Nothing is ever delayed at
``sparsity [0]``, and DGC there is exactly data-parallel Momentum (``mean(u)`` over the ranks
follows the Momentum velocity, since the update is linear). At the first compressed update
``u`` starts from the Momentum optimizer's velocity (``momentum * velocity`` with Nesterov), so
the switch from the dense steps is seamless.

``bytes_sent_last_step`` is what this rank's exchange of the last update carries (the packed
pairs, or the dense gradient before compression starts; on N ranks what the communicator's
``payload_bytes`` counts); ``dense_bytes`` is what a dense allreduce hands over.
"""
import math

import numpy as np

from fleetmpi.core import backend
from fleetmpi import kernels
from fleetmpi.kernels import reference
from fleetmpi.optimizer import ClipGradByNorm, Momentum
from .base import Strategy
from .configs import DGCConfig

INDEX_DTYPE = np.int32


def sparsity_at(update, rampup_begin_step, rampup_step, sparsity):
    """The sparsity of update ``update`` (0-based), or None before ``rampup_begin_step``."""
    if update < rampup_begin_step:
        return None
    period = (update - rampup_begin_step) * len(sparsity) // rampup_step
    return sparsity[min(period, len(sparsity) - 1)]


def keep_count(numel, sparsity):
    """``max(1, ceil(numel * (1 - sparsity)))``; a rounding error of the float product (1000 *
    (1 - 0.999) is 1.0000000000000009) does not add an element."""
    return max(1, math.ceil(numel * (1.0 - sparsity) * (1 - 1e-12)))


def top_k(values, k):
    """Indices (int32) of the ``k`` entries of largest magnitude of the 1-d ``values``."""
    xp = backend.array_module()
    n = values.size
    return xp.argpartition(xp.abs(values), n - k)[n - k:].astype(INDEX_DTYPE)


class DGC(Strategy):
    """Deep Gradient Compression; observable: ``updates`` (optimizer updates so far),
    ``current_sparsity`` (of the last update, None while dense), ``bytes_sent_last_step``,
    ``dense_bytes``."""

    name = "dgc"
    config_class = DGCConfig
    optimizers = (Momentum,)
    capture_refusal = ("its rampup (dense, then ever sparser exchanges) is decided on the host "
                       "from the update count, and a graph would replay the exchange it "
                       "captured")

    @classmethod
    def check(cls, strategy, optimizer):
        super().check(strategy, optimizer)
        clip = optimizer.grad_clip
        if clip is not None and not isinstance(clip, ClipGradByNorm):
            raise ValueError(f"strategy dgc clips each gradient tensor on each rank before "
                             f"compressing, so it works with grad_clip=None or ClipGradByNorm, "
                             f"not {clip!r}")
        too_big = [p.name for p in optimizer.parameters()
                   if p.size > np.iinfo(INDEX_DTYPE).max]
        if too_big:
            raise ValueError(f"strategy dgc sends int32 indices; parameter(s) {too_big} have "
                             f"more than {np.iinfo(INDEX_DTYPE).max} elements")

    def __init__(self, strategy, optimizer, communicator):
        super().__init__(strategy, optimizer, communicator)
        self.rampup_begin_step = self.config.rampup_begin_step
        self.rampup_step = self.config.rampup_step
        self.sparsity = list(self.config.sparsity)
        xp = backend.array_module()
        self._runs = optimizer.runs
        self._u = [xp.zeros(run.stop - run.start, dtype=run.buffer.dtype) for run in self._runs]
        self._v = [xp.zeros_like(u) for u in self._u]
        self.updates = 0
        self.current_sparsity = None
        self.dense_bytes = sum((run.stop - run.start) * run.buffer.dtype.itemsize
                               for run in self._runs)
        self.bytes_sent_last_step = 0
        self._compress = False
        self._offsets = {}

    def sparsity_at(self, update):
        """The sparsity of update ``update``, or None while the exchange is dense."""
        return sparsity_at(update, self.rampup_begin_step, self.rampup_step, self.sparsity)

    # -- step stages ------------------------------------------------------------------------
    def forward(self, ctx, proceed):
        self._compress = bool(ctx.apply_update) and self.updates >= self.rampup_begin_step
        if self._compress:
            ctx.sync_gradients = False
        return proceed(ctx)

    def reduce(self, ctx, proceed):
        result = proceed(ctx)
        if not ctx.apply_update:
            self._compress = False
            return result
        self.current_sparsity = self.sparsity_at(self.updates)
        if self._compress:
            if self.updates == self.rampup_begin_step:
                self._start_from_velocity()
            self._exchange(self.current_sparsity)
        else:
            self.bytes_sent_last_step = self.dense_bytes
        self.updates += 1
        return result

    def update(self, ctx, proceed):
        if not (ctx.apply_update and self._compress):
            return proceed(ctx)
        opt = self.optimizer
        lr = opt.get_lr()
        if opt.fuse_all_optimizer_ops:
            kernels.multi_tensor_sgd_update([run.data for run in self._runs],
                                            [run.grad for run in self._runs], lr, 0.0)
        else:
            for run in self._runs:
                for p in run.parameters:
                    reference.sgd_update(p.data, p.grad.data, lr, 0.0)
        opt.step_count += 1
        return None

    # -- compression ------------------------------------------------------------------------
    def _start_from_velocity(self):
        opt = self.optimizer
        scale = opt.momentum if opt.use_nesterov else 1.0
        for u, v, state in zip(self._u, self._v, opt.run_states):
            u[...] = scale * state["velocity"]
            v[...] = 0

    def _local_clip(self):
        clip = self.optimizer.grad_clip
        return None if clip is None else ClipGradByNorm(clip.clip_norm
                                                        / math.sqrt(self.world_size))

    def _select(self, run, u, v, sparsity, clip):
        """Steps 1-4 for every tensor of ``run``: returns the sent (values, indices) of the
        run, concatenated, and the ``k`` of each tensor."""
        xp = backend.array_module()
        opt = self.optimizer
        m = opt.momentum
        grads = [p.grad.data.reshape(-1) for p in run.parameters]
        if clip is not None:
            grads = clip(grads)
        values, indices, ks = [], [], []
        for p, g in zip(run.parameters, grads):
            if opt.weight_decay:
                g = g + opt.weight_decay * p.data.reshape(-1)
            begin = p.offset - run.start
            u_p, v_p = u[begin:begin + p.size], v[begin:begin + p.size]
            delayed = v_p != 0
            if opt.use_nesterov:
                u_p += g
                u_p *= m
                v_p += u_p + g
            else:
                u_p *= m
                u_p += g
                v_p += u_p
            k = keep_count(p.size, sparsity)
            idx = top_k(v_p, k)
            values.append(v_p[idx])
            indices.append(idx)
            ks.append(k)
            v_p[idx] = 0
            u_p[idx[delayed[idx]]] = 0
        return xp.concatenate(values), xp.concatenate(indices), ks

    def _run_offsets(self, run, ks):
        """Each sent pair's position in the run's flat buffer is its index plus this: the
        offset of its tensor in the run (cached per sparsity, as ``ks`` depend only on it)."""
        key = (id(run), tuple(ks))
        if key not in self._offsets:
            starts = [p.offset - run.start for p in run.parameters]
            self._offsets[key] = backend.asarray(np.repeat(np.asarray(starts, np.int64), ks))
        return self._offsets[key]

    def _exchange(self, sparsity):
        """Compress, allgather, and leave the averaged dense gradient in the gradient buffer."""
        xp = backend.array_module()
        clip = self._local_clip()
        selected = [self._select(run, u, v, sparsity, clip)
                    for run, u, v in zip(self._runs, self._u, self._v)]
        payload = xp.concatenate([a.view(xp.uint8) for values, indices, _ in selected
                                  for a in (values, indices)])
        self.bytes_sent_last_step = int(payload.nbytes)
        gathered = (payload[None] if self.communicator is None
                    else self.communicator.allgather(payload, stack=True))
        size = gathered.shape[0]
        start = 0
        for run, (values, indices, ks) in zip(self._runs, selected):
            stop = start + values.nbytes
            all_values = gathered[:, start:stop].copy().view(values.dtype)
            start, stop = stop, stop + indices.nbytes
            all_indices = gathered[:, start:stop].copy().view(INDEX_DTYPE)
            start = stop
            positions = all_indices + self._run_offsets(run, ks)
            grad = run.grad
            grad[...] = 0
            for rank in range(size):  # a rank's indices are distinct: no add is lost
                grad[positions[rank]] += all_values[rank]
            grad /= size

    # -- state ------------------------------------------------------------------------------
    def state_dict(self):
        state = {"updates": self.updates}
        for index, (u, v) in enumerate(zip(self._u, self._v)):
            state[f"u.{index}"] = backend.to_numpy(u).copy()
            state[f"v.{index}"] = backend.to_numpy(v).copy()
        return state

    def set_state_dict(self, state):
        for index, (u, v) in enumerate(zip(self._u, self._v)):
            for key, flat in ((f"u.{index}", u), (f"v.{index}", v)):
                if key not in state:
                    raise KeyError(f"strategy dgc state has no {key!r}; it was saved without "
                                   "dgc or for a different model")
                value = state[key] if hasattr(state[key], "shape") else np.asarray(state[key])
                if value.shape != flat.shape:
                    raise ValueError(f"strategy dgc state {key!r} has shape {value.shape}, "
                                     f"expected {flat.shape}")
                flat[...] = backend.asarray(value)
        self.updates = int(state["updates"])

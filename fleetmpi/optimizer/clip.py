"""Gradient clipping, Paddle's ``grad_clip`` argument of the optimizers.

``ClipGradByNorm(clip_norm)`` scales each gradient tensor on its own to an L2 norm of at most
``clip_norm``; ``ClipGradByGlobalNorm(clip_norm)`` scales all gradients by one factor so that
their joint L2 norm is at most ``clip_norm``. The optimizer applies the clip to the gradients
it is handed, before weight decay and its update; the gradient buffers are left as they are.
"""
import numbers

import numpy as np

from ..core import backend


def _squared_norm(grad):
    flat = grad.reshape(-1)
    return (flat * flat).sum()


class ClipGradBase:
    """A clip: ``scales(grads)`` gives the factor each gradient tensor is multiplied by."""

    def __init__(self, clip_norm):
        if isinstance(clip_norm, bool) or not isinstance(clip_norm, numbers.Real) \
                or not 0 < clip_norm < np.inf:
            raise ValueError(f"clip_norm must be a positive finite number, not {clip_norm!r}")
        self.clip_norm = float(clip_norm)

    def _factor(self, norm):
        # clip_norm / clip_norm is exactly 1, so gradients inside the bound stay bit for bit.
        xp = backend.array_module()
        return self.clip_norm / xp.maximum(norm, self.clip_norm)

    def scales(self, grads):
        """One factor (a 0-d backend array) per tensor of ``grads``."""
        return self.scales_from_squared_norms([_squared_norm(g) for g in grads])

    def scales_from_squared_norms(self, squared_norms):
        """One factor per tensor, from the squared L2 norm of each (summed over the shards
        when a tensor's gradient is split between ranks)."""
        raise NotImplementedError

    def __call__(self, grads):
        """New arrays: ``grads`` clipped."""
        return [g * s for g, s in zip(grads, self.scales(grads))]

    def __repr__(self):
        return f"{type(self).__name__}(clip_norm={self.clip_norm!r})"


class ClipGradByNorm(ClipGradBase):
    """Each gradient tensor ``g`` becomes ``g * clip_norm / max(||g||, clip_norm)``."""

    def scales_from_squared_norms(self, squared_norms):
        xp = backend.array_module()
        return [self._factor(xp.sqrt(s)) for s in squared_norms]


class ClipGradByGlobalNorm(ClipGradBase):
    """Every gradient tensor is multiplied by ``clip_norm / max(global_norm, clip_norm)``, where
    ``global_norm`` is the L2 norm of all gradients together."""

    def scales_from_squared_norms(self, squared_norms):
        xp = backend.array_module()
        factor = self._factor(xp.sqrt(sum(squared_norms)))
        return [factor] * len(squared_norms)


def check_grad_clip(grad_clip):
    """``grad_clip`` if it is None or a clip, else a ValueError naming what is allowed."""
    if grad_clip is not None and not isinstance(grad_clip, ClipGradBase):
        raise ValueError(f"grad_clip must be None, fleetmpi.optimizer.ClipGradByNorm or "
                         f"ClipGradByGlobalNorm, not {grad_clip!r}")
    return grad_clip

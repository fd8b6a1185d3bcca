"""``lars`` and ``lamb``: layer-wise adaptive update rules in place of the wrapped optimizer's.

Both scale each parameter tensor's step by a ratio of norms of that tensor alone, so a layer
whose weights are large next to its gradients takes proportionally larger steps, which is what
lets very large batches train at large learning rates. They run in the update stage, after the
gradient allreduce, on the averaged gradients, so every rank computes the same norms and the
same update without communicating anything more.

Each keeps its state in the wrapped optimizer's own arrays (Momentum's ``velocity``, Adam's
``moment1``/``moment2``) and advances its ``step_count``, so the optimizer's ``state_dict``
checkpoints a LARS or LAMB run as it does a plain one. The learning rate is the optimizer's
``get_lr()`` at each step, so learning-rate schedulers work unchanged, and the gradients are the
optimizer's ``clipped_grads()``: its ``grad_clip`` applies before the norms are taken, as
Paddle's lars and lamb meta-optimizers hand the inner optimizer's clip on.
``fuse_all_optimizer_ops`` does not apply: the norms are per parameter tensor, so the update
walks the parameters one by one as the unfused optimizers do.

``exclude_from_weight_decay`` (Paddle's meaning): a parameter whose dotted name
(``"fc0.bias"``) contains any of the listed strings gets weight decay 0; its norms, and so its
adaptive scaling, still apply.

The wrapped optimizer's own ``weight_decay`` must be 0 (None): lars and lamb decay the weights
inside their update, where ``exclude_from_weight_decay`` and the norms see the decay. A second
decay from the optimizer (L2 added to the gradient, or AdamW's decoupled shrink) would act
outside the trust ratio and on the excluded parameters too, which is neither published rule.
"""
from fleetmpi.core import backend
from fleetmpi.core.log import logger
from fleetmpi.optimizer import Adam, Momentum, graph_guard
from .base import Strategy
from .configs import LambConfig, LarsConfig


def _norm(xp, array):
    """The L2 norm of ``array`` as a 0-d array on the device (no host round trip)."""
    return xp.sqrt(xp.sum(array * array))


class _LayerwiseUpdate(Strategy):
    """What LARS and LAMB share: the per-parameter weight decay, the refusal of a second weight
    decay from the optimizer, and the walk over the parameters in the update stage."""

    decay_key = None

    def __init__(self, strategy, optimizer, communicator):
        super().__init__(strategy, optimizer, communicator)
        self.weight_decay = getattr(self.config, self.decay_key)
        self.exclude_from_weight_decay = self.config.exclude_from_weight_decay
        names = [p.name or "" for p in optimizer.parameters()]
        self.excluded_parameters = [name for name in names if self._excluded(name)]
        for pattern in self.exclude_from_weight_decay:
            if not any(pattern in name for name in names):
                logger.warning("%s_configs['exclude_from_weight_decay'] entry %r matches no "
                               "parameter name (the names are %s)", self.name, pattern,
                               ", ".join(names))

    def _excluded(self, name):
        return any(pattern in name for pattern in self.exclude_from_weight_decay)

    def decay_of(self, parameter):
        """The weight decay of ``parameter``: 0 when its name contains an excluded string."""
        return 0.0 if self._excluded(parameter.name or "") else self.weight_decay

    @classmethod
    def check(cls, strategy, optimizer):
        super().check(strategy, optimizer)
        if optimizer.weight_decay:
            raise ValueError(
                f"strategy {cls.name} decays the weights itself ({cls.name}_configs"
                f"['{cls.decay_key}'], with exclude_from_weight_decay), so the "
                f"{type(optimizer).__name__} optimizer's weight_decay must be None or 0, not "
                f"{optimizer.weight_decay!r}: it would decay every parameter a second time, "
                f"outside the {cls.name} scaling; put the decay into {cls.name}_configs"
                f"['{cls.decay_key}'] instead")

    def update(self, ctx, proceed):
        """Replaces the optimizer's update: the inner update stage (the plain step) never
        runs. Nothing happens on a step whose ``apply_update`` is off."""
        if not ctx.apply_update:
            return None
        optimizer = self.optimizer
        optimizer.step_count += 1
        lr = optimizer.get_lr()
        graph_guard.enter_update(optimizer, lr)
        xp = backend.array_module()
        for run, grad, state in zip(optimizer.runs, optimizer.clipped_grads(),
                                    optimizer.run_states):
            for p in run.parameters:
                views = {name: run.view(flat, p) for name, flat in state.items()}
                self._update_parameter(p.data, run.view(grad, p), views, lr, self.decay_of(p),
                                       xp)
        return None

    def _update_parameter(self, param, grad, state, lr, weight_decay, xp):
        """Update ``param`` and its ``state`` views in place from ``grad``."""
        raise NotImplementedError


class LARS(_LayerwiseUpdate):
    """LARS (You, Gitman, Ginsburg 2017, "Large Batch Training of Convolutional Networks") as
    Paddle's ``lars_momentum`` op computes it, for each parameter tensor ``w`` with gradient
    ``g``, momentum ``mu`` from the Momentum optimizer and ``wd`` its lars_weight_decay (0 when
    excluded)::

        local_lr = lr * lars_coeff * ||w|| / (||g|| + wd * ||w|| + epsilon)
                   if ||w|| > 0 and ||g|| > 0, else lr
        v = mu * v + local_lr * (g + wd * w)
        w = w - v

    A zero norm (a parameter initialised to zero, a layer that got no gradient) falls back to
    the plain learning rate instead of dividing by zero. The local rate applies to excluded
    parameters too, as in the paper and Paddle's GPU kernel (its CPU kernel skips it where the
    weight decay is 0). The velocity holds learning-rate scaled steps, as in
    ``lars_momentum``, unlike the plain Momentum's ``v = mu * v + g``.
    """

    name = "lars"
    optimizers = (Momentum,)
    decay_key = "lars_weight_decay"
    config_class = LarsConfig

    def __init__(self, strategy, optimizer, communicator):
        super().__init__(strategy, optimizer, communicator)
        self.lars_coeff = self.config.lars_coeff
        self.epsilon = self.config.epsilon

    @classmethod
    def check(cls, strategy, optimizer):
        super().check(strategy, optimizer)
        if optimizer.use_nesterov:
            raise ValueError("strategy lars needs a Momentum optimizer with use_nesterov=False: "
                             "the LARS update (Paddle's lars_momentum) has no Nesterov form")

    def _update_parameter(self, param, grad, state, lr, weight_decay, xp):
        param_norm = _norm(xp, param)
        grad_norm = _norm(xp, grad)
        adapt = (param_norm > 0) & (grad_norm > 0)
        denominator = grad_norm + weight_decay * param_norm + self.epsilon
        local_lr = xp.where(adapt, lr * self.lars_coeff * param_norm
                            / xp.where(adapt, denominator, 1), lr)
        velocity = state["velocity"]
        step = grad + weight_decay * param if weight_decay else grad
        velocity *= self.optimizer.momentum
        velocity += local_lr * step
        param -= velocity


class LAMB(_LayerwiseUpdate):
    """LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76
    minutes", Algorithm 2 with the identity scaling function) as Paddle's ``lamb`` op computes
    it, for each parameter tensor ``w`` with gradient ``g`` at step ``t`` (from 1), ``beta1``,
    ``beta2``, ``epsilon`` from the Adam optimizer and ``wd`` its lamb_weight_decay (0 when
    excluded)::

        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        r = (m / (1 - beta1 ** t)) / (sqrt(v / (1 - beta2 ** t)) + epsilon) + wd * w
        trust = ||w|| / ||r||  if ||w|| > 0 and ||r|| > 0, else 1
        w = w - lr * trust * r

    The trust ratio applies to every parameter, excluded ones too, as in the paper (Paddle's
    ``always_adapt=True``; Paddle's default skips it where the weight decay is 0).
    """

    name = "lamb"
    optimizers = (Adam,)
    capture_refusal = ("its bias correction takes step_count from the host, which a graph "
                       "would keep at its captured value")
    decay_key = "lamb_weight_decay"
    config_class = LambConfig

    def _update_parameter(self, param, grad, state, lr, weight_decay, xp):
        optimizer = self.optimizer
        beta1, beta2, t = optimizer.beta1, optimizer.beta2, optimizer.step_count
        moment1, moment2 = state["moment1"], state["moment2"]
        moment1 *= beta1
        moment1 += (1 - beta1) * grad
        moment2 *= beta2
        moment2 += (1 - beta2) * (grad * grad)
        direction = ((moment1 / (1 - beta1 ** t))
                     / (xp.sqrt(moment2 / (1 - beta2 ** t)) + optimizer.epsilon))
        if weight_decay:
            direction += weight_decay * param
        param_norm = _norm(xp, param)
        direction_norm = _norm(xp, direction)
        adapt = (param_norm > 0) & (direction_norm > 0)
        trust = xp.where(adapt, param_norm / xp.where(adapt, direction_norm, 1), 1)
        param -= (lr * trust) * direction

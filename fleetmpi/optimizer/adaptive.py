"""``RMSProp``, ``Adagrad`` and ``Adamax``: Paddle 2.5's update rules, arguments and defaults.

They have no multi-tensor kernel: their rule is written once here, over arrays of the
backend, and ``fuse_all_optimizer_ops`` applies it to each flat run at once rather than to
each parameter (the rule is elementwise, so a run is one array to it). ``weight_decay`` is
L2 regularisation added to the gradient, as for ``SGD`` and ``Momentum``.
"""
from ..core import backend
from .. import kernels
from .optimizer import Optimizer, _check_rate


def _check_positive(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, not {value!r}")
    return float(value)


def _with_decay(param, grad, weight_decay):
    return grad + weight_decay * param if weight_decay else grad


class _RuleOverRuns(Optimizer):
    """An optimizer whose fused update is its ``reference_update`` over each flat run."""

    def _fused_update(self, params, grads, states, lr, found_inf):
        def update():
            for param, grad, state in zip(params, grads, states):
                self.reference_update(param, grad, state, lr)
        kernels.unless_found(found_inf, params + [flat for state in states
                                                  for flat in state.values()], update)


class RMSProp(_RuleOverRuns):
    """``s = rho * s + (1 - rho) * g ** 2``; ``v = momentum * v + lr * g / sqrt(s + eps)``
    (``centered``: ``sqrt(s - m ** 2 + eps)``, ``m = rho * m + (1 - rho) * g``); ``p -= v``.
    Paddle puts ``epsilon`` inside the square root."""

    state_names = ("mean_square", "mean_grad", "momentum")

    def __init__(self, learning_rate, rho=0.95, epsilon=1e-06, momentum=0.0, centered=False,
                 parameters=None, weight_decay=None, grad_clip=None, name=None):
        super().__init__(learning_rate, parameters, weight_decay, grad_clip)
        self.rho = _check_rate("rho", rho, 0, 1)
        self.epsilon = _check_positive("epsilon", epsilon)
        self.momentum = _check_rate("momentum", momentum, 0, 1)
        self.centered = bool(centered)

    def reference_update(self, param, grad, state, lr):
        xp = backend.array_module()
        g = _with_decay(param, grad, self.weight_decay)
        square, mean, velocity = state["mean_square"], state["mean_grad"], state["momentum"]
        square *= self.rho
        square += (1 - self.rho) * (g * g)
        if self.centered:
            mean *= self.rho
            mean += (1 - self.rho) * g
            denominator = xp.sqrt(square - mean * mean + self.epsilon)
        else:
            denominator = xp.sqrt(square + self.epsilon)
        velocity *= self.momentum
        velocity += lr * g / denominator
        param -= velocity


class Adagrad(_RuleOverRuns):
    """``s += g ** 2``; ``p -= lr * g / (sqrt(s) + epsilon)``; ``s`` starts at
    ``initial_accumulator_value``."""

    state_names = ("moment",)

    def __init__(self, learning_rate, epsilon=1e-06, parameters=None, weight_decay=None,
                 grad_clip=None, name=None, initial_accumulator_value=0.0):
        self.initial_accumulator_value = float(_check_rate(
            "initial_accumulator_value", initial_accumulator_value, 0, float("inf")))
        super().__init__(learning_rate, parameters, weight_decay, grad_clip)
        self.epsilon = _check_positive("epsilon", epsilon)

    def initial_state(self, name):
        return self.initial_accumulator_value

    def reference_update(self, param, grad, state, lr):
        xp = backend.array_module()
        g = _with_decay(param, grad, self.weight_decay)
        moment = state["moment"]
        moment += g * g
        param -= lr * g / (xp.sqrt(moment) + self.epsilon)


class Adamax(_RuleOverRuns):
    """``m = beta1 * m + (1 - beta1) * g``; ``u = max(beta2 * u + epsilon, |g|)``; ``p -= lr
    / (1 - beta1 ** t) * m / u`` at update ``t``. The bias correction reads the step count on
    the host, so the update cannot be captured in a CUDA graph."""

    state_names = ("moment", "inf_norm")
    capture_refusal = ("Adamax's bias correction takes the step count from the host; a "
                       "captured replay would reuse the count of the capture")

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-08,
                 parameters=None, weight_decay=None, grad_clip=None, name=None):
        super().__init__(learning_rate, parameters, weight_decay, grad_clip)
        self.beta1 = _check_rate("beta1", beta1, 0, 1, high_inclusive=False)
        self.beta2 = _check_rate("beta2", beta2, 0, 1, high_inclusive=False)
        self.epsilon = _check_positive("epsilon", epsilon)

    def reference_update(self, param, grad, state, lr):
        xp = backend.array_module()
        g = _with_decay(param, grad, self.weight_decay)
        moment, norm = state["moment"], state["inf_norm"]
        moment *= self.beta1
        moment += (1 - self.beta1) * g
        norm *= self.beta2
        norm += self.epsilon
        xp.maximum(norm, xp.abs(g), out=norm)
        param -= lr / (1 - self.beta1 ** self.step_count) * (moment / norm)

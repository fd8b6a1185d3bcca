"""Learning-rate schedules (Paddle's ``paddle.optimizer.lr`` names and arguments).

A scheduler is passed as ``learning_rate`` to an optimizer; ``scheduler.step()`` advances it
(per epoch or per iteration, the caller's choice) and ``scheduler()`` is the current rate."""
import math


def _check_number(name, value, low=None, positive=False):
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, not {value!r}")
    if positive and not value > 0:
        raise ValueError(f"{name} must be positive, not {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be at least {low}, not {value!r}")
    return value


def _check_steps(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, not {value!r}")
    return value


class LRScheduler:
    """``last_epoch`` counts calls of ``step``; ``get_lr`` computes the rate from it."""

    def __init__(self, learning_rate):
        self.base_lr = float(_check_number("learning_rate", learning_rate, low=0))
        self.last_epoch = 0

    def get_lr(self):
        raise NotImplementedError(f"{type(self).__name__} does not define get_lr")

    def __call__(self):
        return self.get_lr()

    def step(self):
        self.last_epoch += 1

    def state_dict(self):
        return {"last_epoch": self.last_epoch}

    def set_state_dict(self, state):
        self.last_epoch = int(state["last_epoch"])


class StepDecay(LRScheduler):
    """``learning_rate * gamma ** (last_epoch // step_size)``."""

    def __init__(self, learning_rate, step_size, gamma=0.1):
        super().__init__(learning_rate)
        self.step_size = _check_steps("step_size", step_size)
        self.gamma = float(_check_number("gamma", gamma, positive=True))

    def get_lr(self):
        return self.base_lr * self.gamma ** (self.last_epoch // self.step_size)


class CosineAnnealingDecay(LRScheduler):
    """``eta_min + (learning_rate - eta_min) * (1 + cos(pi * t / T_max)) / 2``, ``t`` capped
    at ``T_max``."""

    def __init__(self, learning_rate, T_max, eta_min=0.0):
        super().__init__(learning_rate)
        self.T_max = _check_steps("T_max", T_max)
        self.eta_min = float(_check_number("eta_min", eta_min, low=0))

    def get_lr(self):
        t = min(self.last_epoch, self.T_max)
        return self.eta_min + (self.base_lr - self.eta_min) * (
            1 + math.cos(math.pi * t / self.T_max)) / 2


class LinearWarmup(LRScheduler):
    """From ``start_lr`` to ``end_lr`` linearly over ``warmup_steps`` steps, then
    ``learning_rate`` (a number, or a scheduler that starts counting after the warm-up)."""

    def __init__(self, learning_rate, warmup_steps, start_lr, end_lr):
        self.after = learning_rate if isinstance(learning_rate, LRScheduler) else None
        super().__init__(learning_rate.base_lr if self.after else learning_rate)
        self.warmup_steps = _check_steps("warmup_steps", warmup_steps)
        self.start_lr = float(_check_number("start_lr", start_lr, low=0))
        self.end_lr = float(_check_number("end_lr", end_lr, low=0))

    def get_lr(self):
        if self.last_epoch < self.warmup_steps:
            fraction = self.last_epoch / self.warmup_steps
            return self.start_lr + (self.end_lr - self.start_lr) * fraction
        return self.after() if self.after else self.base_lr

    def step(self):
        super().step()
        if self.after and self.last_epoch > self.warmup_steps:
            self.after.step()

    def state_dict(self):
        state = super().state_dict()
        if self.after:
            state["after"] = self.after.state_dict()
        return state

    def set_state_dict(self, state):
        super().set_state_dict(state)
        if self.after:
            self.after.set_state_dict(state["after"])

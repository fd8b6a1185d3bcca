"""Learning-rate schedules (Paddle's ``paddle.optimizer.lr`` names and arguments).

A scheduler is passed as ``learning_rate`` to an optimizer; ``scheduler.step()`` advances it
(per epoch or per iteration, the caller's choice) and ``scheduler()`` is the current rate."""
import math

from ..core.paddle_names import module_getattr as _module_getattr


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


class MultiStepDecay(LRScheduler):
    """``learning_rate * gamma ** k``, ``k`` the number of ``milestones`` (increasing epochs)
    reached."""

    def __init__(self, learning_rate, milestones, gamma=0.1):
        super().__init__(learning_rate)
        milestones = list(milestones)
        if not milestones or any(not isinstance(m, int) or isinstance(m, bool) or m < 1
                                 for m in milestones) or milestones != sorted(set(milestones)):
            raise ValueError(f"milestones must be increasing positive integers, not "
                             f"{milestones!r}")
        self.milestones = milestones
        self.gamma = float(_check_number("gamma", gamma, positive=True))

    def get_lr(self):
        reached = sum(self.last_epoch >= m for m in self.milestones)
        return self.base_lr * self.gamma ** reached


class PiecewiseDecay(LRScheduler):
    """``values[k]``, ``k`` the number of ``boundaries`` (increasing epochs) reached;
    ``values`` has one more entry than ``boundaries``."""

    def __init__(self, boundaries, values):
        boundaries, values = list(boundaries), list(values)
        if len(values) != len(boundaries) + 1:
            raise ValueError(f"PiecewiseDecay needs one more value than boundaries, got "
                             f"{len(boundaries)} boundaries and {len(values)} values")
        if boundaries != sorted(boundaries):
            raise ValueError(f"boundaries must be increasing, not {boundaries!r}")
        for value in values:
            _check_number("values", value, low=0)
        super().__init__(values[0])
        self.boundaries, self.values = boundaries, [float(v) for v in values]

    def get_lr(self):
        return self.values[sum(self.last_epoch >= b for b in self.boundaries)]


class NaturalExpDecay(LRScheduler):
    """``learning_rate * exp(-gamma * last_epoch)``."""

    def __init__(self, learning_rate, gamma):
        super().__init__(learning_rate)
        self.gamma = float(_check_number("gamma", gamma, low=0))

    def get_lr(self):
        return self.base_lr * math.exp(-self.gamma * self.last_epoch)


class InverseTimeDecay(LRScheduler):
    """``learning_rate / (1 + gamma * last_epoch)``."""

    def __init__(self, learning_rate, gamma):
        super().__init__(learning_rate)
        self.gamma = float(_check_number("gamma", gamma, low=0))

    def get_lr(self):
        return self.base_lr / (1 + self.gamma * self.last_epoch)


class _FunctionOfEpoch(LRScheduler):
    """A scheduler driven by the user's ``lr_lambda(epoch)``."""

    def __init__(self, learning_rate, lr_lambda):
        super().__init__(learning_rate)
        if not callable(lr_lambda):
            raise TypeError(f"lr_lambda must be callable, not {type(lr_lambda).__name__}")
        self.lr_lambda = lr_lambda


class MultiplicativeDecay(_FunctionOfEpoch):
    """``learning_rate`` times ``lr_lambda(e)`` for every epoch ``e`` from 1 to
    ``last_epoch``: each step multiplies the rate by the factor of its epoch."""

    def get_lr(self):
        rate = self.base_lr
        for epoch in range(1, self.last_epoch + 1):
            rate *= self.lr_lambda(epoch)
        return rate


class CyclicLR(LRScheduler):
    """Paddle's cyclical rate: up from ``base_learning_rate`` to ``max_learning_rate`` over
    ``step_size_up`` steps, down again over ``step_size_down`` (``step_size_up`` when None),
    the height of each cycle scaled by ``scale_fn``: 1 (``mode="triangular"``), halved each
    cycle (``"triangular2"``), or ``exp_gamma ** step`` (``"exp_range"``); a ``scale_fn`` of
    one's own takes the cycle number (``scale_mode="cycle"``) or the step
    (``"iterations"``)."""

    MODES = ("triangular", "triangular2", "exp_range")

    def __init__(self, base_learning_rate, max_learning_rate, step_size_up,
                 step_size_down=None, mode="triangular", exp_gamma=1.0, scale_fn=None,
                 scale_mode="cycle"):
        super().__init__(base_learning_rate)
        self.max_lr = float(_check_number("max_learning_rate", max_learning_rate, low=0))
        up = _check_steps("step_size_up", step_size_up)
        down = up if step_size_down is None else _check_steps("step_size_down", step_size_down)
        if scale_fn is None and mode not in self.MODES:
            raise ValueError(f"mode={mode!r} is not allowed; allowed: {self.MODES}, or a "
                             "scale_fn of one's own")
        if scale_mode not in ("cycle", "iterations"):
            raise ValueError(f"scale_mode={scale_mode!r} is not allowed; allowed: 'cycle', "
                             "'iterations'")
        self.cycle_size = up + down
        self.step_up_pct = up / self.cycle_size
        self.mode, self.gamma = mode, float(_check_number("exp_gamma", exp_gamma, low=0))
        if scale_fn is not None:
            self.scale_fn, self.scale_mode = scale_fn, scale_mode
        else:
            self.scale_fn = {"triangular": lambda cycle: 1.0,
                             "triangular2": lambda cycle: 1 / 2.0 ** (cycle - 1),
                             "exp_range": lambda step: self.gamma ** step}[mode]
            self.scale_mode = "iterations" if mode == "exp_range" else "cycle"

    def get_lr(self):
        step = self.last_epoch
        cycle = 1 + step // self.cycle_size
        fraction = 1.0 + step / self.cycle_size - cycle
        if fraction <= self.step_up_pct:
            height = fraction / self.step_up_pct
        else:
            height = (1 - fraction) / (1 - self.step_up_pct)
        scale = self.scale_fn(cycle if self.scale_mode == "cycle" else step)
        return self.base_lr + (self.max_lr - self.base_lr) * height * scale


class ExponentialDecay(LRScheduler):
    """``learning_rate * gamma ** last_epoch``."""

    def __init__(self, learning_rate, gamma):
        super().__init__(learning_rate)
        self.gamma = float(_check_number("gamma", gamma, positive=True))

    def get_lr(self):
        return self.base_lr * self.gamma ** self.last_epoch


class LambdaDecay(_FunctionOfEpoch):
    """``learning_rate * lr_lambda(last_epoch)``."""

    def get_lr(self):
        return self.base_lr * self.lr_lambda(self.last_epoch)


class PolynomialDecay(LRScheduler):
    """From ``learning_rate`` to ``end_lr`` over ``decay_steps`` along ``(1 - t / decay_steps)
    ** power``, then ``end_lr``; with ``cycle`` the decay restarts over the next multiple of
    ``decay_steps`` instead."""

    def __init__(self, learning_rate, decay_steps, end_lr=0.0001, power=1.0, cycle=False):
        super().__init__(learning_rate)
        self.decay_steps = _check_steps("decay_steps", decay_steps)
        self.end_lr = float(_check_number("end_lr", end_lr, low=0))
        self.power = float(_check_number("power", power, positive=True))
        self.cycle = bool(cycle)

    def get_lr(self):
        t, steps = self.last_epoch, self.decay_steps
        if self.cycle:
            steps *= max(math.ceil(t / steps), 1)
        else:
            t = min(t, steps)
        return (self.base_lr - self.end_lr) * (1 - t / steps) ** self.power + self.end_lr


class NoamDecay(LRScheduler):
    """The Transformer's schedule: ``learning_rate * d_model ** -0.5 * min(t ** -0.5, t *
    warmup_steps ** -1.5)``, ``t`` the step (1 at step 0)."""

    def __init__(self, d_model, warmup_steps, learning_rate=1.0):
        super().__init__(learning_rate)
        self.d_model = _check_number("d_model", d_model, positive=True)
        self.warmup_steps = _check_steps("warmup_steps", warmup_steps)

    def get_lr(self):
        t = self.last_epoch
        decay = 1.0 if t == 0 else t ** -0.5
        return self.base_lr * self.d_model ** -0.5 * min(decay, t * self.warmup_steps ** -1.5)


class OneCycleLR(LRScheduler):
    """Paddle's one-cycle policy over ``total_steps``: from ``max_learning_rate /
    divide_factor`` up to ``max_learning_rate`` over the first ``phase_pct`` of the steps,
    then down to ``end_learning_rate`` (with ``three_phase``: back down to the start over as
    many steps, then to ``end_learning_rate``), each phase along a half cosine
    (``anneal_strategy="cos"``) or a line (``"linear"``)."""

    def __init__(self, max_learning_rate, total_steps, divide_factor=25.0,
                 end_learning_rate=0.0001, phase_pct=0.3, anneal_strategy="cos",
                 three_phase=False):
        super().__init__(max_learning_rate)
        self.total_steps = _check_steps("total_steps", total_steps)
        divide_factor = float(_check_number("divide_factor", divide_factor, positive=True))
        end = float(_check_number("end_learning_rate", end_learning_rate, low=0))
        if not isinstance(phase_pct, (int, float)) or not 0 < phase_pct < 1:
            raise ValueError(f"phase_pct must lie in (0, 1), not {phase_pct!r}")
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"anneal_strategy={anneal_strategy!r} is not allowed; allowed: "
                             "'cos', 'linear'")
        self.anneal_strategy = anneal_strategy
        start, peak = self.base_lr / divide_factor, self.base_lr
        up = phase_pct * total_steps - 1
        if three_phase:
            self.phases = [(0, up, start, peak), (up, 2 * up, peak, start),
                           (2 * up, total_steps - 1, start, end)]
        else:
            self.phases = [(0, up, start, peak), (up, total_steps - 1, peak, end)]

    def get_lr(self):
        t = self.last_epoch
        if t >= self.total_steps:
            raise ValueError(f"OneCycleLR was stepped {t} times, past its total_steps="
                             f"{self.total_steps}")
        for begin, end, start_lr, end_lr in self.phases:  # the phase of t, else the last
            if t <= end:
                break
        fraction = (t - begin) / (end - begin) if end > begin else 1.0
        if self.anneal_strategy == "linear":
            return start_lr + (end_lr - start_lr) * fraction
        return end_lr + (start_lr - end_lr) * (math.cos(math.pi * fraction) + 1) / 2


class ReduceOnPlateau(LRScheduler):
    """Multiply the rate by ``factor`` (not below ``min_lr``) once the metric passed to
    ``step(metrics)`` has not improved for more than ``patience`` calls, then wait
    ``cooldown`` calls; improving means below the best by ``threshold`` (``mode="min"``;
    above it for ``"max"``), relative to the best (``threshold_mode="rel"``) or absolute
    (``"abs"``). A change smaller than ``epsilon`` is not made."""

    def __init__(self, learning_rate, mode="min", factor=0.1, patience=10, threshold=1e-4,
                 threshold_mode="rel", cooldown=0, min_lr=0, epsilon=1e-8, verbose=False):
        super().__init__(learning_rate)
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r} is not allowed; allowed: 'min', 'max'")
        if threshold_mode not in ("rel", "abs"):
            raise ValueError(f"threshold_mode={threshold_mode!r} is not allowed; allowed: "
                             "'rel', 'abs'")
        factor = float(_check_number("factor", factor, positive=True))
        if factor >= 1:
            raise ValueError(f"factor must be below 1, not {factor!r}")
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 0:
            raise ValueError(f"patience must be an integer >= 0, not {patience!r}")
        if not isinstance(cooldown, int) or isinstance(cooldown, bool) or cooldown < 0:
            raise ValueError(f"cooldown must be an integer >= 0, not {cooldown!r}")
        self.mode, self.threshold_mode, self.factor = mode, threshold_mode, factor
        self.patience, self.cooldown = patience, cooldown
        self.threshold = float(_check_number("threshold", threshold, low=0))
        self.min_lr = float(_check_number("min_lr", min_lr, low=0))
        self.epsilon = float(_check_number("epsilon", epsilon, low=0))
        self.last_lr, self.best = self.base_lr, None
        self.num_bad_epochs = self.cooldown_counter = 0

    def get_lr(self):
        return self.last_lr

    def _improves(self, value):
        margin = abs(self.best) * self.threshold if self.threshold_mode == "rel" \
            else self.threshold
        return value < self.best - margin if self.mode == "min" else value > self.best + margin

    def step(self, metrics):
        """One epoch ended with ``metrics`` (a number, or a one-element array or Tensor)."""
        if hasattr(metrics, "numpy"):
            metrics = metrics.numpy()
        try:
            value = float(metrics.reshape(-1)[0] if hasattr(metrics, "reshape") else metrics)
        except (TypeError, ValueError, IndexError):
            raise TypeError(f"ReduceOnPlateau.step takes the metric as a number, not "
                            f"{metrics!r}") from None
        super().step()
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            return
        if self.best is None or self._improves(value):
            self.best, self.num_bad_epochs = value, 0
        else:
            self.num_bad_epochs += 1
        if self.num_bad_epochs > self.patience:
            self.cooldown_counter, self.num_bad_epochs = self.cooldown, 0
            lowered = max(self.last_lr * self.factor, self.min_lr)
            if self.last_lr - lowered > self.epsilon:
                self.last_lr = lowered

    def state_dict(self):
        return dict(super().state_dict(), last_lr=self.last_lr, best=self.best,
                    num_bad_epochs=self.num_bad_epochs, cooldown_counter=self.cooldown_counter)

    def set_state_dict(self, state):
        super().set_state_dict(state)
        self.last_lr, self.best = float(state["last_lr"]), state["best"]
        self.num_bad_epochs = int(state["num_bad_epochs"])
        self.cooldown_counter = int(state["cooldown_counter"])


# A name Paddle has and fleetmpi lacks raises an error that says so (core.paddle_names).
__getattr__ = _module_getattr(__name__, "paddle.optimizer.lr", globals())

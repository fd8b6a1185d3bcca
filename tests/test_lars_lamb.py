"""lars and lamb: the update against a NumPy transcription of the published rules (written out
below, float64), zero norms, refused optimizers, steps without an update, checkpoints, and N
ranks against one process on the global batch."""
import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.core import backend
from fleetmpi import nn, optimizer
from fleetmpi.optimizer import StepContext, lr
from comm_support import close, equal, ok
from strategy_support import global_batch, make_mlp, make_strategy, train, world_gather

LEARNING_RATE = 0.1
MOMENTUM = 0.9
BETA1, BETA2, EPSILON = 0.8, 0.95, 1e-6


# -- the published rules, transcribed ---------------------------------------------------------

def lars_step(w, g, v, lr_, mu, lars_coeff, wd, epsilon):
    """You et al. 2017 as Paddle's lars_momentum: the plain rate where a norm is zero."""
    w_norm, g_norm = np.sqrt(np.sum(w ** 2)), np.sqrt(np.sum(g ** 2))
    if w_norm > 0 and g_norm > 0:
        local_lr = lr_ * lars_coeff * w_norm / (g_norm + wd * w_norm + epsilon)
    else:
        local_lr = lr_
    v = mu * v + local_lr * (g + wd * w)
    return w - v, v


def lamb_step(w, g, m, v, t, lr_, beta1, beta2, epsilon, wd):
    """You et al. 2019, Algorithm 2 (identity scaling), bias-corrected moments; trust ratio 1
    where a norm is zero."""
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g ** 2
    r = (m / (1 - beta1 ** t)) / (np.sqrt(v / (1 - beta2 ** t)) + epsilon) + wd * w
    w_norm, r_norm = np.sqrt(np.sum(w ** 2)), np.sqrt(np.sum(r ** 2))
    trust = w_norm / r_norm if w_norm > 0 and r_norm > 0 else 1.0
    return w - lr_ * trust * r, m, v


LARS_DEFAULTS = {"lars_coeff": 0.001, "lars_weight_decay": 0.0005, "epsilon": 0.0,
                 "exclude_from_weight_decay": []}
LAMB_DEFAULTS = {"lamb_weight_decay": 0.01, "exclude_from_weight_decay": []}


class Reference:
    """The transcription applied to host copies of every parameter, with its own state."""

    def __init__(self, name, configs, parameters):
        self.name = name
        self.configs = dict(LARS_DEFAULTS if name == "lars" else LAMB_DEFAULTS, **configs)
        self.weights = {p.name: backend.to_numpy(p.data).astype(np.float64) for p in parameters}
        self.state = {n: (np.zeros_like(w), np.zeros_like(w)) for n, w in self.weights.items()}
        self.t = 0

    def decay(self, name):
        key = f"{self.name}_weight_decay"
        excluded = any(s in name for s in self.configs["exclude_from_weight_decay"])
        return 0.0 if excluded else self.configs[key]

    def step(self, grads, lr_=LEARNING_RATE, weights=None):
        """One update from ``grads`` (by name), starting from ``weights`` when given."""
        self.t += 1
        c = self.configs
        for name, g in grads.items():
            w = self.weights[name] if weights is None else weights[name]
            a, b = self.state[name]
            if self.name == "lars":
                w, a = lars_step(w, g, a, lr_, MOMENTUM, c["lars_coeff"], self.decay(name),
                                 c["epsilon"])
            else:
                w, a, b = lamb_step(w, g, a, b, self.t, lr_, BETA1, BETA2, EPSILON,
                                    self.decay(name))
            self.weights[name], self.state[name] = w, (a, b)


# -- set-ups ------------------------------------------------------------------------------------

def momentum(parameters, learning_rate=LEARNING_RATE, **options):
    return optimizer.Momentum(learning_rate=learning_rate, momentum=MOMENTUM,
                              parameters=parameters, **options)


def adam(parameters, learning_rate=LEARNING_RATE, **options):
    return optimizer.Adam(learning_rate=learning_rate, beta1=BETA1, beta2=BETA2,
                          epsilon=EPSILON, parameters=parameters, **options)


MAKE_OPTIMIZER = {"lars": momentum, "lamb": adam}

CONFIGS = {
    "lars": {
        "defaults": {},
        "coeff_decay_epsilon": {"lars_coeff": 0.05, "lars_weight_decay": 0.01, "epsilon": 0.5},
        "exclude_biases": {"lars_coeff": 0.02, "exclude_from_weight_decay": [".b"]},
        "exclude_layer_and_biases": {"lars_coeff": 0.2, "lars_weight_decay": 0.1,
                                     "epsilon": 1e-3,
                                     "exclude_from_weight_decay": ["fc1", "bias"]},
    },
    "lamb": {
        "defaults": {},
        "strong_decay": {"lamb_weight_decay": 0.3},
        "exclude_biases": {"lamb_weight_decay": 0.05, "exclude_from_weight_decay": [".b"]},
        "exclude_layer": {"lamb_weight_decay": 0.1, "exclude_from_weight_decay": ["fc2"]},
        "no_decay": {"lamb_weight_decay": 0.0},
    },
}
CASES = [(name, config) for name in CONFIGS for config in CONFIGS[name]]


def strategy_for(name, configs):
    return make_strategy(**{name: True, f"{name}_configs": configs})


def build(name, configs, make_model=make_mlp, learning_rate=LEARNING_RATE):
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = make_model()
    opt = fleet.distributed_optimizer(MAKE_OPTIMIZER[name](model.parameters(), learning_rate),
                                      strategy_for(name, configs), local=True)
    return model, opt


def update_stage(opt, name):
    """Run strategy ``name``'s update stage alone on the gradients in the buffers; the plain
    optimizer update it replaces must not run."""
    def plain_update(ctx):
        raise AssertionError(f"{name} handed the step to the optimizer's own update")

    ctx = StepContext(None, None, None, None, opt.inner, step=opt.step_count)
    opt.strategies[name].update(ctx, plain_update)


def set_random_grads(model, rng, zero=()):
    grads = {}
    for p in model.parameters():
        p.grad[...] = 0 if p.name in zero else rng.standard_normal(p.shape) * 0.3
        grads[p.name] = p.grad.numpy().copy()
    return grads


def assert_matches(model, reference, rtol=1e-12, atol=1e-15, step=None):
    for p in model.parameters():
        np.testing.assert_allclose(p.data, reference.weights[p.name], rtol=rtol, atol=atol,
                                   err_msg=f"{p.name} after step {step}")


# -- the rule ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,config", CASES)
def test_update_matches_the_transcription_over_steps(name, config):
    configs = CONFIGS[name][config]
    model, opt = build(name, configs)
    reference = Reference(name, configs, model.parameters())
    initial = {p.name: p.data.copy() for p in model.parameters()}
    rng = np.random.default_rng(7)
    for step in range(6):
        grads = set_random_grads(model, rng)
        update_stage(opt, name)
        reference.step(grads)
        assert_matches(model, reference, step=step)
    assert opt.inner.step_count == 6
    for p in model.parameters():   # far more than the tolerance, or the comparison proves little
        assert np.max(np.abs(p.data - initial[p.name])) > 1e-7, f"{p.name} barely moved"


def test_exclude_from_weight_decay_matches_names_by_substring(caplog):
    model, opt = build("lars", {"exclude_from_weight_decay": [".b", "fc1", "batch_norm"]})
    lars = opt.strategies["lars"]
    assert lars.excluded_parameters == ["fc0.bias", "fc1.weight", "fc1.bias", "fc2.bias"]
    assert {p.name: lars.decay_of(p) for p in model.parameters()} == {
        "fc0.weight": 0.0005, "fc0.bias": 0.0, "fc1.weight": 0.0, "fc1.bias": 0.0,
        "fc2.weight": 0.0005, "fc2.bias": 0.0}
    assert "entry 'batch_norm' matches no parameter name" in caplog.text


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_minimize_applies_the_rule_with_the_scheduled_learning_rate(name):
    configs = {"lars": {"lars_coeff": 0.1, "lars_weight_decay": 0.01, "epsilon": 1e-4,
                        "exclude_from_weight_decay": [".b"]},
               "lamb": {"lamb_weight_decay": 0.02, "exclude_from_weight_decay": [".b"]}}[name]
    schedule = lr.StepDecay(LEARNING_RATE, step_size=2, gamma=0.5)
    model, opt = build(name, configs, learning_rate=schedule)
    reference = Reference(name, configs, model.parameters())
    for step in range(5):
        before = {p.name: p.data.copy() for p in model.parameters()}
        rate = LEARNING_RATE * 0.5 ** (step // 2)
        opt.minimize(model, nn.CrossEntropyLoss(), *global_batch(step))
        # the gradients the step used are still in the buffers
        reference.step({p.name: p.grad.numpy().copy() for p in model.parameters()}, rate, before)
        assert_matches(model, reference, step=step)
        schedule.step()


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_float32_parameters_stay_float32_and_follow_the_rule(name):
    configs = CONFIGS[name]["exclude_biases"]
    model, opt = build(name, configs, make_model=lambda: make_mlp(dtype="float32"))
    reference = Reference(name, configs, model.parameters())
    rng = np.random.default_rng(3)
    for step in range(3):
        grads = set_random_grads(model, rng)
        update_stage(opt, name)
        reference.step({n: g.astype(np.float64) for n, g in grads.items()})
        assert_matches(model, reference, rtol=2e-5, atol=1e-6, step=step)
    assert all(p.dtype == np.float32 for p in model.parameters())
    assert all(v.dtype == np.float32 for k, v in opt.state_dict().items() if "." in k)


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_the_optimizers_grad_clip_applies_before_the_norms(name):
    configs = CONFIGS[name]["exclude_biases"]
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = make_mlp()
    inner = MAKE_OPTIMIZER[name](model.parameters(),
                                 grad_clip=optimizer.ClipGradByGlobalNorm(0.5))
    opt = fleet.distributed_optimizer(inner, strategy_for(name, configs), local=True)
    reference = Reference(name, configs, model.parameters())
    rng = np.random.default_rng(13)
    for step in range(3):
        grads = set_random_grads(model, rng)
        total = np.sqrt(sum(np.sum(g ** 2) for g in grads.values()))
        assert total > 0.5
        update_stage(opt, name)
        reference.step({n: g * (0.5 / total) for n, g in grads.items()})
        assert_matches(model, reference, step=step)
        for p in model.parameters():   # the clip works on a copy
            np.testing.assert_array_equal(p.grad, grads[p.name])


# -- zero norms ----------------------------------------------------------------------------------

ZERO_WEIGHT = "fc1.weight"      # parameter zero, gradient not
ZERO_GRADIENT = "fc2.weight"    # gradient zero, parameter not
ZERO_BOTH = "fc0.bias"          # both zero


def zero_norm_model(name, configs):
    model, opt = build(name, configs)
    params = {p.name: p for p in model.parameters()}
    params[ZERO_WEIGHT].data[...] = 0
    params[ZERO_BOTH].data[...] = 0
    return model, opt, params


@pytest.mark.parametrize("name,config", [("lars", "defaults"), ("lars", "coeff_decay_epsilon"),
                                         ("lamb", "defaults"), ("lamb", "no_decay")])
def test_zero_parameter_or_gradient_stays_finite_and_follows_the_limit(name, config):
    configs = CONFIGS[name][config]
    model, opt, params = zero_norm_model(name, configs)
    reference = Reference(name, configs, model.parameters())
    start = {n: p.data.copy() for n, p in params.items()}
    rng = np.random.default_rng(11)
    # no division by zero and no invalid operation anywhere, not even in a discarded branch
    with np.errstate(divide="raise", invalid="raise"):
        for step in range(4):
            grads = set_random_grads(model, rng, zero=(ZERO_GRADIENT, ZERO_BOTH))
            update_stage(opt, name)
            if step == 0:
                check_first_step_limits(name, configs, params, start, grads)
            reference.step(grads)
            assert all(np.isfinite(p.data).all() for p in model.parameters())
            assert_matches(model, reference, step=step)
    np.testing.assert_array_equal(params[ZERO_BOTH].data, 0)


def check_first_step_limits(name, configs, params, start, grads):
    """The closed forms of the first step where a norm is zero (zero velocity and moments)."""
    if name == "lars":
        wd = dict(LARS_DEFAULTS, **configs)["lars_weight_decay"]
        # ||w|| = 0: the plain rate, v = lr * g
        np.testing.assert_allclose(params[ZERO_WEIGHT].data, -LEARNING_RATE * grads[ZERO_WEIGHT],
                                   rtol=1e-14)
        # ||g|| = 0: the plain rate on the decay alone
        np.testing.assert_allclose(params[ZERO_GRADIENT].data,
                                   start[ZERO_GRADIENT] * (1 - LEARNING_RATE * wd), rtol=1e-14)
    else:
        wd = dict(LAMB_DEFAULTS, **configs)["lamb_weight_decay"]
        # ||w|| = 0: trust 1, the bias-corrected Adam direction g / (|g| + eps)
        g = grads[ZERO_WEIGHT]
        np.testing.assert_allclose(params[ZERO_WEIGHT].data,
                                   -LEARNING_RATE * g / (np.abs(g) + EPSILON), rtol=1e-12)
        # ||g|| = 0: r = wd * w, trust 1 / wd (or 1 with no decay, r = 0): w * (1 - lr)
        expected = start[ZERO_GRADIENT] * (1 - LEARNING_RATE) if wd else start[ZERO_GRADIENT]
        np.testing.assert_allclose(params[ZERO_GRADIENT].data, expected, rtol=1e-13)


# -- refusals ------------------------------------------------------------------------------------

REFUSED = {
    "lars_with_adam": ("lars", lambda ps: optimizer.Adam(parameters=ps),
                       "strategy lars works with a Momentum optimizer, not Adam"),
    "lars_with_sgd": ("lars", lambda ps: optimizer.SGD(parameters=ps),
                      "strategy lars works with a Momentum optimizer, not SGD"),
    "lamb_with_momentum": ("lamb", lambda ps: optimizer.Momentum(parameters=ps),
                           "strategy lamb works with a Adam optimizer, not Momentum"),
    "lamb_with_sgd": ("lamb", lambda ps: optimizer.SGD(parameters=ps),
                      "strategy lamb works with a Adam optimizer, not SGD"),
    "lars_with_momentum_decay": ("lars", lambda ps: optimizer.Momentum(parameters=ps,
                                                                       weight_decay=0.01),
                                 r"Momentum optimizer's weight_decay must be None or 0, not "
                                 r"0\.01.*lars_configs\['lars_weight_decay'\]"),
    "lamb_with_adamw_default_decay": ("lamb", lambda ps: optimizer.AdamW(parameters=ps),
                                      r"AdamW optimizer's weight_decay must be None or 0, not "
                                      r"0\.01.*lamb_configs\['lamb_weight_decay'\]"),
    "lars_with_nesterov": ("lars", lambda ps: optimizer.Momentum(parameters=ps,
                                                                 use_nesterov=True),
                           "use_nesterov=False"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsuitable_optimizer_is_refused_at_distributed_optimizer(case):
    name, make_optimizer, message = REFUSED[case]
    fleet.init(is_collective=True)
    model = make_mlp()
    with pytest.raises(ValueError, match=message):
        fleet.distributed_optimizer(make_optimizer(model.parameters()),
                                    strategy_for(name, {}), local=True)


def test_lamb_accepts_adamw_without_its_own_decay():
    configs = {"lamb_weight_decay": 0.05}
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = make_mlp()
    opt = fleet.distributed_optimizer(
        optimizer.AdamW(learning_rate=LEARNING_RATE, beta1=BETA1, beta2=BETA2, epsilon=EPSILON,
                        parameters=model.parameters(), weight_decay=None),
        strategy_for("lamb", configs), local=True)
    reference = Reference("lamb", configs, model.parameters())
    grads = set_random_grads(model, np.random.default_rng(5))
    update_stage(opt, "lamb")
    reference.step(grads)
    assert_matches(model, reference)


# -- steps without an update, checkpoints --------------------------------------------------------

def merged_batch(step):
    (x0, y0), (x1, y1) = global_batch(2 * step), global_batch(2 * step + 1)
    return np.concatenate([x0, x1]), np.concatenate([y0, y1])


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_steps_without_an_update_leave_parameters_and_state_alone(name):
    """With gradient_merge (k_steps 2, avg) the update runs every second step only: 4 steps
    equal 2 steps on the merged batches, with the optimizer's step count at 2 (lamb's bias
    correction depends on it)."""
    configs = CONFIGS[name]["exclude_biases"]
    strategy = strategy_for(name, configs)
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": 2, "avg": True}
    merged, opt, _ = train(strategy, make_optimizer=MAKE_OPTIMIZER[name], steps=4, local=True)
    plain, _, _ = train(strategy_for(name, configs), make_optimizer=MAKE_OPTIMIZER[name],
                        steps=2, batch=merged_batch, local=True)
    assert opt.inner.step_count == 2
    for key, value in merged.state_dict().items():
        np.testing.assert_allclose(value, plain.state_dict()[key], rtol=1e-12, atol=1e-15,
                                   err_msg=key)


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_resume_from_a_checkpoint_is_bit_for_bit(name):
    configs = CONFIGS[name]["exclude_biases"]
    straight, _, _ = train(strategy_for(name, configs), make_optimizer=MAKE_OPTIMIZER[name],
                           steps=4, local=True)
    first, opt, _ = train(strategy_for(name, configs), make_optimizer=MAKE_OPTIMIZER[name],
                          steps=2, local=True)
    saved_model, saved_opt = first.state_dict(), opt.state_dict()
    model, resumed = build(name, configs)
    model.set_state_dict(saved_model)
    resumed.set_state_dict(saved_opt)
    for step in range(2, 4):
        resumed.minimize(model, nn.CrossEntropyLoss(), *global_batch(step))
    for key, value in model.state_dict().items():
        np.testing.assert_array_equal(value, straight.state_dict()[key], err_msg=key)


# -- N ranks -------------------------------------------------------------------------------------

MULTI_RANK = [("lars", "exclude_layer_and_biases"), ("lars", "coeff_decay_epsilon"),
              ("lamb", "exclude_biases"), ("lamb", "strong_decay")]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name,config", MULTI_RANK)
def test_n_ranks_match_one_process_on_the_global_batch(name, config):
    strategy = strategy_for(name, CONFIGS[name][config])
    model, opt, _ = train(strategy, make_optimizer=MAKE_OPTIMIZER[name], steps=5)
    single, _, _ = train(strategy, make_optimizer=MAKE_OPTIMIZER[name], steps=5, local=True)
    backend.manual_seed(0)
    initial = make_mlp().state_dict()
    ok(opt.inner.step_count == 5, f"step count {opt.inner.step_count}")
    for key, value in model.state_dict().items():
        expected = single.state_dict()[key]
        ok(np.max(np.abs(expected - initial[key])) > 1e-4, f"{key} barely moved")
        close(value, expected, rtol=1e-10, atol=1e-13, err_msg=key)
        everyone = world_gather(value)
        equal(everyone, np.broadcast_to(everyone[0], everyone.shape), err_msg=key)

"""amp's precisions, chosen by Paddle's names (``use_pure_fp16``, ``use_pure_bf16``, ``dtype``,
``level``): float16 with loss scaling, bfloat16 without (Paddle's rule), levels O1 and O2,
float32 master weights throughout, on one process and on N ranks; bad values refused."""
import functools
import sys

import ml_dtypes
import numpy as np
import pytest

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from fleetmpi import autograd, kernels, nn, optimizer
from fleetmpi.core import backend
from fleetmpi.autograd import Function

from comm_support import close, ok
from strategy_support import CLASSES, FEATURES, global_batch, make_strategy, shard

F16, F32, BF16 = np.dtype("float16"), np.dtype("float32"), np.dtype(ml_dtypes.bfloat16)
FUSED = {"fuse_all_optimizer_ops": True}


def host(array):
    return backend.to_numpy(autograd.as_array(array))


def amp_optimizer(model, configs, local=True):
    """Momentum over ``model`` under amp with ``configs``, the update fused."""
    strategy = make_strategy(amp=True, amp_configs=configs, build_strategy=FUSED)
    return fleet.distributed_optimizer(
        optimizer.Momentum(learning_rate=0.1, momentum=0.9, parameters=model.parameters()),
        strategy, local=local)


# -- a user's Layer, and where its operators compute -------------------------------------------

class ScaleBy(Function):
    """``x * gain``, a user's operation with an ``op_type`` on no list (gray); ``record.dtypes``
    shows the dtypes its forward received."""

    op_type = "user_scale_by"

    @staticmethod
    def forward(ctx, x, gain, record):
        record.dtypes = (x.dtype, gain.dtype)
        ctx.save_for_backward(x, gain)
        return x * gain

    @staticmethod
    def backward(ctx, dy):
        x, gain = ctx.saved_tensor()
        return dy * gain, (dy * x).sum(axis=0)


class UserNet(nn.Layer):
    """A user's model: Linear layers, GELU, a gray user operation over a parameter of its own,
    layer norm, a residual sum with a scale."""

    def __init__(self):
        super().__init__(dtype="float32")
        self.fc_in = nn.Linear(FEATURES, 32, dtype="float32")
        self.gain = self.create_parameter([32], default_initializer=nn.initializer.Constant(1.0))
        self.norm_weight = self.create_parameter(
            [32], default_initializer=nn.initializer.Constant(1.0))
        self.norm_bias = self.create_parameter([32], is_bias=True)
        self.fc_mid = nn.Linear(32, 32, dtype="float32")
        self.head = nn.Linear(32, CLASSES, dtype="float32")

    def forward(self, x):
        h = ScaleBy.apply(F.gelu(self.fc_in(x)), self.gain, record=self)
        h = F.layer_norm(h, 32, self.norm_weight, self.norm_bias)
        return self.head(h + F.relu(self.fc_mid(h)) * 0.5)


def user_net():
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    return fleet.distributed_model(UserNet())


@pytest.mark.parametrize("configs, dtype, level, gray", [
    ({}, F16, "O1", (F16, F32)),
    ({"level": "O2"}, F16, "O2", (F16, F16)),
    ({"use_pure_fp16": True}, F16, "O2", (F16, F16)),
    ({"dtype": "bfloat16"}, BF16, "O1", (BF16, F32)),
    ({"dtype": "bfloat16", "level": "O2"}, BF16, "O2", (BF16, BF16)),
    ({"use_pure_bf16": True}, BF16, "O2", (BF16, BF16)),
    ({"use_pure_bf16": True, "dtype": "bfloat16"}, BF16, "O2", (BF16, BF16)),
])
def test_level_o2_computes_gray_operators_in_the_low_precision_dtype(configs, dtype, level,
                                                                      gray):
    """The white list (matmul) computes in the chosen dtype at both levels; the user's gray
    operation takes its float32 parameter as it comes at O1 and cast at O2; the loss, on the
    black list, computes in float32; parameters and their gradients stay float32."""
    model = user_net()
    opt = amp_optimizer(model, configs)
    amp = opt.strategies["amp"]
    assert (amp.precision.dtype, amp.precision.level) == (dtype.name, level)
    x, y = global_batch(0)
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    assert model.dtypes == gray
    assert logits.dtype == dtype and loss.dtype == F32
    for p in model.parameters():
        assert p.dtype == F32 and p.grad.dtype == F32 and p.buffer.dtype == F32, p.name
    opt.step()
    opt.clear_grad()


@functools.lru_cache(maxsize=None)
def trained(configs=None, steps=30):
    """``(state_dict, losses, amp strategy or None)`` of ``UserNet`` trained ``steps`` times
    on one batch with Momentum, under ``configs`` (a tuple of amp_configs items; None: float32
    without amp)."""
    model = user_net()
    strategy = make_strategy(amp=configs is not None, amp_configs=dict(configs or ()),
                             build_strategy=FUSED)
    opt = fleet.distributed_optimizer(
        optimizer.Momentum(learning_rate=0.1, momentum=0.9, parameters=model.parameters()),
        strategy, local=True)
    x, y = global_batch(0)
    losses = [float(opt.minimize(model, nn.CrossEntropyLoss(), x, y)) for _ in range(steps)]
    return model.state_dict(), losses, opt.strategies.get("amp")


def relative_error(state, reference):
    """The largest ``|p - p_ref| / |p_ref|`` (norms) over the parameters."""
    return max(float(np.linalg.norm(state[k] - v) / np.linalg.norm(v))
               for k, v in reference.items())


# Tolerances against float32 after 30 Momentum steps: float16 rounds to 2**-11 relative and
# bfloat16 to 2**-8, 8 times coarser. (Measured: float16 up to 2.4e-4 in the loss and 1e-3 in
# the parameters, bfloat16 up to 2.1e-3 and 4.6e-2.)
PRECISIONS = {
    "float16 O1": ((), 2e-3, 2e-2),
    "float16 O2": ((("use_pure_fp16", True),), 2e-3, 2e-2),
    "bfloat16 O1": ((("dtype", "bfloat16"),), 2e-2, 0.15),
    "bfloat16 O2": ((("use_pure_bf16", True),), 2e-2, 0.15),
}


@pytest.mark.parametrize("name", sorted(PRECISIONS))
def test_each_precision_trains_a_user_layer_close_to_float32(name):
    configs, loss_tolerance, parameter_tolerance = PRECISIONS[name]
    reference, reference_losses, _ = trained()
    state, losses, amp = trained(configs)
    assert amp.precision.dtype == name.split()[0] and amp.skipped_steps == 0
    np.testing.assert_allclose(losses, reference_losses, rtol=0, atol=loss_tolerance)
    assert losses[-1] < 0.2 * losses[0]
    error = relative_error(state, reference)
    assert 0 < error < parameter_tolerance, error
    for value in state.values():
        assert value.dtype == F32


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_bfloat16_rounds_coarser_than_float16(level):
    """The bfloat16 runs do round to bfloat16: further from float32 than float16's."""
    reference = trained()[0]
    fp16, bf16 = (trained(PRECISIONS[f"{dtype} {level}"][0])[0]
                  for dtype in ("float16", "bfloat16"))
    assert relative_error(bf16, reference) > 2 * relative_error(fp16, reference)


# -- bfloat16 and loss scaling ---------------------------------------------------------------

def count_unscales(monkeypatch):
    calls = []
    unscale = kernels.multi_tensor_unscale
    monkeypatch.setattr(kernels, "multi_tensor_unscale",
                        lambda *args: calls.append(1) or unscale(*args))
    return calls


@pytest.mark.parametrize("configs, scale", [
    ({"use_pure_bf16": True}, None),
    ({"dtype": "bfloat16", "init_loss_scaling": 1024.0}, None),
    ({"use_pure_bf16": True, "use_dynamic_loss_scaling": False, "init_loss_scaling": 1.0}, None),
    ({"use_pure_bf16": True, "use_dynamic_loss_scaling": False, "init_loss_scaling": 256.0},
     256.0),
])
def test_bfloat16_scales_no_loss_and_checks_nothing(monkeypatch, configs, scale):
    """Paddle's rule: bfloat16 turns dynamic loss scaling off with a scale of 1, so nothing is
    unscaled or checked and no step is skipped; a fixed scale other than 1 is kept, and then
    the gradients are unscaled and checked as in float16."""
    calls = count_unscales(monkeypatch)
    model = user_net()
    opt = amp_optimizer(model, configs)
    amp = opt.strategies["amp"]
    assert amp.scales_loss == (scale is not None) and not amp.use_dynamic_loss_scaling
    assert amp.loss_scaling == (scale or 1.0)
    x, y = global_batch(0)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    grads = {p.name: host(p.grad).copy() for p in model.parameters()}
    opt.step()
    for p in model.parameters():                  # unscaled already, or by the step
        np.testing.assert_array_equal(host(p.grad), grads[p.name] / np.float32(scale or 1))
    opt.clear_grad()
    for step in range(1, 3):
        opt.minimize(model, nn.CrossEntropyLoss(), *global_batch(step))
    assert len(calls) == (3 if scale else 0)
    assert (amp.skipped_steps, opt.inner.step_count, amp.loss_scaling) == (0, 3, scale or 1.0)


def test_bfloat16_loss_scaling_keys_are_reported_as_paddle_turns_them_off():
    model = user_net()
    amp_optimizer(model, {"use_pure_bf16": True, "init_loss_scaling": 1024.0, "incr_ratio": 3.0})
    reasons = fleet.applied_strategy().not_applied
    for key in ("init_loss_scaling", "incr_ratio"):
        assert "bfloat16 keeps float32's exponent range" in reasons[f"amp_configs.{key}"]
    assert "amp_configs.decr_ratio" not in reasons                 # left at its default
    amp_optimizer(model, {"use_pure_bf16": True, "use_dynamic_loss_scaling": False,
                          "init_loss_scaling": 1024.0, "incr_ratio": 3.0})
    reasons = fleet.applied_strategy().not_applied
    assert "amp_configs.init_loss_scaling" not in reasons          # a fixed scale is kept
    assert "use_dynamic_loss_scaling is off" in reasons["amp_configs.incr_ratio"]


# -- bad configurations ----------------------------------------------------------------------

@pytest.mark.parametrize("configs, match", [
    ({"use_pure_fp16": True, "use_pure_bf16": True},
     "use_pure_fp16 and use_pure_bf16 are both set; each selects pure"),
    ({"use_pure_fp16": True, "dtype": "bfloat16"},
     "use_pure_fp16 selects float16, but amp_configs.dtype is 'bfloat16'; set one of them, or "
     "both to 'float16'"),
])
def test_contradicting_precision_keys_are_refused(configs, match):
    model = user_net()
    with pytest.raises(ValueError, match=match):
        amp_optimizer(model, configs)


@pytest.mark.parametrize("key, value, allowed", [
    ("dtype", "float64", "'float16', 'bfloat16'"), ("dtype", "bf16", "'float16', 'bfloat16'"),
    ("level", "O3", "'O1', 'O2'"), ("level", "o2", "'O1', 'O2'"),
])
def test_values_paddle_does_not_have_are_refused_naming_what_is_allowed(key, value, allowed):
    strategy = fleet.DistributedStrategy()
    with pytest.raises(ValueError) as refused:
        strategy.amp_configs = {key: value}
    assert str(refused.value) == (f"amp_configs[{key!r}] = {value!r} is not allowed; allowed: "
                                  f"a string among {allowed}")


def test_bfloat16_without_ml_dtypes_is_refused_saying_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)       # import ml_dtypes fails
    model = user_net()
    for configs in ({"use_pure_bf16": True}, {"dtype": "bfloat16"}):
        with pytest.raises(ValueError, match=r"amp_configs selects bfloat16 \(use_pure_bf16, or "
                                             r"dtype 'bfloat16'\): bfloat16 needs the "
                                             r"ml_dtypes package.*pip install ml-dtypes.*or use "
                                             r"dtype 'float16'"):
            amp_optimizer(model, configs)


# -- N ranks ---------------------------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("configs", [{"use_pure_bf16": True}, {"use_pure_fp16": True}],
                         ids=["bfloat16", "float16"])
def test_pure_precisions_on_n_ranks_match_one_process(configs):
    """Each rank on its shard of the global batch against one process on all of it: the same
    parameters on every rank, within a rounding unit of the low-precision dtype of the one
    process's (the ranks round their partial weight gradients apart)."""
    states = []
    for local in (False, True):
        model = user_net()
        size, rank = (1, 0) if local else (fleet.worker_num(), fleet.worker_index())
        opt = amp_optimizer(model, configs, local=local)
        for step in range(4):
            x, y = (shard(a, rank, size) for a in global_batch(step))
            opt.minimize(model, nn.CrossEntropyLoss(), x, y)
        states.append(model.state_dict())
        ok(opt.strategies["amp"].skipped_steps == 0)
    unit = 2.0 ** -7 if "use_pure_bf16" in configs else 2.0 ** -10
    for name, value in states[1].items():
        close(states[0][name], value, rtol=unit, atol=unit, err_msg=name)

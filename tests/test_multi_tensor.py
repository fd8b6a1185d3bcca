"""The multi-tensor optimizer kernels (``fleetmpi/kernels/optimizer.cu``): one launch over every
flat array of a step, with amp's unscale and overflow check in one pass of its own.

On the host, through ``cuda_host``'s shim: each kernel against the NumPy reference that
defines it, on geometries whose grid x block is smaller than the arrays, and one launch over
every array against one launch per array, bit for bit. On the CPU: the optimizer's
multi-tensor update against the per-buffer update, bit for bit. On the device branch (the
launcher replaced by the host run): how many launches a training step makes. In an amp step:
the step is skipped exactly when a gradient is not finite, and otherwise gives what unscaling
and then updating gives.
"""
import concurrent.futures
import itertools
import re

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.core import backend
from fleetmpi import kernels, nn, optimizer
from fleetmpi.kernels import loader, reference

from cuda_host import compile_for_device, load_on_host
from strategy_support import global_batch, make_mlp, make_strategy

SOURCE = loader.source_path("optimizer.cu")
KERNELS = ("sgd", "momentum", "adam", "unscale", "check_finite")
DTYPES = [("float64", 1e-12), ("float32", 1e-5)]
# (grid, block), each product below the 1001 + 97 + 1 elements of SIZES, so a thread walks
# several elements of the large arrays; None is the loader's own geometry.
GEOMETRIES = [None, (1, 1), (3, 7), (2, 64)]
GEOMETRY_IDS = ["loader", "1x1", "3x7", "2x64"]
SIZES = (97, 1, 1001)
STEPS = 3
C_TYPES = {"T": None, "long long": "int64", "int": "int32", "unsigned long long": "uint64",
           "float": "float32", "double": "float64"}


def _signatures():
    """``{kernel: [(kind, C base type), ...]}`` of the ``multi_tensor_*`` kernels."""
    text = open(SOURCE).read().replace("\\\n", "\n")
    found = {}
    for name, params in re.findall(r'extern "C" __global__ void multi_tensor_(\w+)_##SUFFIX'
                                   r'\(([^)]*)\)', text):
        args = []
        for param in params.split(","):
            decl = " ".join(param.split()[:-1])
            base = decl.rstrip("*").replace("const", "").strip()
            args.append(("pointer" if decl.endswith("*") else "scalar", base))
        found[name] = args
    return found


SIGNATURES = _signatures()


def test_the_kernels_are_the_ones_the_trainer_launches():
    assert sorted(SIGNATURES) == sorted(KERNELS)


def test_kernels_compile_for_the_device():
    ptx = open(compile_for_device(SOURCE)).read()
    for kernel in KERNELS:
        for suffix in loader.instances("optimizer.cu"):
            assert f".entry multi_tensor_{kernel}_{suffix}(" in ptx


def _check_arguments(kernel, name, dtype, n, args):
    """The arguments against the kernel's C signature; the table against the offsets."""
    signature = SIGNATURES[kernel[len("multi_tensor_"):]]
    assert len(args) == len(signature), name
    for index, (value, (kind, base)) in enumerate(zip(args, signature)):
        want = np.dtype(C_TYPES[base] or dtype)
        assert value.dtype == want, f"{name} argument {index}: {value.dtype} for {want}"
        if kind == "pointer":
            assert isinstance(value, np.ndarray) and value.flags.c_contiguous, (name, index)
        else:
            assert isinstance(value, np.generic), (name, index)
    table, offsets, n_arrays = args[:3]
    assert offsets.shape == (int(n_arrays) + 1,) and offsets[0] == 0 and offsets[-1] == n
    assert table.size % int(n_arrays) == 0


@pytest.fixture
def device_branch(monkeypatch, request):
    """``fleetmpi.kernels`` through its GPU branch, each launch run on the host on the
    fixture's geometry; the value is the list of kernels launched, with their array counts."""
    geometry = request.param if hasattr(request, "param") else None
    launched = []

    def launch(filename, kernel, suffix, n, args):
        assert filename == "optimizer.cu"
        name = f"{kernel}_{suffix}"
        _check_arguments(kernel, name, np.dtype(suffix), n, args)
        if geometry is None:
            block = loader.THREADS_PER_BLOCK
            grid = max(1, min(loader.MAX_BLOCKS, (int(n) + block - 1) // block))
        else:
            grid, block = geometry
        load_on_host(SOURCE).launch(name, grid, block, *args)
        launched.append((kernel, int(args[2])))

    monkeypatch.setattr(backend, "on_gpu", lambda: True)
    monkeypatch.setattr(kernels, "launch", launch)
    return launched


def on_geometries(function):
    return pytest.mark.parametrize("device_branch", GEOMETRIES, ids=GEOMETRY_IDS,
                                   indirect=True)(function)


def random(rng, size, dtype, scale=1.0):
    return (rng.standard_normal(size) * scale).astype(dtype)


# Each update: its multi-tensor function, its per-array reference, its state count and the
# arguments after the arrays for a step (1-based).
UPDATES = {
    "sgd": (kernels.multi_tensor_sgd_update, reference.sgd_update, 0,
            lambda step: (0.1 / step, 0.05)),
    "momentum": (kernels.multi_tensor_momentum_update, reference.momentum_update, 1,
                 lambda step: (0.1, 0.9, 0.05, False)),
    "nesterov": (kernels.multi_tensor_momentum_update, reference.momentum_update, 1,
                 lambda step: (0.1, 0.9, 0.0, True)),
    "adam": (kernels.multi_tensor_adam_update, reference.adam_update, 2,
             lambda step: (0.01, 0.9, 0.999, 1e-8, step, 0.05, False)),
    "adamw": (kernels.multi_tensor_adam_update, reference.adam_update, 2,
              lambda step: (0.01, 0.9, 0.999, 1e-8, step, 0.05, True)),
}


def _reference_args(name, step):
    args = UPDATES[name][3](step)
    return args + ((np,) if name.startswith("adam") else ())


def _arrays(name, dtype, seed=0):
    """Parameters and zero state, one array of each kind per size of ``SIZES``."""
    rng = np.random.default_rng([seed, len(name)])
    kinds = [[random(rng, size, dtype) for size in SIZES]]
    kinds += [[np.zeros(size, dtype) for size in SIZES] for _ in range(UPDATES[name][2])]
    return kinds


def _grads(dtype, step):
    rng = np.random.default_rng([step, 99])
    return [random(rng, size, dtype) for size in SIZES]


@on_geometries
@pytest.mark.parametrize("dtype, tolerance", DTYPES)
@pytest.mark.parametrize("name", sorted(UPDATES))
def test_each_update_matches_its_reference(device_branch, name, dtype, tolerance):
    function, update, _, args = UPDATES[name]
    got = _arrays(name, dtype)
    want = [[a.copy() for a in kind] for kind in got]
    start = got[0][2].copy()
    for step in range(1, STEPS + 1):
        grads = _grads(dtype, step)
        function(got[0], grads, *got[1:], *args(step))
        for index in range(len(SIZES)):
            update(want[0][index], grads[index], *(kind[index] for kind in want[1:]),
                   *_reference_args(name, step))
        for got_kind, want_kind in zip(got, want):
            for g, w in zip(got_kind, want_kind):
                np.testing.assert_allclose(g, w, rtol=tolerance, atol=tolerance)
    assert np.abs(got[0][2] - start).min() > 0  # every parameter of the largest array moved
    kernel = "adam" if name.startswith("adam") else "momentum" if name == "nesterov" else name
    assert device_branch == [(f"multi_tensor_{kernel}", len(SIZES))] * STEPS


@pytest.mark.parametrize("device_branch", [(3, 7)], indirect=True)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(UPDATES))
def test_one_launch_over_every_array_equals_a_launch_per_array_bit_for_bit(device_branch, name,
                                                                          dtype):
    function, _, _, args = UPDATES[name]
    together, apart = _arrays(name, dtype), _arrays(name, dtype)
    for step in range(1, STEPS + 1):
        grads = _grads(dtype, step)
        function(together[0], grads, *together[1:], *args(step))
        for index in range(len(SIZES)):
            function([apart[0][index]], [grads[index]], *([kind[index]] for kind in apart[1:]),
                     *args(step))
    for kind_together, kind_apart in zip(together, apart):
        for a, b in zip(kind_together, kind_apart):
            np.testing.assert_array_equal(a, b)
    assert len(device_branch) == STEPS * (1 + len(SIZES))


# Where a non-finite value goes: (array, element) of SIZES' arrays.
PLACES = [(0, 0), (2, 1000), (1, 0), (2, 500)]


@on_geometries
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("bad", [None, np.inf, -np.inf, np.nan])
def test_unscale_matches_the_reference_and_flags_exactly_the_non_finite(device_branch, dtype,
                                                                        bad):
    rng = np.random.default_rng(3)
    places = PLACES if bad is not None else [None]
    inverse = np.full(1, 2.0 ** -10, dtype=np.float32)
    for place in places:
        grads = [random(rng, size, dtype, 1e4) for size in SIZES]
        if place is not None:
            grads[place[0]][place[1]] = bad
        want = [g.copy() for g in grads]
        want_found = np.zeros(1, dtype=np.int32)
        for w in want:
            reference.unscale(w, inverse, want_found)
        found = np.zeros(1, dtype=np.int32)
        kernels.multi_tensor_unscale(grads, inverse, found)
        for g, w in zip(grads, want):
            np.testing.assert_array_equal(g, w)            # one multiply: the same bits
        assert want_found[0] == found[0] == (bad is not None), place
    assert device_branch == [("multi_tensor_unscale", len(SIZES))] * len(places)


@on_geometries
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("bad", [None, np.inf, -np.inf, np.nan])
def test_check_finite_flags_exactly_the_non_finite_and_writes_no_gradient(device_branch, dtype,
                                                                          bad):
    rng = np.random.default_rng(4)
    places = PLACES if bad is not None else [None]
    for place in places:
        grads = [random(rng, size, dtype, 1e4) for size in SIZES]
        if place is not None:
            grads[place[0]][place[1]] = bad
        before = [g.copy() for g in grads]
        want_found = np.zeros(1, dtype=np.int32)
        for g in before:
            reference.check_finite(g, want_found)
        found = np.zeros(1, dtype=np.int32)
        kernels.multi_tensor_check_finite(grads, found)
        for g, b in zip(grads, before):
            np.testing.assert_array_equal(g, b)
        assert want_found[0] == found[0] == (bad is not None), place
    assert device_branch == [("multi_tensor_check_finite", len(SIZES))] * len(places)


@pytest.mark.parametrize("dtype, huge", [("float32", 1e20), ("float64", 1e200),
                                         ("float16", 6e4)])
@pytest.mark.parametrize("shape", [(1000,), (40, 25), (3 * reference._ROW + 7,)])
def test_the_host_check_is_not_fooled_by_finite_values_whose_squares_or_sums_overflow(
        dtype, huge, shape):
    """The host probe (sums of rows, or a sum) overflows for these finite values; the
    elementwise test settles them, and still flags each inf and NaN, in the flag and in the
    bool of ``reference.all_finite`` alike (the last shape has whole rows and a tail)."""
    grad = np.full(shape, huge, dtype=dtype)
    found = np.zeros(1, dtype=np.int32)
    reference.check_finite(grad, found)
    assert found[0] == 0 and reference.all_finite(grad) is True
    for bad in (np.inf, -np.inf, np.nan):
        flat = grad.copy().reshape(-1)
        flat[len(flat) // 2] = bad
        reference.check_finite(flat.reshape(shape), found)
        assert found[0] == 1 and reference.all_finite(flat.reshape(shape)) is False, bad
        found[0] = 0


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("size", [reference._ROW - 1, 2 * reference._ROW, 5 * reference._ROW + 3])
@pytest.mark.parametrize("thread", ["main", "other"])
def test_the_host_probe_flags_an_inf_or_nan_anywhere_in_its_rows_or_tail(dtype, size, thread):
    """Each inf and NaN, alone at the first element, at the last of a row, in the tail past the
    whole rows and at the very last, is found by the probe itself (it is not finite), and the
    opposite infinities in one row or in two rows are too; finite values give a finite
    probe. On the main thread the probe sums rows, on another it takes a dot product: both
    are checked."""
    if thread == "other":
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(_probe_flags_every_place, dtype, size).result()
    _probe_flags_every_place(dtype, size)


def _probe_flags_every_place(dtype, size):
    rng = np.random.default_rng(size)
    grad = rng.standard_normal(size).astype(dtype)
    assert np.isfinite(reference._finite_probe(grad))
    places = {0, reference._ROW - 1, size - size % reference._ROW, size - 1} - {size}
    for place, bad in itertools.product(sorted(places), (np.inf, -np.inf, np.nan)):
        flat = grad.copy()
        flat[place] = bad
        assert not np.isfinite(reference._finite_probe(flat)), (place, bad)
        assert reference.all_finite(flat) is False
    for other in (1, reference._ROW + 1):
        if other < size:
            flat = grad.copy()
            flat[0], flat[other] = np.inf, -np.inf
            assert not np.isfinite(reference._finite_probe(flat)), other


def test_unscale_leaves_a_set_flag_set():
    found = np.ones(1, dtype=np.int32)
    kernels.multi_tensor_unscale([np.ones(5, np.float32)], np.ones(1, np.float32), found)
    assert found[0] == 1


@pytest.mark.parametrize("device_branch", [(3, 7)], indirect=True)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(UPDATES))
@pytest.mark.parametrize("flag", [0, 1], ids=["flag clear", "flag set"])
def test_an_update_with_the_overflow_flag_set_leaves_everything_untouched(device_branch, name,
                                                                          dtype, flag):
    """The kernel (through the shim) and the reference path take amp's flag: set, parameters
    and state keep their bits; clear, the update is the one without a flag, bit for bit."""
    function, _, _, args = UPDATES[name]
    # the kernel without and with the flag, the reference without and with it
    kinds = [_arrays(name, dtype) for _ in range(4)]
    for step in range(1, STEPS + 1):
        grads = _grads(dtype, step)
        found = np.full(1, flag, dtype=np.int32)
        for index, on_gpu in enumerate([True, True, False, False]):
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(backend, "on_gpu", lambda: on_gpu)
                flagged = {"found": found} if index % 2 else {}
                function(kinds[index][0], grads, *kinds[index][1:], *args(step), **flagged)
    untouched = _arrays(name, dtype)
    for without, flagged in ((kinds[0], kinds[1]), (kinds[2], kinds[3])):
        for index, kind in enumerate(without):
            for g, w in zip(flagged[index], untouched[index] if flag else kind):
                np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("on_gpu", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_takes_its_step_count_from_a_counter_as_from_the_host_bit_for_bit(name, on_gpu,
                                                                              monkeypatch):
    """A one-element int64 counter of the updates gives the bias corrections a host count
    gives: in the kernel (through the shim, which uses the host's pow), which reads it on the
    device, and in the reference, which reads a NumPy counter on the host."""
    launches = []
    monkeypatch.setattr(backend, "on_gpu", lambda: on_gpu)
    monkeypatch.setattr(kernels, "launch", lambda filename, kernel, suffix, n, args: (
        launches.append(kernel),
        load_on_host(SOURCE).launch(f"{kernel}_{suffix}", 3, 7, *args)))
    function, _, _, args = UPDATES[name]
    by_count, by_counter = _arrays(name, "float32"), _arrays(name, "float32")
    for step in range(1, STEPS + 1):
        grads = _grads("float32", step)
        arguments = list(args(step))
        function(by_count[0], grads, *by_count[1:], *arguments)
        arguments[4] = np.full(1, step, dtype=np.int64)
        function(by_counter[0], grads, *by_counter[1:], *arguments)
    for kind_count, kind_counter in zip(by_count, by_counter):
        for a, b in zip(kind_count, kind_counter):
            np.testing.assert_array_equal(a, b)
    assert len(launches) == (2 * STEPS if on_gpu else 0)


# -- the optimizer's update on the CPU -------------------------------------------------------

OPTIMIZERS = {
    "sgd": lambda ps: optimizer.SGD(learning_rate=0.1, parameters=ps, weight_decay=0.01),
    "momentum": lambda ps: optimizer.Momentum(learning_rate=0.1, momentum=0.9, parameters=ps,
                                              use_nesterov=True, weight_decay=0.01),
    "adam": lambda ps: optimizer.Adam(learning_rate=0.01, parameters=ps, weight_decay=0.01),
    "adamw": lambda ps: optimizer.AdamW(learning_rate=0.01, parameters=ps),
}


def _every_other_parameter(dtype):
    """A model's parameters and every other one of them: the optimizer over the second set has
    one run per parameter, none of them adjacent in the flat buffer."""
    backend.manual_seed(0)
    model = make_mlp(sizes=(6, 16, 12, 10, 4), dtype=dtype)
    return model, model.parameters()[::2]


def _per_buffer_update(opt, lr):
    """The update as it ran before the multi-tensor kernels: one call of the per-array
    reference for each run's flat arrays (in host blocks, as the kernels' host branch does)."""
    for run, state in zip(opt.runs, opt.run_states):
        arrays = (run.data, run.grad) + tuple(state[name] for name in opt.state_names)
        if isinstance(opt, optimizer.Adam):
            args = (opt.beta1, opt.beta2, opt.epsilon, opt.step_count, opt.weight_decay,
                    opt.decoupled, np)
            kernels._host_blocks(reference.adam_update, arrays, lr, *args)
        elif isinstance(opt, optimizer.Momentum):
            kernels._host_blocks(reference.momentum_update, arrays, lr, opt.momentum,
                                 opt.weight_decay, opt.use_nesterov)
        else:
            kernels._host_blocks(reference.sgd_update, arrays, lr, opt.weight_decay)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_multi_tensor_update_equals_the_per_buffer_update_bit_for_bit(name, dtype):
    (model, params), (model_b, params_b) = (_every_other_parameter(dtype) for _ in range(2))
    fused, per_buffer = OPTIMIZERS[name](params), OPTIMIZERS[name](params_b)
    fused.fuse_all_optimizer_ops = True
    assert len(fused.runs) == len(params) > 2
    rng = np.random.default_rng(5)
    for _ in range(STEPS):
        for p, q in zip(params, params_b):
            p.grad[...] = q.grad[...] = rng.standard_normal(p.shape).astype(dtype)
        fused.step()
        per_buffer.step_count += 1
        _per_buffer_update(per_buffer, per_buffer.get_lr())
    for p, q in zip(model.parameters(), model_b.parameters()):
        assert p.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(p.data, q.data, err_msg=p.name)
    for a, b in zip(fused.run_states, per_buffer.run_states):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


# -- launches per step -----------------------------------------------------------------------

def _step_on_the_device_branch(device_branch, strategy, batch):
    """One dygraph step of an MLP with 8 parameters, the optimizer over 4 of them (4 runs):
    forward and backward on the host, then ``opt.step()`` (gradient reduction with amp's
    unscale, and the update) through the device branch. Returns the optimizer and the
    kernels it launched."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend, "on_gpu", lambda: False)
        fleet.init(is_collective=True)
        model, params = _every_other_parameter("float32")
        model = fleet.distributed_model(model)
        opt = fleet.distributed_optimizer(
            optimizer.Momentum(learning_rate=0.1, momentum=0.9, parameters=params), strategy,
            local=True)
        x, y = batch
        nn.CrossEntropyLoss()(model(x), y).backward()
    opt.step()
    return opt, list(device_branch)


FUSED = {"build_strategy": {"fuse_all_optimizer_ops": True}}
AMP = {"amp": True, "amp_configs": {"init_loss_scaling": 1024.0, "decr_every_n_nan_or_inf": 1}}


@pytest.mark.parametrize("device_branch", [None], indirect=True)
@pytest.mark.parametrize("case", ["plain", "amp", "amp_overflow", "amp_bf16"])
def test_a_step_launches_one_kernel_per_pass_however_many_parameters(device_branch, case):
    """Four runs of one dtype: one update launch; before it one launch of the non-finite
    check without amp, or with amp one unscale launch (which checks); a step amp skips
    launches the unscale alone; bfloat16, which scales nothing, no unscale but the check."""
    fields = dict(FUSED, **(AMP if case.startswith("amp") else {}))
    if case == "amp_bf16":
        fields["amp_configs"] = {"use_pure_bf16": True}
    x, y = global_batch(0)
    if case == "amp_overflow":
        x = x * 1e6
    opt, launched = _step_on_the_device_branch(device_branch, make_strategy(**fields), (x, y))
    assert len(opt.inner.runs) == 4
    check = ("multi_tensor_check_finite", 4)
    want = {"plain": [check, ("multi_tensor_momentum", 4)],
            "amp": [("multi_tensor_unscale", 4), ("multi_tensor_momentum", 4)],
            "amp_overflow": [("multi_tensor_unscale", 4)],
            "amp_bf16": [check, ("multi_tensor_momentum", 4)]}[case]
    assert launched == want
    if case.startswith("amp"):
        amp = opt.strategies["amp"]
        assert amp.skipped_steps == (case == "amp_overflow")
        assert amp.loss_scaling == {"amp": 1024.0, "amp_overflow": 512.0, "amp_bf16": 1.0}[case]


@pytest.mark.parametrize("block", [0, 1, 2])
def test_unscale_on_the_host_finds_a_value_in_any_block(block):
    """On the host the unscale runs over ``HOST_BLOCK`` elements at a time: an inf in any
    block is found, and the values are the reference's over the whole array, bit for bit."""
    rng = np.random.default_rng(block)
    grad = random(rng, 2 * kernels.HOST_BLOCK + 7, "float32", 1e3)
    grad[block * kernels.HOST_BLOCK + 3] = np.inf
    want, want_found = grad.copy(), np.zeros(1, dtype=np.int32)
    reference.unscale(want, np.float32(0.125), want_found)
    found = np.zeros(1, dtype=np.int32)
    kernels.multi_tensor_unscale([grad], np.full(1, 0.125, dtype=np.float32), found)
    np.testing.assert_array_equal(grad, want)
    assert want_found[0] == found[0] == 1


# -- amp's fused unscale and overflow check in a step ----------------------------------------

SCALE = 1024.0


def _snapshot(params, opt):
    state = [backend.to_numpy(p.data).copy() for p in params]
    return state + [backend.to_numpy(flat).copy() for run in opt.run_states
                    for flat in run.values()]


@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("bad", [None, np.inf, -np.inf, np.nan], ids=str)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_amp_skips_a_step_exactly_when_a_gradient_is_not_finite(name, bad, where):
    """A non-finite value anywhere (the first element of the first run, the last of the last)
    skips the step: parameters and state untouched, gradients zeroed, the scale halved.
    Otherwise the step gives what dividing the gradients by the scale and then updating
    gives, bit for bit on the host."""
    fleet.init(is_collective=True)
    model, params = _every_other_parameter("float32")
    model = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(
        OPTIMIZERS[name](params),
        make_strategy(amp=True, build_strategy={"fuse_all_optimizer_ops": True},
                      amp_configs={"init_loss_scaling": SCALE, "decr_every_n_nan_or_inf": 1}),
        local=True)
    _, twin_params = _every_other_parameter("float32")
    twin = OPTIMIZERS[name](twin_params)
    x, y = global_batch(0)
    nn.CrossEntropyLoss()(model(backend.asarray(x)), backend.asarray(y)).backward()
    if bad is not None:
        flat = params[0 if where == "first" else -1].grad.reshape(-1)
        flat[0 if where == "first" else -1] = bad
    scaled = [p.grad.numpy().copy() for p in params]
    before = _snapshot(params, opt.inner)
    opt.step()
    amp = opt.strategies["amp"]
    if bad is not None:
        for got, want in zip(_snapshot(params, opt.inner), before):
            np.testing.assert_array_equal(got, want)
        assert all(not p.grad.numpy().any() for p in params)
        assert (amp.skipped_steps, amp.loss_scaling, opt.inner.step_count) == (1, SCALE / 2, 0)
        return
    for p, g in zip(twin_params, scaled):
        p.grad[...] = backend.asarray(g * (np.float32(1) / np.float32(SCALE)))
    twin.step()
    for got, want in zip(_snapshot(params, opt.inner), _snapshot(twin_params, twin)):
        if backend.on_gpu():                      # the kernel rounds as the GPU does
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        else:
            np.testing.assert_array_equal(got, want)
    assert (amp.skipped_steps, amp.loss_scaling, amp.good_steps) == (0, SCALE, 1)

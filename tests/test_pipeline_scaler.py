"""``train_batch(..., scaler=GradScaler)`` as Paddle's PipelineParallel: the loss scaled on the
last stage, the gradients unscaled and checked after the schedule and the data-parallel
averaging, the skip decision agreed by every stage and axis, the scale updated; and
``auto_cast`` around ``train_batch`` computing the schedule's forwards.

An overflow is injected on one stage alone by a ``Trap``: an identity whose parameter gets an
infinite gradient while armed, so the other stage's gradients stay finite and only the
agreement makes it skip. In one process, train_batch with a scaler equals the dygraph scaler
idiom on the same micro-batches (bit for bit: float64, a power-of-two scale); at pp2 (2 ranks),
and pp2 x mp2 and pp2 x dp2 (4 ranks), every rank equals its part of one process with the same
scaler, skips the same step, and ends with the same scale."""
from types import SimpleNamespace

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi import amp, nn, optimizer
from fleetmpi.core import backend
from fleetmpi.autograd import Function, Tensor
from fleetmpi.meta_parallel import ColumnParallelLinear, LayerDesc, PipelineLayer, \
    RowParallelLinear
from fleetmpi.nn.initializer import Constant
from comm_support import close, ok
from strategy_support import make_strategy
from test_pipeline_layer import pipeline_place

STEPS = 4
OVERFLOW_STEP = 2
BATCH, FEATURES, CLASSES = 8, 6, 4
CONFIGS = {"init_loss_scaling": 1024.0, "incr_every_n_steps": 1, "decr_every_n_nan_or_inf": 1}
TRAPS = (0, 8)          # entry indices: the first entry (stage 0) and the last (stage 1)
ARMED = set()           # the traps that give an infinite gradient in this step


class Poison(Function):
    """``x`` unchanged; the gradient of ``trap`` is inf when ``armed``, else zero."""

    def forward(self, x, trap, armed):
        self.shape, self.armed = trap.shape, armed
        return x.copy()

    def backward(self, dy):
        xp = backend.array_module()
        return dy, xp.full(self.shape, xp.inf if self.armed else 0.0, dtype=dy.dtype), None


class Trap(nn.Layer):
    """An identity on the pipeline whose parameter's gradient is inf while ``index`` is in
    ``ARMED`` (zero otherwise, so the parameter stays 0)."""

    def __init__(self, index, dtype):
        super().__init__()
        self.index = index
        self.trap = self.create_parameter([1], dtype=dtype, default_initializer=Constant(0.0))

    def forward(self, x):
        x = x if isinstance(x, Tensor) else fleet.to_tensor(x)
        return Poison.apply(x, self.trap, self.index in ARMED)


def descs(parallel=False, dtype="float64"):
    """Trap, four Linear layers with Tanh between them (Megatron's column/row pairs when
    ``parallel``), Trap: cut uniformly, each stage holds one trap."""
    sizes = [FEATURES, 16, 12, 16, CLASSES]
    if parallel:
        linears = [LayerDesc(ColumnParallelLinear, a, b, has_bias=True, gather_output=False,
                             dtype=dtype) if i % 2 == 0 else
                   LayerDesc(RowParallelLinear, a, b, input_is_parallel=True, dtype=dtype)
                   for i, (a, b) in enumerate(zip(sizes, sizes[1:]))]
    else:
        linears = [LayerDesc(nn.Linear, a, b, dtype=dtype) for a, b in zip(sizes, sizes[1:])]
    entries = [LayerDesc(Trap, TRAPS[0], dtype)]
    for i, desc in enumerate(linears):
        entries += [desc] if i == len(linears) - 1 else [desc, LayerDesc(nn.Tanh)]
    return entries + [LayerDesc(Trap, TRAPS[1], dtype)]


def batch(step, dtype="float64", batch_size=BATCH):
    rng = np.random.default_rng(700 + step)
    return (rng.standard_normal((batch_size, FEATURES)).astype(dtype),
            rng.integers(0, CLASSES, batch_size))


def build(local, topology=None, **kwargs):
    backend.manual_seed(0)
    layer = PipelineLayer(descs(**kwargs), num_stages=2, topology=topology,
                          loss_fn=nn.CrossEntropyLoss(), local=local)
    assert layer.segment_parts == [0, 4, 9]
    return layer


def momentum(parameters):
    return optimizer.Momentum(learning_rate=0.05, momentum=0.9, parameters=parameters)


def configs(batch_size):
    return {"accumulate_steps": 2, "micro_batch_size": batch_size // 2}


def arm(step, trap):
    ARMED.clear()
    if step == OVERFLOW_STEP and trap is not None:
        ARMED.add(trap)


def state(model):
    return {name: p.numpy().copy() for name, p in model.named_parameters()}


def pipeline_run(trap, level=None, dtype="float64", steps=STEPS, **kwargs):
    """One process: the PipelineLayer built whole, trained by train_batch with a GradScaler
    (under ``auto_cast(level=...)`` when ``level``); the parameters after each step, the
    losses, the scaler."""
    fleet.init(is_collective=True, strategy=fleet.DistributedStrategy())
    model = fleet.distributed_model(build(local=True, dtype=dtype, **kwargs))
    opt = fleet.distributed_optimizer(
        momentum(model.parameters()),
        make_strategy(pipeline=True, pipeline_configs=configs(BATCH)), local=True)
    scaler = amp.GradScaler(**CONFIGS)
    after, losses = [], []
    for step in range(steps):
        arm(step, trap)
        x, y = batch(step, dtype)
        with amp.auto_cast(enable=level is not None, level=level or "O1"):
            losses.append(float(model.train_batch([x, y], opt, scaler=scaler)))
        after.append(state(model))
    ARMED.clear()
    return after, losses, scaler


def dygraph_run(trap, level=None, dtype="float64", steps=STEPS):
    """One process, Paddle's dygraph scaler idiom on the same model: per micro-batch
    ``scaler.scale(loss / 2).backward()``, then ``scaler.minimize(opt, scaled)``."""
    layer = build(local=True, dtype=dtype)
    opt = momentum(layer.parameters())
    scaler = amp.GradScaler(**CONFIGS)
    after, losses = [], []
    for step in range(steps):
        arm(step, trap)
        x, y = batch(step, dtype)
        total = 0.0
        for k in range(2):
            part = slice(k * BATCH // 2, (k + 1) * BATCH // 2)
            with amp.auto_cast(enable=level is not None, level=level or "O1"):
                loss = layer.loss_fn(layer(x[part]), y[part])
            scaled = scaler.scale(loss * 0.5)
            scaled.backward()
            total += float(loss) / 2
        scaler.minimize(opt, scaled)
        opt.clear_grad()
        after.append(state(layer))
        losses.append(total)
    ARMED.clear()
    return after, losses, scaler


def assert_same_math(actual, want, err_msg=""):
    """Bit for bit on NumPy; float16 rounding allowed on a GPU, whose products round
    differently from its own other kernels."""
    if backend.on_gpu():
        np.testing.assert_allclose(actual, want, rtol=2 ** -9, atol=2 ** -11, err_msg=err_msg)
    else:
        np.testing.assert_array_equal(actual, want, err_msg=err_msg)


# -- one process ----------------------------------------------------------------------------

@pytest.mark.parametrize("trap", TRAPS, ids=["overflow on stage 0", "overflow on stage 1"])
def test_train_batch_with_a_scaler_is_the_dygraph_scaler_idiom(trap):
    got, got_losses, scaler = pipeline_run(trap)
    want, want_losses, reference = dygraph_run(trap)
    for step, (a, b) in enumerate(zip(got, want)):
        for name in b:
            np.testing.assert_array_equal(a[name], b[name], err_msg=f"step {step}: {name}")
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-13)
    for name in got[OVERFLOW_STEP]:        # the overflowing step changed nothing
        np.testing.assert_array_equal(got[OVERFLOW_STEP][name], got[OVERFLOW_STEP - 1][name])
    # 1024, doubled after each finite step, halved by the skip: 2048, 4096, 2048, 4096
    assert (scaler.skipped_steps, scaler.loss_scaling, scaler.good_steps) == \
        (reference.skipped_steps, reference.loss_scaling, reference.good_steps) == (1, 4096.0, 0)


def test_auto_cast_around_train_batch_computes_the_forwards_in_float16():
    fleet.init(is_collective=True, strategy=fleet.DistributedStrategy())
    seen = []
    layer = build(local=True, dtype="float32")
    # the first layer of stage 1 sees what stage 0's last Linear computed
    layer.run_function[4].register_forward_pre_hook(lambda _, inputs: seen.append(
        inputs[0].dtype))
    got, got_losses, scaler = pipeline_run(None, level="O1", dtype="float32", steps=1)
    want, want_losses, _ = dygraph_run(None, level="O1", dtype="float32", steps=1)
    for name in want[0]:
        assert_same_math(got[0][name], want[0][name], name)
    assert {value.dtype for value in got[0].values()} == {np.dtype("float32")}
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
    model = fleet.distributed_model(layer)
    opt = fleet.distributed_optimizer(
        momentum(model.parameters()),
        make_strategy(pipeline=True, pipeline_configs=configs(BATCH)), local=True)
    with amp.auto_cast():
        model.train_batch(list(batch(0, "float32")), opt, scaler=amp.GradScaler())
    assert seen == [np.dtype("float16")] * 2


def test_a_scaler_is_refused_where_it_cannot_run():
    fleet.init(is_collective=True, strategy=fleet.DistributedStrategy())
    model = fleet.distributed_model(build(local=True, dtype="float32"))
    data = list(batch(0, "float32"))
    with_amp = fleet.distributed_optimizer(
        momentum(model.parameters()), make_strategy(pipeline=True, amp=True), local=True)
    with pytest.raises(ValueError, match="use either strategy.amp or auto_cast"):
        model.train_batch(data, with_amp, scaler=amp.GradScaler())
    plain = momentum(model.parameters())
    with pytest.raises(TypeError, match="of the optimizer fleet.distributed_optimizer "
                                        "returned, not of a Momentum"):
        amp.GradScaler().minimize(plain, model._layers, model.loss_fn, *data)
    pipelined = fleet.distributed_optimizer(momentum(model.parameters()),
                                            make_strategy(pipeline=True), local=True)
    disabled = amp.GradScaler(enable=False)
    before = state(model)
    model.train_batch(data, pipelined, scaler=disabled)       # the optimizer's own step
    assert pipelined.inner.step_count == 1
    assert not np.array_equal(state(model)["1.weight"], before["1.weight"])


# -- several ranks --------------------------------------------------------------------------

def ranks_run(trap, layout=None, distributed=True, level=None, dtype="float64", **kwargs):
    """Every rank: its stage of the PipelineLayer, trained by train_batch with a GradScaler
    (through ``fleet.distributed_scaler`` when ``distributed``) on its replica's share of the
    global batch; ``layout``: hybrid_configs (None: the plain world cut into two stages)."""
    strategy, topology, replicas, replica = pipeline_place(layout)
    layer = build(local=False, topology=topology, dtype=dtype, **kwargs)
    model = fleet.distributed_model(layer)
    strategy.pipeline_configs = configs(BATCH // replicas)
    opt = fleet.distributed_optimizer(momentum(model.parameters()))
    scaler = amp.GradScaler(**CONFIGS)
    if distributed:
        scaler = fleet.distributed_scaler(scaler)
    share = BATCH // replicas
    after, losses = [], []
    for step in range(STEPS):
        arm(step, trap if trap in [t.index for t in layer.sublayers() if isinstance(t, Trap)]
            else None)
        x, y = batch(step, dtype)
        part = slice(replica * share, (replica + 1) * share)
        with amp.auto_cast(enable=level is not None, level=level or "O1"):
            losses.append(float(model.train_batch([x[part], y[part]], opt, scaler=scaler)))
        after.append(state(layer))
    ARMED.clear()
    return layer, after, losses, scaler


def check_equals_one_process(layer, after, scaler, reference, rtol, atol):
    """Every step, this rank's parameters equal its part of the one-process run's; the
    overflowing step changed nothing on this rank; the scale and counters are the
    reference's."""
    from test_hybrid import expected_parts

    want_after, _, want_scaler = reference
    failures = []
    for step, (got, want) in enumerate(zip(after, want_after)):
        parts = expected_parts(layer, SimpleNamespace(state_dict=lambda: want))
        for name, value in got.items():
            if not np.allclose(value, parts[name], rtol=rtol, atol=atol):
                failures.append(f"step {step}: {name}")
    ok(not failures, f"rank {fleet.worker_index()}: {failures}")
    ok(all(np.array_equal(after[OVERFLOW_STEP][n], after[OVERFLOW_STEP - 1][n])
           for n in after[0]), f"rank {fleet.worker_index()} updated on the overflowing step")
    ok((scaler.skipped_steps, scaler.loss_scaling, scaler.good_steps, scaler.bad_steps) ==
       (want_scaler.skipped_steps, want_scaler.loss_scaling, want_scaler.good_steps,
        want_scaler.bad_steps) and scaler.skipped_steps == 1,
       f"rank {fleet.worker_index()}: {scaler.skipped_steps} skipped, scale "
       f"{scaler.loss_scaling}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("distributed", [True, False], ids=["distributed_scaler", "GradScaler"])
@pytest.mark.parametrize("trap", TRAPS, ids=["overflow on stage 0", "overflow on stage 1"])
def test_pp2_with_a_scaler_equals_one_process_and_skips_on_every_rank(trap, distributed):
    fleet.init(is_collective=True)
    if fleet.worker_num() != 2:
        pytest.skip("pp2 at two ranks")
    reference = pipeline_run(trap)
    layer, after, losses, scaler = ranks_run(trap, distributed=distributed)
    ok(layer.stage_id == fleet.worker_index())
    check_equals_one_process(layer, after, scaler, reference, rtol=1e-12, atol=1e-14)
    close(losses, reference[1], rtol=1e-12)


@pytest.mark.mpi(min_size=2)
def test_pp2_under_auto_cast_equals_one_process():
    fleet.init(is_collective=True)
    if fleet.worker_num() != 2:
        pytest.skip("pp2 at two ranks")
    reference = pipeline_run(TRAPS[1], level="O1", dtype="float32")
    layer, after, losses, scaler = ranks_run(TRAPS[1], level="O1", dtype="float32")
    # The same float16 operations on the same micro-batches, but a float32 product's last bit
    # may differ with where BLAS finds its operands (a received activation here, a view in one
    # process), and a float16 rounding can carry that bit on: the parameters agree to 5e-5,
    # while the training moves each weight by more than 1e-2 (checked).
    check_equals_one_process(layer, after, scaler, reference, rtol=0, atol=5e-5)
    first, last = reference[0][0], reference[0][-1]
    ok(all(np.abs(last[name] - first[name]).max() > 200 * 5e-5
           for name in first if name.endswith("weight")))
    close(losses, reference[1], rtol=1e-4)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("trap", TRAPS, ids=["overflow on stage 0", "overflow on stage 1"])
@pytest.mark.parametrize("layout", [{"pp_degree": 2, "mp_degree": 2},
                                    {"pp_degree": 2, "dp_degree": 2}],
                         ids=["pp2-mp2", "pp2-dp2"])
def test_four_ranks_with_a_scaler_equal_one_process_and_skip_together(layout, trap):
    fleet.init(is_collective=True)
    if fleet.worker_num() != 4:
        pytest.skip("layouts of four ranks")
    parallel = {"parallel": True} if "mp_degree" in layout else {}
    reference = pipeline_run(trap, **parallel)
    layer, after, losses, scaler = ranks_run(trap, layout, **parallel)
    check_equals_one_process(layer, after, scaler, reference, rtol=1e-9, atol=1e-11)
    group = fleet.get_hybrid_communicate_group()
    dp = group.get_data_parallel_group()
    mean = np.mean(dp.allgather(np.array(losses), stack=True), axis=0) if dp is not None \
        else np.array(losses)
    close(backend.to_numpy(mean), reference[1], rtol=1e-10)

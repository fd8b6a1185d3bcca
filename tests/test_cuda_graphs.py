"""Whole training steps as CUDA graphs: ``fleetmpi.graphed_step``, ``CUDAGraph`` and the checks
that refuse what a graph cannot capture (``fleetmpi.core.capture_checks``).

Where the arrays are NumPy's (CI), a graphed step runs on the host stand-in ``HostGraph``: its
capture runs the step under the capture checks and its replays run the step's Python again and
write into the static outputs. So CI proves the bookkeeping (static inputs filled by each call
and reused, warm-up calls before the capture, the static output, reset) and every refusal, and
that a graphed step trains bit for bit as the eager one. ``CUDAGraph``'s own bookkeeping (its
own non-default stream current during the capture, the device synchronized first, its memory
pool the process's allocator for the capture and kept with the graph, pools shared by
``pool_id``, the capture abandoned cleanly on an error, replay after capture) is proven against
the CuPy stand-in (``tests/cupy_stand_in``), whose graphs run what their capture recorded, and
so are the tests of CuPy's own arrays (kernels replayed on new inputs, memory freed during a
capture kept from eager work, replays running no Python), which take real CuPy on a GPU.

The prepared GPU command runs this file with ``FLEETMPI_DEVICE=gpu``
(``benchmarks/gpu_run/plan.py``): there the same tests capture real CUDA graphs through CuPy
(the equality tests then compare replayed kernels with eager ones bit for bit, dropout's
generator advanced on the device included). On the H200 every capture of a step with a product
failed at CuPy's cuBLAS wrapper; ``tests/test_gpu_stand_in.py`` fails the same way on the CPU.
"""
import os

import numpy as np
import pytest
from mpi4py import MPI

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from fleetmpi.core import backend, capture_checks
from fleetmpi import autograd, nn, optimizer
from fleetmpi.autograd import Tensor
from fleetmpi.core.capture_checks import CaptureError
from fleetmpi.comm import Communicator, Topology
from fleetmpi.device.cuda.graphs import CUDAGraph, is_cuda_graph_supported
from fleetmpi.device.cuda.host_graph import HostGraph
from fleetmpi.core.knobs import CUDA_GRAPH, OVERLAP_ALLREDUCE

from strategy_support import make_strategy

ON_GPU = backend.on_gpu()
on_host_only = pytest.mark.skipif(ON_GPU, reason="checks the host stand-in, which a GPU "
                                                 "replaces by CUDA graphs")
FEATURES, CLASSES, BATCH = 8, 4, 6


def batches(count, batch=BATCH, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, FEATURES)).astype(np.float32),
             rng.integers(0, CLASSES, batch)) for _ in range(count)]


def momentum(parameters):
    return optimizer.Momentum(learning_rate=0.1, momentum=0.9, parameters=parameters)


def build(make_optimizer=momentum, strategy=None, dropout=False, fused=False, local=True,
          norm=False):
    """``(model, optimizer, train_step)``: a float32 MLP from seed 0 (with a batch norm after
    its first layer with ``norm``) and the documented loop body over it; through
    ``distributed_model`` and ``distributed_optimizer(strategy, local)`` when ``strategy`` is
    given."""
    backend.manual_seed(0)
    layers = [nn.Linear(FEATURES, 16)] + ([nn.BatchNorm1D(16)] if norm else []) + [nn.ReLU()]
    layers += [nn.Dropout(0.25)] if dropout else []
    model = nn.Sequential(*layers, nn.Linear(16, CLASSES))
    opt = make_optimizer(model.parameters())
    opt.fuse_all_optimizer_ops = fused
    if strategy is not None:
        fleet.init(is_collective=True)
        model = fleet.distributed_model(model)
        opt = fleet.distributed_optimizer(opt, strategy, local=local)

    def train_step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        return loss
    return model, opt, train_step


def host(array):
    return backend.to_numpy(autograd.as_array(array)).copy()


def eager_run(train_step, data):
    return [host(train_step(fleet.to_tensor(x), fleet.to_tensor(y)).data) for x, y in data]


def graphed_run(train_step, data, **options):
    step = fleet.graphed_step(train_step, data[0], **options)
    return step, [host(step(x, y).data) for x, y in data]


def assert_same_training(first, second):
    (model_a, opt_a, losses_a), (model_b, opt_b, losses_b) = first, second
    np.testing.assert_array_equal(np.array(losses_a), np.array(losses_b))
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        np.testing.assert_array_equal(host(a.data), host(b.data), err_msg=a.name)
    for (name, a), (_, b) in zip(model_a.named_buffers(), model_b.named_buffers()):
        np.testing.assert_array_equal(host(a), host(b), err_msg=name)
    for a, b in zip(opt_a.inner.run_states if hasattr(opt_a, "inner") else opt_a.run_states,
                    opt_b.inner.run_states if hasattr(opt_b, "inner") else opt_b.run_states):
        for name in a:
            np.testing.assert_array_equal(host(a[name]), host(b[name]), err_msg=name)


SETUPS = {
    "momentum": {},
    "sgd fused": {"make_optimizer": lambda ps: optimizer.SGD(0.1, parameters=ps),
                  "fused": True},
    "global norm clip": {"make_optimizer": lambda ps: optimizer.Momentum(
        0.1, 0.9, parameters=ps, grad_clip=optimizer.ClipGradByGlobalNorm(0.5))},
    "distributed optimizer": {"strategy": make_strategy()},
    "dropout": {"dropout": True},
    "adam": {"make_optimizer": lambda ps: optimizer.Adam(0.01, parameters=ps)},
    "adamw fused": {"make_optimizer": lambda ps: optimizer.AdamW(0.01, parameters=ps),
                    "fused": True},
}


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_a_graphed_step_trains_bit_for_bit_as_the_eager_step(setup):
    data = batches(7)
    model, opt, train_step = build(**SETUPS[setup])
    eager = (model, opt, eager_run(train_step, data))
    model, opt, train_step = build(**SETUPS[setup])
    step, losses = graphed_run(train_step, data, warmup_steps=2)
    assert step.graph is not None and step.graph.captured
    assert_same_training(eager, (model, opt, losses))


def test_calls_fill_the_static_inputs_and_return_the_static_output():
    _, _, train_step = build()
    seen = []

    def recording_step(x, y):
        seen.append((id(x), id(x.data), id(y.data)))
        return train_step(x, y)
    data = batches(6)
    step = fleet.graphed_step(recording_step, data[0], warmup_steps=2)
    outputs = []
    for x, y in data:
        outputs.append(step(x, y))
        np.testing.assert_array_equal(host(step.static_inputs[0].data), x)
        np.testing.assert_array_equal(host(step.static_inputs[1].data), y)
    x_static, y_static = step.static_inputs
    assert set(seen) == {(id(x_static), id(x_static.data), id(y_static.data))}
    assert outputs[0] is not outputs[1] and outputs[1] is not outputs[2]  # warm-up: eager
    assert all(output is step.static_output for output in outputs[2:])
    assert step.calls == 6


def test_the_warm_up_calls_run_before_the_capture():
    _, _, train_step = build()
    data = batches(4)
    step = fleet.graphed_step(train_step, data[0], warmup_steps=3)
    for x, y in data[:3]:
        step(x, y)
        assert step.graph is None
    step(*data[3])
    assert step.graph.captured
    assert isinstance(step.graph, CUDAGraph if ON_GPU else HostGraph)


@pytest.mark.parametrize("change, message", [
    (lambda x, y: (x[:-1], y[:-1]), "input 0 has shape (5, 8) and dtype float32, but its "
                                    "static input has shape (6, 8) and dtype float32"),
    (lambda x, y: (x.astype(np.float64), y), "input 0 has shape (6, 8) and dtype float64"),
    (lambda x, y: (x, y.astype(np.int32)), "input 1 has shape (6,) and dtype int32, but its "
                                           "static input has shape (6,) and dtype int64"),
])
def test_a_batch_of_another_shape_or_dtype_is_refused(change, message):
    _, _, train_step = build()
    data = batches(3)
    step = fleet.graphed_step(train_step, data[0], warmup_steps=1)
    step(*data[0])
    step(*data[1])  # captured
    with pytest.raises(ValueError, match="replays fixed shapes and dtypes") as error:
        step(*change(*data[2]))
    assert message in str(error.value)
    with pytest.raises(TypeError, match="takes 2 inputs"):
        step(data[2][0])
    with pytest.raises(TypeError, match="graphed step input 1 must be a Tensor or an array"):
        step(data[2][0], [1, 2])


HOST_READS = {
    "item": (lambda loss: loss.item(), "Tensor.item()"),
    "numpy": (lambda loss: loss.numpy(), "Tensor.numpy()"),
    "float": (float, "float(tensor)"),
    "int": (int, "int(tensor)"),
    "branch": (lambda loss: 1 if loss > 1 else 0, "a Python branch on a tensor (bool(tensor))"),
    "to_numpy": (lambda loss: backend.to_numpy(loss.data), "backend.to_numpy()"),
    "synchronize": (lambda loss: backend.synchronize(), "backend.synchronize()"),
}


@pytest.mark.parametrize("read", sorted(HOST_READS))
def test_a_host_read_inside_the_captured_step_raises_naming_it(read):
    do, name = HOST_READS[read]
    _, _, train_step = build()

    def reading_step(x, y):
        loss = train_step(x, y)
        do(loss)
        return loss
    data = batches(2)
    step = fleet.graphed_step(reading_step, data[0], warmup_steps=1)
    step(*data[0])  # eager: the read is fine
    with pytest.raises(CaptureError) as error:
        step(*data[1])
    text = str(error.value)
    assert text.startswith(f"{name} cannot run inside a CUDA graph capture (at {__file__}:")
    assert "Read values after the graphed step returns" in text
    assert capture_checks.current is None and step.graph is None
    do(fleet.to_tensor(np.float32(2)))  # outside a capture it reads again


# Float16 amp whose scale moves both ways within a few steps.
AMP_CONFIGS = {"init_loss_scaling": 1024.0, "incr_every_n_steps": 2,
               "decr_every_n_nan_or_inf": 1}
AMP_SETUPS = {
    "dynamic scaling": ({}, {}),
    "fixed scale": ({"use_dynamic_loss_scaling": False}, {}),
    "batch norm": ({}, {"norm": True}),
    "adam fused": ({}, {"make_optimizer": lambda ps: optimizer.Adam(0.01, parameters=ps),
                        "fused": True}),
    "two overflows in a row": ({"decr_every_n_nan_or_inf": 2}, {}),
}


def amp_state(opt):
    amp = opt.strategies["amp"]
    return (amp.loss_scaling, amp.good_steps, amp.bad_steps, amp.skipped_steps)


@pytest.mark.parametrize("setup", sorted(AMP_SETUPS))
def test_a_graphed_amp_step_skips_and_scales_bit_for_bit_as_the_eager_step(setup):
    """Float16 amp with dynamic loss scaling (or a fixed scale) captured: the inf/nan verdict,
    the skip, the scale, the counters and the batch-norm restore stay on the device, and over
    steps that overflow (inf in the batch, after the capture) and steps that do not, the
    graphed step trains as the eager one, bit for bit."""
    configs, options = AMP_SETUPS[setup]
    strategy = make_strategy(amp=True, amp_configs=dict(AMP_CONFIGS, **configs))
    data = batches(8)
    for index in (4, 5):
        data[index][0][1, 2] = np.inf
    model, opt, train_step = build(strategy=strategy, **options)
    eager = (model, opt, eager_run(train_step, data))
    eager_state = amp_state(opt)
    model, opt, train_step = build(strategy=strategy, **options)
    step, losses = graphed_run(train_step, data, warmup_steps=2)
    assert step.graph is not None and step.graph.captured
    assert_same_training(eager, (model, opt, losses))
    assert amp_state(opt) == eager_state
    assert eager_state[3] == 2


@pytest.mark.parametrize("mode, options", [("stop", {}), ("skip", {}), ("skip", {"norm": True})],
                         ids=["stop", "skip", "skip with batch norm"])
def test_a_graphed_step_skips_a_non_finite_step_on_the_device_as_the_eager_step_skips_it(
        mode, options, monkeypatch):
    """The non-finite check without amp captured (``strategies/nonfinite.py``): inside the
    capture nothing is read on the host, and in both modes the step whose batch holds an inf
    is skipped on the device (gradients zeroed, the update launched with the flag; under
    ``skip`` the batch-norm statistics put back too), which trains bit for bit as the eager
    ``skip`` mode, whose verdict is read on the host, and counts the same skipped steps."""
    data = batches(8)
    for index in (4, 6):
        data[index][0][1, 2] = np.inf
    monkeypatch.setenv("FLEETMPI_NONFINITE", "skip")
    model, opt, train_step = build(strategy=make_strategy(), **options)
    eager = (model, opt, eager_run(train_step, data))
    assert opt.strategies["nonfinite_check"].skipped_steps == 2
    monkeypatch.setenv("FLEETMPI_NONFINITE", mode)
    model, opt, train_step = build(strategy=make_strategy(), **options)
    step, losses = graphed_run(train_step, data, warmup_steps=2)
    assert step.graph is not None and step.graph.captured
    assert_same_training(eager, (model, opt, losses))
    assert opt.strategies["nonfinite_check"].skipped_steps == 2


STRATEGIES = {
    "gradient_merge": ({"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}},
                       "whether a step of the k_steps window updates"),
    "localsgd": ({"localsgd": True}, "when to average the parameters"),
    "adaptive_localsgd": ({"adaptive_localsgd": True}, "when to average the parameters"),
    "dgc": ({"dgc": True}, "its rampup"),
    "lamb": ({"lamb": True}, "its bias correction takes step_count from the host"),
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_strategy_that_decides_on_the_host_is_refused_naming_it(name):
    fields, reason = STRATEGIES[name]
    make = (lambda ps: optimizer.Adam(0.01, parameters=ps)) if name == "lamb" else momentum
    _, _, train_step = build(make, strategy=make_strategy(**fields))
    data = batches(2)
    step = fleet.graphed_step(train_step, data[0], warmup_steps=1)
    step(*data[0])
    with pytest.raises(CaptureError, match=f"^strategy {name} cannot run inside a CUDA graph "
                                           f"capture: {reason}"):
        step(*data[1])


@pytest.mark.parametrize("make, message", [
    (lambda ps: optimizer.Momentum(optimizer.lr.StepDecay(0.1, step_size=2), parameters=ps),
     "Momentum.step() with an LRScheduler.*use a fixed learning rate"),
], ids=["lr scheduler"])
def test_an_update_that_reads_host_state_each_step_is_refused(make, message):
    _, _, train_step = build(make)
    data = batches(2)
    step = fleet.graphed_step(train_step, data[0], warmup_steps=1)
    step(*data[0])
    with pytest.raises(CaptureError, match=message.replace("(", r"\(").replace(")", r"\)")):
        step(*data[1])


def test_set_lr_is_refused_while_a_graph_holds_the_update_until_reset():
    _, opt, train_step = build()
    data = batches(4)
    step = fleet.graphed_step(train_step, data[0], warmup_steps=1)
    step(*data[0])
    opt.set_lr(0.05)  # before the capture: the graph will hold 0.05
    step(*data[1])
    with pytest.raises(RuntimeError, match=r"set_lr\(0.01\): .*captured in a CUDA graph with "
                                           r"learning rate 0.05, which every replay keeps"):
        opt.set_lr(0.01)
    step.reset()
    opt.set_lr(0.01)
    step(*data[2])  # captured again, with 0.01
    assert step.graph.captured


def self_communicator():
    return Communicator(Topology(MPI.COMM_SELF), transport="mpi")


@pytest.mark.parametrize("form", ["allreduce", "repeated allreduce", "async allreduce",
                                  "broadcast"])
def test_a_collective_over_the_mpi_transport_inside_the_capture_raises(form):
    communicator = self_communicator()
    out = backend.array_module().zeros((BATCH, FEATURES), np.float32)
    calls = {
        "allreduce": lambda x: communicator.allreduce(x.data),
        "repeated allreduce": lambda x: communicator.allreduce(x.data, out=out),
        "async allreduce": lambda x: communicator.allreduce_async(x.data).wait(),
        "broadcast": lambda x: communicator.broadcast(x.data),
    }

    def step_with_collective(x, y):
        calls[form](x)
        return fleet.to_tensor(np.float32(0))
    data = batches(4)
    step = fleet.graphed_step(step_with_collective, data[0], warmup_steps=2)
    step(*data[0])
    step(*data[1])  # the repeated allreduce is agreed by now and takes its short path
    collective = "broadcast" if form == "broadcast" else "allreduce"
    with pytest.raises(CaptureError, match=f"^the collective '{collective}' over the mpi "
                                           "transport cannot run inside a CUDA graph capture: "
                                           ".*NCCL collectives can"):
        step(*data[2])
    assert capture_checks.current is None
    communicator.allreduce(out, out=out)  # eager again
    communicator.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("overlap", ["0", "1"], ids=["blocking", "overlapped"])
def test_a_data_parallel_graphed_step_over_mpi_raises_on_every_rank(overlap, monkeypatch):
    """The first gradient bucket is refused on every rank before anything is sent or queued,
    so no rank is left waiting in a transfer."""
    monkeypatch.setenv(OVERLAP_ALLREDUCE.name, overlap)
    _, _, train_step = build(strategy=make_strategy(), local=False)
    data = batches(2, batch=BATCH * fleet.worker_num(), seed=fleet.worker_index())
    step = fleet.graphed_step(train_step, data[0], warmup_steps=1)
    step(*data[0])  # eager, over MPI
    with pytest.raises(CaptureError, match="^the collective '.*' over the mpi transport"):
        step(*data[1])
    assert capture_checks.current is None
    fleet.barrier_worker()


def test_reset_drops_the_graph_and_the_next_call_captures_again():
    data = batches(8)
    model, opt, train_step = build()
    eager = (model, opt, eager_run(train_step, data))
    model, opt, train_step = build()
    step = fleet.graphed_step(train_step, data[0], warmup_steps=1)
    losses = [host(step(x, y).data) for x, y in data[:4]]
    first = step.graph
    step.reset()
    assert step.graph is None and step.static_output is None and not first.captured
    with pytest.raises(RuntimeError, match="replay"):
        first.replay()
    losses += [host(step(x, y).data) for x, y in data[4:]]
    assert step.graph is not first and step.graph.captured
    assert_same_training(eager, (model, opt, losses))


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_switched_off_every_call_runs_eagerly(how, monkeypatch):
    data = batches(5)
    model, opt, train_step = build()
    eager = (model, opt, eager_run(train_step, data))
    model, opt, train_step = build()
    if how == "environment":
        monkeypatch.setenv(CUDA_GRAPH.name, "0")
    step, losses = graphed_run(train_step, data, enabled=False if how == "argument" else None)
    assert step.graph is None and step.calls == 5
    assert_same_training(eager, (model, opt, losses))


@pytest.mark.parametrize("kwargs, error, message", [
    ({"warmup_steps": 0}, ValueError, "warmup_steps=0 must be an integer >= 1"),
    ({"warmup_steps": 1.5}, ValueError, "warmup_steps=1.5"),
    ({"example_inputs": ([1.0, 2.0],)}, TypeError, "example input 0 must be a Tensor or an "
                                                    "array, not list"),
    ({"train_step": None}, TypeError, "train_step must be callable"),
    ({"example_inputs": np.zeros(3)}, TypeError, "example_inputs must be a tuple or list of "
                                                 "the step's inputs, not ndarray"),
])
def test_bad_arguments_are_refused(kwargs, error, message):
    arguments = {"train_step": lambda x: x, "example_inputs": (np.zeros(3, np.float32),)}
    arguments.update(kwargs)
    with pytest.raises(error, match=message.replace("[", r"\[")):
        fleet.graphed_step(**arguments)


def test_captures_do_not_nest():
    graph = HostGraph()
    with capture_checks.capturing(graph):
        with pytest.raises(CaptureError, match="captures do not nest"):
            HostGraph().capture(lambda: [])
    assert capture_checks.current is None


@on_host_only
def test_the_host_stand_in_refuses_a_replay_that_takes_another_path():
    _, _, train_step = build()
    data = batches(3)
    count = []

    def changing_step(x, y):
        count.append(1)
        loss = train_step(x, y)
        return loss if len(count) < 3 else (loss, loss)
    step = fleet.graphed_step(changing_step, data[0], warmup_steps=1)
    step(*data[0])
    step(*data[1])
    with pytest.raises(CaptureError, match=r"returned \['float32 \(\)', 'float32 \(\)'\] on "
                                           r"replay but \['float32 \(\)'\] at capture"):
        step(*data[2])


@on_host_only
def test_cuda_graph_needs_a_gpu():
    assert not is_cuda_graph_supported()
    with pytest.raises(RuntimeError, match=r"is_cuda_graph_supported\(\) is False"):
        CUDAGraph()


# -- CUDAGraph's bookkeeping, against the CuPy stand-in (tests/cupy_stand_in) ---------------

@pytest.fixture
def stand_in(gpu_stand_in):
    """The CuPy stand-in's device (``cupy_stand_in.runtime.Runtime``): its streams, allocator,
    work queue and log."""
    return gpu_stand_in.runtime


@pytest.fixture
def device_cupy(request):
    """CuPy on a GPU; on the CPU, the CuPy stand-in, installed as the backend."""
    if ON_GPU:
        import cupy
        return cupy
    return request.getfixturevalue("gpu_stand_in")


def test_capture_records_on_its_own_stream_with_its_own_pool(gpu_stand_in):
    runtime = gpu_stand_in.runtime
    out = gpu_stand_in.zeros(3)
    graph = CUDAGraph()
    out += 1  # eager work before the capture
    graph.capture_begin()
    stream = runtime.current_stream()
    assert stream is not runtime.null and stream.non_blocking
    assert capture_checks.current is graph
    pool = graph._pool.memory
    assert runtime.allocator == pool.malloc
    out *= 10
    scratch = gpu_stand_in.empty(16, np.float32)  # the captured work's memory: the graph's
    graph.capture_end()
    assert runtime.current_stream() is runtime.null
    assert runtime.allocator == runtime.default_pool.malloc and capture_checks.current is None
    np.testing.assert_array_equal(out.get(), 1)  # captured, not run
    graph.replay()
    graph.replay()
    np.testing.assert_array_equal(out.get(), 100)
    assert pool.used_bytes() == 512 and scratch.nbytes == 64  # CuPy's pool rounds to 512
    names = [entry[0] for entry in runtime.log]
    assert names == ["synchronize", "set_allocator", "begin_capture", "end_capture",
                     "set_allocator", "launch", "launch"]
    assert runtime.log[2][2] == 2  # relaxed
    assert runtime.log[5][1] is runtime.null  # replayed on the current stream


@pytest.mark.parametrize("mode, constant", [("global", 0), ("thread_local", 1)])
def test_the_capture_mode_is_passed_to_cupy(stand_in, mode, constant):
    graph = CUDAGraph(mode=mode)
    graph.capture(lambda: None)
    assert [entry[2] for entry in stand_in.log if entry[0] == "begin_capture"] == [constant]


def test_graphs_of_one_pool_id_share_its_pool(stand_in):
    first, second, third, own = (CUDAGraph(pool_id="a"), CUDAGraph(pool_id="a"),
                                 CUDAGraph(pool_id="b"), CUDAGraph())
    for graph in (first, second, third, own):
        graph.capture(lambda: None)
    assert first._pool is second._pool
    assert len({id(g._pool) for g in (first, third, own)}) == 3


def test_an_error_inside_the_capture_ends_it_and_keeps_nothing(stand_in):
    graph = CUDAGraph()

    def failing():
        stand_in.enqueue("kernel", lambda: None)
        raise KeyError("inside")
    with pytest.raises(KeyError, match="inside"):
        graph.capture(failing)
    assert not graph.captured and capture_checks.current is None
    assert stand_in.current_stream() is stand_in.null
    assert stand_in.allocator == stand_in.default_pool.malloc
    assert graph.capture(lambda: 7) == 7 and graph.captured


def test_capture_replay_and_reset_are_refused_out_of_order(stand_in):
    graph = CUDAGraph()
    with pytest.raises(RuntimeError, match="capture_end\\(\\) without capture_begin"):
        graph.capture_end()
    with pytest.raises(RuntimeError, match="replay\\(\\) needs a captured graph"):
        graph.replay()
    graph.capture_begin()
    with pytest.raises(RuntimeError, match="reset\\(\\) while capturing"):
        graph.reset()
    with pytest.raises(CaptureError, match="captures do not nest"):
        CUDAGraph().capture_begin()
    graph.capture_end()
    with pytest.raises(RuntimeError, match="holds a captured graph; reset\\(\\) it"):
        graph.capture_begin()
    graph.reset()
    assert not graph.captured and graph._pool is None


def test_capture_inside_a_thread_local_allocator_is_refused(stand_in):
    stand_in.in_using_allocator = True
    with pytest.raises(RuntimeError, match="cannot capture inside cupy.cuda.using_allocator"):
        CUDAGraph().capture_begin()
    assert capture_checks.current is None and stand_in.current_stream() is stand_in.null


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "eager"}, "mode='eager' must be one of global, thread_local, relaxed"),
    ({"place": 3}, "place=3: this rank drives device 0"),
])
def test_cuda_graph_arguments_are_checked(stand_in, kwargs, message):
    with pytest.raises(ValueError, match=message):
        CUDAGraph(**kwargs)


def test_print_to_dot_files_writes_the_graph(stand_in, tmp_path):
    graph = CUDAGraph()
    graph.capture(lambda: stand_in.enqueue("kernel", lambda: None))
    path = graph.print_to_dot_files(tmp_path / "dot")
    assert os.path.dirname(path) == str(tmp_path / "dot")
    with open(path) as f:
        assert f.read().startswith("digraph captured { // 1 kernels, flags 2047")


def test_a_graphed_step_on_cuda_graphs_captures_then_replays(gpu_stand_in):
    """On a GPU the capture only records: the step runs once by the replay right after it,
    and later calls replay without running the step's Python."""
    total = gpu_stand_in.zeros(3)
    python_calls = []

    def step_kernel(x):
        python_calls.append(1)
        gpu_stand_in.add(total, x.data, out=total)
        return Tensor(total.copy())
    data = [np.full(3, float(2 ** i)) for i in range(5)]
    step = fleet.graphed_step(step_kernel, (data[0],), warmup_steps=2)
    results = [host(step(x).data) for x in data]
    assert isinstance(step.graph, CUDAGraph) and len(python_calls) == 3
    np.testing.assert_array_equal(host(total), np.full(3, 31.0))  # each batch added once
    np.testing.assert_array_equal(results[2:], [np.full(3, 7.0), np.full(3, 15.0),
                                                np.full(3, 31.0)])


# -- CuPy's own arrays: on a GPU, and on the CuPy stand-in on the CPU ------------------------

def test_cupy_kernels_replay_on_new_inputs(device_cupy):
    cupy = device_cupy
    x = cupy.arange(4, dtype=cupy.float32)
    graph = CUDAGraph()
    graph.capture_begin()
    y = x * 2 + 1
    graph.capture_end()
    assert graph._pool.memory.used_bytes() >= y.nbytes  # y lives in the graph's pool
    x[...] = cupy.asarray([10, 20, 30, 40], dtype=cupy.float32)
    graph.replay()
    np.testing.assert_array_equal(cupy.asnumpy(y), [21, 41, 61, 81])


def test_memory_freed_during_the_capture_is_not_handed_to_eager_work(device_cupy):
    cupy = device_cupy
    x = cupy.arange(1 << 16, dtype=cupy.float32)
    y = cupy.empty_like(x)

    def captured():
        temporary = x * 3  # freed at the end of the capture; the graph still writes it
        y[...] = temporary + 1
    graph = CUDAGraph()
    graph.capture(captured)
    garbage = [cupy.full_like(x, -1) for _ in range(8)]  # eager work in the default pool
    graph.replay()
    np.testing.assert_array_equal(cupy.asnumpy(y), cupy.asnumpy(x * 3 + 1))
    assert all(float(g[0]) == -1 for g in garbage)


def test_replays_of_a_graphed_step_run_no_python(device_cupy):
    _, _, train_step = build()
    python_calls = []

    def counted(x, y):
        python_calls.append(1)
        return train_step(x, y)
    data = batches(6)
    step = fleet.graphed_step(counted, data[0], warmup_steps=2)
    for x, y in data:
        step(x, y)
    assert isinstance(step.graph, CUDAGraph) and len(python_calls) == 3


def test_the_readers_skipped_when_naming_the_caller_exist():
    """A moved module would otherwise be named as the place of a refused read."""
    from fleetmpi.core import capture_checks
    assert len(capture_checks._READERS) == 3
    assert all(os.path.isfile(path) for path in capture_checks._READERS)

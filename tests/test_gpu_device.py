"""What only a GPU shows, in one process: NCCL at world size 1 (every collective, each algorithm,
the asynchronous forms, fp16 compression), the order of collectives against the caller's CUDA
stream, transport ``auto`` and its fallback to MPI, the device a rank drives, and training
(optimizers, amp, data parallel and sharding over a communicator) on the backend's arrays.

The prepared GPU command runs this file with ``FLEETMPI_DEVICE=gpu``. Tests that need CuPy and a
CUDA device say so and skip where none is usable; every other test runs on whichever backend
``FLEETMPI_DEVICE`` selects (NumPy in CI) and compares on the host (``backend.to_numpy``), so
CI proves the same checks on NumPy that the GPU run proves on CuPy. Checks of a communicator
run over MPI beside NCCL: on a GPU the MPI transport moves device arrays through host memory.

Existing files already check the rest without caring which backend computes, so the prepared
command runs them with ``FLEETMPI_DEVICE=gpu`` too: ``test_optim.py`` (SGD, Momentum, Adam and
AdamW, fused and unfused, against float64 formulas), ``test_amp.py`` (float16 placement, loss
scaling and its skipped steps, amp against float32), ``test_recompute.py`` (recompute bit for
bit the run without it), ``test_sharding_stages.py`` (stages 1-3 in one process equal the plain
optimizer) and ``test_checkpoint.py`` (resume bit for bit, with dropout's generator state).
``test_multi_gpu.py`` holds the checks across several GPUs.
"""
import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest
from mpi4py import MPI

import fleetmpi as fleet
from fleetmpi.core import backend, job
from fleetmpi import nn, optimizer
from fleetmpi.comm import (Communicator, NCCLUnavailableError, Topology, communicator,
                           transport_nccl)
from fleetmpi.comm.compression import error_bound
from fleetmpi.comm.ops import OPS
from fleetmpi.comm.transport_choice import device_identity
from fleetmpi.kernels import reference
from fleetmpi.core.knobs import AUTO_TRANSPORT
from fleetmpi.core.launcher_env import LOCAL_RANKS

from comm_support import close, ok, rank_data, single_process, tolerance
from strategy_support import STAGES, by_stage, global_batch, make_strategy, train
from test_amp import FP16_ATOL, amp_strategy, mlp32, overflowing_batch
from test_transport_choice import fake_cupy, install
from test_user_model import assert_states_equal
from job_limits import HANG_SECONDS

xp = backend.array_module()
ON_GPU = backend.on_gpu()
NO_GPU = ("needs CuPy and a CUDA device; the arrays here are NumPy's (FLEETMPI_DEVICE=cpu, or "
          "no CUDA device is usable through CuPy)")
needs_gpu = pytest.mark.skipif(not ON_GPU, reason=NO_GPU)
# (Test ids other than "mpi": pytest-mpi takes a keyword "mpi" for its marker.)
TRANSPORTS = [pytest.param("mpi", id="over-mpi"),
              pytest.param("nccl", id="over-nccl", marks=needs_gpu)]
DTYPES = ["float16", "float32", "float64", "int32", "int64"]


def world_of_one(transport, **settings):
    """A communicator over ``MPI.COMM_SELF``: this process alone, whatever job it is in."""
    return Communicator(Topology(MPI.COMM_SELF), transport=transport, **settings)


@pytest.fixture(scope="module", params=TRANSPORTS)
def comm(request):
    """A world of one over each transport (NCCL only on a GPU)."""
    made = world_of_one(request.param)
    yield made
    made.free()


@pytest.fixture(scope="module")
def host_comm():
    """A world of one over MPI, for host NumPy arrays: the result every other must equal."""
    made = world_of_one("mpi")
    yield made
    made.free()


def assert_bits(actual, desired):
    """``actual``, a NumPy or CuPy array, equals the host array ``desired`` bit for bit, dtype
    and shape included."""
    host = backend.to_numpy(actual)
    assert host.dtype == np.asarray(desired).dtype and host.shape == np.shape(desired)
    np.testing.assert_array_equal(host, desired)


# -- every collective over each transport --------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algorithm", [None, "native", "ring", "hierarchical", "shm"])
@pytest.mark.parametrize("op", OPS)
def test_allreduce_of_one_rank_is_its_input_in_every_form(comm, op, algorithm, dtype):
    """A new array, a separate ``out`` (NCCL's send and receive buffers differ) and in place;
    ``x`` itself is left alone."""
    if algorithm == "shm" and comm.transport_name != "mpi":
        pytest.skip("shm reduces in host shared memory: MPI transport only")
    x_host = rank_data(0, 1001, dtype)
    want = single_process(x_host[None], op).astype(dtype)
    x = xp.asarray(x_host)
    out, in_place = xp.empty_like(x), x.copy()
    assert_bits(comm.allreduce(x, op=op, algorithm=algorithm), want)
    assert comm.allreduce(x, op=op, algorithm=algorithm, out=out) is out
    comm.allreduce(in_place, op=op, algorithm=algorithm, out=in_place)
    assert_bits(out, want)
    assert_bits(in_place, want)
    assert_bits(x, x_host)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("algorithm", [None, "ring", "hierarchical"])
def test_fp16_compression_is_within_its_bound_and_equals_the_hosts_bits(comm, host_comm,
                                                                        algorithm, dtype):
    """Blocking, asynchronous, fused (``allreduce_many``) and reduce-scatter forms: within the
    documented bound of the exact sum, and the same bits as the MPI transport on host arrays
    (CuPy's casts to float16 round as NumPy's)."""
    x_host = rank_data(0, 4099, dtype)
    x = xp.asarray(x_host)
    want = host_comm.allreduce(x_host, algorithm=algorithm, compression="fp16")
    exact = x_host.astype(np.float64)
    assert np.all(np.abs(want - exact) <= error_bound(np.abs(exact), comm.size))
    assert_bits(comm.allreduce(x, algorithm=algorithm, compression="fp16"), want)
    assert_bits(comm.allreduce_async(x, algorithm=algorithm, compression="fp16").wait(), want)
    fused = [x.copy(), x[:7].copy()]
    comm.allreduce_many(fused, algorithm=algorithm, compression="fp16")
    assert_bits(fused[0], want)
    assert_bits(fused[1], host_comm.allreduce(x_host[:7], algorithm=algorithm,
                                              compression="fp16"))
    assert_bits(comm.reduce_scatter(x, compression="fp16"),
                host_comm.reduce_scatter(x_host, compression="fp16"))


COLLECTIVES = {  # test id: (method, keyword arguments); each takes the array first
    "broadcast-tree": ("broadcast", {"algorithm": "tree"}),
    "broadcast-chain": ("broadcast", {"algorithm": "chain"}),
    "broadcast-native": ("broadcast", {"algorithm": "native"}),
    "allgather-ring": ("allgather", {}),
    "allgather-native": ("allgather", {"algorithm": "native"}),
    "allgather-stacked": ("allgather", {"stack": True}),
    "allgatherv": ("allgatherv", {"counts": [30]}),
    "reduce_scatter-ring-max": ("reduce_scatter", {"op": "max"}),
    "reduce_scatter-native": ("reduce_scatter", {"algorithm": "native"}),
    "reduce_scatter-counts": ("reduce_scatter", {"counts": [30], "op": "mean"}),
    "alltoall": ("alltoall", {}),
    "gather": ("gather", {}),
    "scatter": ("scatter", {}),
}


def _result(value):
    """The array of a collective's result (alltoall's comes with its splits)."""
    return value[0] if isinstance(value, tuple) else value


@pytest.mark.parametrize("case", sorted(COLLECTIVES))
def test_every_collective_and_its_asynchronous_form_give_the_hosts_result(comm, host_comm,
                                                                          case):
    """The result equals, bit for bit, the MPI transport's on the host arrays, which for one
    rank is the input (stacked, for a stacked allgather)."""
    method, kwargs = COLLECTIVES[case]
    x_host = rank_data(0, 30, np.float32, case=5)
    x = xp.asarray(x_host)
    want = _result(getattr(host_comm, method)(x_host, **kwargs))
    assert_bits(want.reshape(-1), x_host)
    assert_bits(_result(getattr(comm, method)(x, **kwargs)), want)
    if hasattr(comm, f"{method}_async"):
        handle = getattr(comm, f"{method}_async")(x, **kwargs)
        assert_bits(_result(handle.wait()), want)
    assert_bits(x, x_host)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_buckets_spread_over_several_transports_and_barriers_return(transport):
    """``nccl_comm_num=2``: buckets alternate between two transports, each on its own stream;
    fused reductions and broadcasts (blocking and asynchronous) leave the arrays as one rank's
    reduction does, and barriers of both forms return."""
    comm = world_of_one(transport, nccl_comm_num=2)
    shapes = [(7, 3), (0,), (129,), (2, 2, 2), (300,)]
    hosts = [rank_data(0, int(np.prod(s)), np.float32, case=i).reshape(s)
             for i, s in enumerate(shapes)]
    arrays = [xp.asarray(h) for h in hosts]
    comm.allreduce_many(arrays, op="mean", fuse_grad_size_in_MB=1e-3)
    assert comm.allreduce_many_async(arrays, fuse_grad_size_in_MB=1e-3).wait() is None
    comm.broadcast_many(arrays, fuse_broadcast_MB=1e-3)
    for array, host in zip(arrays, hosts):
        assert_bits(array, host)
    comm.barrier()
    assert comm.barrier_async().wait() is None
    assert comm.pending() == 0
    comm.free()


@needs_gpu
def test_nccl_sends_to_its_own_rank_inside_one_group(comm):
    """The transport's ``sendrecv`` to and from rank 0 of a world of one: NCCL pairs the send
    and the receive of one group on one rank."""
    if comm.transport_name != "nccl":
        pytest.skip("the MPI transport moves host arrays; this checks NCCL's")
    transport = comm.transports[0]
    x = xp.arange(1000, dtype=xp.float32)
    y = xp.zeros_like(x)
    with transport.activate():
        transport.sendrecv(x, 0, y, 0)
    assert_bits(y, np.arange(1000, dtype=np.float32))


# -- the order of device work --------------------------------------------------------------

SLOW_FILL = r"""
extern "C" __global__ void slow_fill(float* x, float value, long long n, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x) {
        x[i] = value;
    }
}
"""
# Clock cycles the fill waits before writing: about a quarter of a second at 2 GHz, much
# longer than it takes the host to queue what follows.
SLOW_CYCLES = 500_000_000


def slow_fill(x, value):
    """Queue on the current stream a kernel that waits ``SLOW_CYCLES``, then fills the float32
    array ``x`` with ``value``."""
    kernel = xp.RawKernel(SLOW_FILL, "slow_fill")
    kernel((1,), (256,), (x, np.float32(value), np.int64(x.size), np.int64(SLOW_CYCLES)))


@needs_gpu
@pytest.mark.parametrize("form", ["blocking", "asynchronous"])
def test_a_collective_reads_what_the_callers_stream_wrote_before_it(comm, form):
    """The caller's own stream is still writing ``x`` when the allreduce is queued: the
    reduction reads the written values, and work the caller queues after it sees the result.
    An asynchronous call (and a blocking one over NCCL) returns before the writing is done:
    ordered by events on the device, not by the host."""
    x, out = xp.zeros(1 << 16, xp.float32), xp.zeros(1 << 16, xp.float32)
    comm.allreduce(x, out=out, algorithm="native")  # first call: agreement, NCCL's setup
    backend.synchronize()
    stream = xp.cuda.Stream(non_blocking=True)
    with stream:
        slow_fill(x, 3.0)
        if form == "blocking":
            comm.allreduce(x, out=out, algorithm="native")
        else:
            handle = comm.allreduce_async(x, out=out, algorithm="native")
        busy = not stream.done
        if form == "asynchronous":
            assert handle.wait() is out
        doubled = out * 2
    stream.synchronize()
    if form == "asynchronous" or comm.transport_name == "nccl":
        assert busy, "the collective returned after the caller's stream had finished"
    assert_bits(out, np.full(1 << 16, 3.0, np.float32))
    assert_bits(doubled, np.full(1 << 16, 6.0, np.float32))


@needs_gpu
@pytest.mark.parametrize("form", ["blocking", "asynchronous"])
def test_work_after_an_nccl_collective_waits_for_the_transports_stream(comm, form):
    """The NCCL transport's stream is busy when the allreduce is queued behind that work: what
    the caller queues after the call (or after ``wait()``) still sees the result, since the
    caller's stream waits on an event of the transport's."""
    if comm.transport_name != "nccl":
        pytest.skip("the MPI transport copies through the host, which waits")
    transport_stream = comm.transports[0].stream
    x = xp.full(1 << 16, 5.0, xp.float32)
    out, scratch = xp.zeros_like(x), xp.zeros_like(x)
    backend.synchronize()
    with transport_stream:
        slow_fill(scratch, 1.0)
    caller = xp.cuda.Stream(non_blocking=True)
    with caller:
        if form == "blocking":
            comm.allreduce(x, out=out, algorithm="native")
        else:
            comm.allreduce_async(x, out=out, algorithm="native").wait()
        doubled = out * 2
        busy = not transport_stream.done
    caller.synchronize()
    assert busy, "the transport's stream finished before the caller's work was queued"
    assert_bits(doubled, np.full(1 << 16, 10.0, np.float32))


# -- transport auto, its fallback, and the device of a rank --------------------------------

def test_auto_takes_nccl_for_arrays_on_a_gpu_and_mpi_for_host_arrays():
    comm = world_of_one(AUTO_TRANSPORT)
    identity = device_identity()
    if ON_GPU:
        assert re.fullmatch(r"[^/]+/[0-9A-Fa-f:.]+", identity), identity
    else:
        assert identity is None
    assert comm.transport_name == ("nccl" if ON_GPU else "mpi")
    assert all(t.name == comm.transport_name for t in comm.transports)
    x = xp.asarray(rank_data(0, 33, np.float64))
    assert_bits(comm.allreduce(x), backend.to_numpy(x))
    comm.free()


@pytest.mark.mpi(min_size=2)
def test_ranks_that_share_a_gpu_get_mpi_from_auto_and_ranks_with_their_own_get_nccl():
    """On a machine with fewer GPUs than ranks some ranks drive one device together, so
    ``auto`` must give MPI; with a GPU per rank, NCCL. Either way device arrays reduce."""
    if not ON_GPU:
        pytest.skip(NO_GPU)
    fleet.init()
    world = MPI.COMM_WORLD
    identities = world.allgather(device_identity())
    comm = Communicator(fleet.world.topology(), transport=AUTO_TRANSPORT)
    shared = len(set(identities)) < len(identities)
    ok(comm.transport_name == ("mpi" if shared else "nccl"),
       f"devices {identities}: auto chose {comm.transport_name}")
    x = xp.asarray(rank_data(world.rank, 257, np.float32))
    everyone = np.stack([rank_data(r, 257, np.float32) for r in range(world.size)])
    rtol, atol = tolerance(np.float32, world.size)
    close(backend.to_numpy(comm.allreduce(x)), single_process(everyone, "sum"), rtol=rtol,
          atol=atol)
    comm.free()


def _failing_init(*args):
    raise RuntimeError("simulated: NCCL could not connect")


@pytest.mark.parametrize("step", ["probe", "ncclCommInitRank"])
def test_auto_fallback_to_mpi_with_one_warning_when_nccl_cannot_start(step, monkeypatch,
                                                                      fleetmpi_warnings):
    """NCCL's probe, or NCCL's own start, fails where ``auto`` chose NCCL: the communicator
    runs on MPI (on a GPU: CuPy's real NCCL, one step made to fail; on the host: a stand-in
    CuPy, the rank taken for one with a GPU of its own); one warning names the cause; an
    explicit ``transport="nccl"`` raises it."""
    if not ON_GPU:
        monkeypatch.setattr(communicator, "device_identity", lambda: "host/0000:00:00.0")
    if step == "probe":
        reason = "simulated: no NCCL here"
        monkeypatch.setattr(transport_nccl, "_probe", lambda: reason)
    else:
        reason = "ncclCommInitRank failed (RuntimeError: simulated: NCCL could not connect)"
        if ON_GPU:
            from cupy.cuda import nccl
        else:
            nccl = install(monkeypatch, fake_cupy()).cuda.nccl
        monkeypatch.setattr(nccl, "NcclCommunicator", _failing_init)
    comm = world_of_one(AUTO_TRANSPORT)
    assert comm.transport_name == "mpi" and [t.name for t in comm.transports] == ["mpi"]
    warnings = [m for m in fleetmpi_warnings() if "transport 'auto'" in m]
    assert len(warnings) == 1 and f"rank 0: {reason}" in warnings[0], warnings
    x = xp.asarray(rank_data(0, 65, np.float32))
    result = comm.allreduce(x, op="max")
    assert type(result) is type(x)
    assert_bits(result, backend.to_numpy(x))
    comm.free()
    with pytest.raises(NCCLUnavailableError, match=re.escape(f"rank 0: {reason}")):
        world_of_one("nccl")


def _cupy_with_devices(count, used):
    """A stand-in CuPy with ``count`` devices; ``Device(i).use()`` appends ``i`` to ``used``."""
    def device(index):
        return types.SimpleNamespace(use=lambda: used.append(index))
    runtime = types.SimpleNamespace(getDeviceCount=lambda: count)
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime, Device=device))


@pytest.mark.parametrize("variable", LOCAL_RANKS)
def test_before_fleet_init_a_rank_drives_the_device_of_its_launchers_local_rank(
        variable, monkeypatch):
    """A script (or a test module) that touches the backend before ``fleet.init()`` still puts
    each rank of a node on its own device: ``local_rank % device_count`` with the launcher's
    local rank, not device 0 on every rank."""
    used = []
    monkeypatch.setitem(sys.modules, "cupy", _cupy_with_devices(2, used))
    monkeypatch.setattr(job, "joined", lambda: False)
    monkeypatch.setattr(backend, "memory_fraction", lambda: None)
    for name in LOCAL_RANKS:
        monkeypatch.delenv(name, raising=False)
    assert backend._import_cupy(required=True) is sys.modules["cupy"]
    monkeypatch.setenv(variable, "3")
    backend._import_cupy(required=True)
    assert used == [0, 1]


def test_device_gpu_without_a_usable_gpu_is_an_error_naming_the_variable():
    """``FLEETMPI_DEVICE=gpu`` where CuPy sees no device (here: none made visible) raises,
    naming the variable, instead of falling back to NumPy."""
    code = "from fleetmpi import backend; backend.array_module()"
    env = dict(os.environ, FLEETMPI_DEVICE="gpu", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=HANG_SECONDS)
    assert result.returncode != 0
    assert re.search(r"RuntimeError: FLEETMPI_DEVICE=gpu but (no CUDA device is usable "
                     r"through CuPy|CuPy sees no CUDA device)", result.stderr), result.stderr


# -- training on the backend's arrays ------------------------------------------------------

OPTIMIZERS = {
    "sgd": lambda ps: optimizer.SGD(learning_rate=0.1, parameters=ps, weight_decay=0.01),
    "momentum": lambda ps: optimizer.Momentum(learning_rate=0.05, momentum=0.9, parameters=ps,
                                              weight_decay=0.001),
    "nesterov": lambda ps: optimizer.Momentum(learning_rate=0.05, momentum=0.9, parameters=ps,
                                              use_nesterov=True),
    "adam": lambda ps: optimizer.Adam(learning_rate=0.01, beta1=0.8, beta2=0.95,
                                      parameters=ps, weight_decay=0.01),
    "adamw": lambda ps: optimizer.AdamW(learning_rate=0.01, parameters=ps, weight_decay=0.05),
}


def reference_step(opt, params, grads, states, lr):
    """``opt``'s update of float64 host copies, by ``fleetmpi.kernels.reference``'s math."""
    for p, g, state in zip(params, grads, states):
        if isinstance(opt, optimizer.Adam):
            reference.adam_update(p, g, state["moment1"], state["moment2"], lr, opt.beta1,
                                  opt.beta2, opt.epsilon, opt.step_count, opt.weight_decay,
                                  opt.decoupled, np)
        elif isinstance(opt, optimizer.Momentum):
            reference.momentum_update(p, g, state["velocity"], lr, opt.momentum,
                                      opt.weight_decay, opt.use_nesterov)
        else:
            reference.sgd_update(p, g, lr, opt.weight_decay)


@pytest.mark.parametrize("fused", [False, True], ids=["per parameter", "fused"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_float32_updates_follow_the_float64_reference(name, fused):
    """Four steps of float32 parameters on the backend (fused: one kernel per flat buffer, a
    CUDA kernel on a GPU) against float64 NumPy on the same gradients: within float32
    rounding, ``rtol=1e-5``."""
    backend.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 17), nn.Tanh(), nn.Linear(17, 5))
    params = model.parameters()
    opt = OPTIMIZERS[name](params)
    opt.fuse_all_optimizer_ops = fused
    wide = [backend.to_numpy(p.data).astype(np.float64) for p in params]
    states = [{key: np.zeros(p.shape) for key in opt.state_names} for p in params]
    rng = np.random.default_rng(1)
    for _ in range(4):
        grads = [rng.standard_normal(p.shape).astype(np.float32) for p in params]
        for p, g in zip(params, grads):
            p.grad[...] = backend.asarray(g)
        opt.step()
        reference_step(opt, wide, [g.astype(np.float64) for g in grads], states, opt.get_lr())
    for p, want in zip(params, wide):
        assert p.data.dtype == np.float32
        np.testing.assert_allclose(backend.to_numpy(p.data), want, rtol=1e-5, atol=1e-6)


AMP_STEPS, OVERFLOW_STEP = 6, 2


def test_amp_skips_an_overflowing_step_and_otherwise_follows_float32():
    """float16 with dynamic loss scaling, whose step ``OVERFLOW_STEP`` overflows to inf and is
    skipped, against the same model in float32 trained on the other steps' batches: the skip
    leaves no trace. After five updates the parameters (all below 1) stay within one float16
    rounding unit at 1 (``FP16_ATOL``; 7.5e-5 measured on NumPy), the losses within 0.1%
    (1e-4 measured)."""
    model, opt, losses = train(amp_strategy(), steps=AMP_STEPS, make_model=mlp32,
                               batch=overflowing_batch({OVERFLOW_STEP}), local=True)
    amp = opt.strategies["amp"]
    assert (amp.skipped_steps, opt.inner.step_count) == (1, AMP_STEPS - 1)
    assert [np.isfinite(loss) for loss in losses] == [s != OVERFLOW_STEP for s in range(AMP_STEPS)]
    kept = [s for s in range(AMP_STEPS) if s != OVERFLOW_STEP]
    plain, _, plain_losses = train(make_strategy(), steps=len(kept), make_model=mlp32,
                                   batch=lambda i: global_batch(kept[i]), local=True)
    np.testing.assert_allclose([losses[s] for s in kept], plain_losses, rtol=1e-3)
    assert_states_equal(model, plain, check=close, rtol=0, atol=FP16_ATOL)


def adam(parameters):
    return optimizer.Adam(learning_rate=0.01, parameters=parameters)


@pytest.mark.parametrize("stage", STAGES)
def test_training_over_a_world_of_one_is_the_plain_optimizer_bit_for_bit(comm, stage):
    """Data parallel and sharding stages 1-3 through a communicator of one rank (on a GPU over
    NCCL too, gradients reduced on the communicator's stream) equal the plain optimizer with
    no communication, losses and parameters bit for bit."""
    model, opt, losses = train(by_stage(stage), make_optimizer=adam, communicator=comm)
    assert opt.communicator is comm
    plain, _, plain_losses = train(make_strategy(), make_optimizer=adam, local=True)
    assert losses == plain_losses
    assert_states_equal(model, plain)

"""The trainer's GPU branches on the CPU, over the CuPy stand-in (``tests/cupy_stand_in``, the
``gpu_stand_in`` fixture): what the H200 run showed, made to show here first.

* An eager training step of the MLP, GPT-tiny and ResNet-20 as ``benchmarks/train_throughput.py``
  trains them (fused optimizer update, amp through the strategy or ``auto_cast`` with a
  ``GradScaler``) takes the GPU branches (fused RawKernels compiled for the host, no cuDNN) and
  matches the NumPy backend's step.
* What CuPy 14 refuses while a stream captures is refused, with CuPy's error types and
  messages, and a captured graph replays its work.
* A graphed step with a matrix product fails at CuPy's cuBLAS wrapper, as every such test of
  ``test_cuda_graphs.py`` failed on the H200: strict xfails until the products go through
  cuBLASLt.
* What one eager step asks of the device: kernel launches, library calls, allocations, host
  waits.
"""
import contextlib
import ctypes
import os

import numpy as np
import pytest

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from fleetmpi import amp, autograd, nn, optimizer
from fleetmpi.comm import release_communicators
from fleetmpi.core import backend
from fleetmpi.core.knobs import NONFINITE
from fleetmpi.device.cuda.graphs import CUDAGraph
from fleetmpi.nn.functional import cudnn

from cupy_stand_in import library_call
from cupy_stand_in.runtime import CUDADriverError, CUDARuntimeError, INVALIDATED
import test_cuda_graphs
from test_cuda_graphs import AMP_SETUPS, SETUPS, make_strategy

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks")
CUBLAS = "calling cuBLAS API during stream capture is currently unsupported"
D2H = "the current stream is capturing, so D2H transfers are disallowed"
H2D = "the current stream is capturing, so H2D transfers are disallowed"
# model: (builder, input shape, classes, optimizer, learning rate)
MODELS = {
    "mlp": (lambda: nn.MLP([784, 1024, 1024, 10]), (32, 784), 10, optimizer.Momentum, 0.01),
    "gpt": (lambda: nn.GPT(vocab_size=96, block_size=64, n_layer=4, n_head=4, n_embd=128),
            (2, 64), 96, optimizer.AdamW, 1e-4),
    "resnet20": (nn.resnet20, (2, 3, 32, 32), 10, optimizer.Momentum, 0.01),
}
CASES = [("mlp", "fp32"), ("mlp", "amp"), ("mlp", "auto_cast"), ("gpt", "fp32"),
         ("gpt", "amp"), ("resnet20", "fp32"), ("resnet20", "amp")]
# The transformer's and the convolutional network's kernels captured, with amp's verdict on
# the device (the MLP's setups, the non-finite check's included: test_cuda_graphs.py's).
GRAPHED_CASES = [("gpt", "amp"), ("resnet20", "amp")]


def host(array):
    return backend.to_numpy(autograd.as_array(array)).copy()


def model_data(name):
    """One batch of ``name``'s inputs and labels, on the host (a GPT's: tokens and the next
    token of each)."""
    _, shape, classes, _, _ = MODELS[name]
    rng = np.random.default_rng(0)
    if name == "gpt":
        tokens = rng.integers(0, classes, (shape[0], shape[1] + 1))
        return np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])
    return rng.standard_normal(shape, dtype=np.float32), rng.integers(0, classes, shape[0])


class Trainer:
    """Model ``name`` from seed 0 trained as the benchmark trains it, in ``precision``:
    ``fp32`` or ``amp`` (a distributed optimizer with the fuse_* switches and, for ``amp``,
    the amp strategy), or ``auto_cast`` (a plain optimizer with ``fleetmpi.amp.auto_cast`` and
    a ``GradScaler``). ``step()`` runs one step of the dygraph loop and returns its loss and
    the gradients the backward made (before the update), on the host (``read=False``: reads
    nothing)."""

    def __init__(self, name, precision):
        make, _, _, make_optimizer, lr = MODELS[name]
        fleet.init(is_collective=True)
        backend.manual_seed(0)
        self.model = make()
        opt = make_optimizer(learning_rate=lr, parameters=self.model.parameters())
        self.scaler = None
        if precision == "auto_cast":
            opt.fuse_all_optimizer_ops = True
            self.scaler = amp.GradScaler(init_loss_scaling=1024.0)
        else:
            strategy = make_strategy(fuse_all_optimizer_ops=True, fuse_elewise_add_act_ops=True,
                                     amp=precision == "amp")
            self.model = fleet.distributed_model(self.model)
            opt = fleet.distributed_optimizer(opt, strategy)
        self.opt, self.loss_fn = opt, nn.CrossEntropyLoss()
        self.x, self.y = (fleet.to_tensor(a) for a in model_data(name))

    def step(self, read=True):
        with amp.auto_cast(enable=self.scaler is not None):
            loss = self.loss_fn(self.model(self.x), self.y)
        scaled = loss if self.scaler is None else self.scaler.scale(loss)
        scaled.backward()
        grads = [host(p.grad) for p in self.model.parameters()] if read else None
        if self.scaler is None:
            self.opt.step()
        else:
            self.scaler.minimize(self.opt, scaled)
        self.opt.clear_grad()
        return (host(loss.data), grads) if read else None

    def train_step(self, x, y):
        """The documented loop body, for ``fleet.graphed_step`` (fp32 and amp)."""
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.clear_grad()
        return loss

    def parameters(self):
        return [host(p.data) for p in self.model.parameters()]


def one_step(name, precision):
    """``(loss, gradients, parameters after the update)`` of one step of a new trainer."""
    trainer = Trainer(name, precision)
    loss, grads = trainer.step()
    return loss, grads, trainer.parameters()


@pytest.mark.parametrize("name, precision", CASES)
def test_an_eager_step_on_the_gpu_branches_matches_the_numpy_step(name, precision, request):
    """The loss and gradients agree to float tolerance, not bit for bit: the fused kernels
    sum and order their float32 arithmetic as a GPU would (one thread walking a row, a
    device-side exp), not as the NumPy references do. Float16 products are the exact sum
    rounded once on both branches (``fleetmpi/kernels/products.py``), the same bits, so
    ResNet-20's amp forward gives its ReLUs the same inputs on both: a ReLU input on the other
    side of zero in one step would switch its element's gradient on or off, which moves
    ResNet-20's gradients at a batch of 2 by up to 40% of a layer's largest
    (``test_amp_numerics.py``). With float32 sums, in the cuBLASLt stand-in's order and in the
    order of the CPU's OpenBLAS kernel, ResNet-20's amp step failed here with OpenBLAS's
    Haswell kernel (38%) and passed with its SkylakeX one. A momentum update moves the
    parameters by the gradients; Adam's first update is ``lr * sign(gradient)``, so a gradient
    that is zero up to rounding can move its parameter by ``lr`` either way."""
    expected = one_step(name, precision)
    release_communicators()
    cupy = request.getfixturevalue("gpu_stand_in")
    with cupy.counting() as counts:
        got = one_step(name, precision)
    assert counts.kernels["softmax_cross_entropy_forward_float32"] + counts.kernels[
        "softmax_cross_entropy_forward_float16_float32"] == 1  # a fused RawKernel ran
    assert counts.library_calls["cublasLt"] and not counts.library_calls["cublas"]
    assert cudnn.unusable_reason() is not None
    tolerance = 1e-2 if precision != "fp32" else 1e-5
    np.testing.assert_allclose(got[0], expected[0], rtol=tolerance)
    for index, (a, b) in enumerate(zip(got[1], expected[1])):
        scale = max(float(np.abs(b).max()), 1e-30)
        np.testing.assert_allclose(a / scale, b / scale, atol=tolerance, err_msg=f"grad {index}")
    lr = MODELS[name][4]
    moved = 2 * lr if MODELS[name][3] is optimizer.AdamW else tolerance * lr
    for index, (a, b) in enumerate(zip(got[2], expected[2])):  # and a float32 rounding unit
        np.testing.assert_allclose(a, b, atol=moved, rtol=1e-6, err_msg=f"parameter {index}")


# -- the trainer's GPU branch reads nothing back on the host --------------------------------------

def _lookup_and_loss():
    """An embedding lookup, a batch norm and a cross entropy over it, as a function of no
    arguments returning the loss."""
    rng = np.random.default_rng(0)
    ids = fleet.to_tensor(rng.integers(0, 10, (4, 3)))
    weight = fleet.to_tensor(rng.standard_normal((10, 5)).astype(np.float32),
                             stop_gradient=False)
    labels, norm = fleet.to_tensor(rng.integers(0, 5, 12)), nn.BatchNorm1D(5)
    return lambda: F.cross_entropy(norm(F.embedding(ids, weight).reshape([12, 5])), labels)


def test_embedding_batch_norm_and_cross_entropy_wait_for_nothing(gpu_stand_in):
    """On the GPU branch the embedding's index check and cross entropy's label check read
    device arrays back (twice a call each) and batch norm its count: 11 host waits a GPT-tiny
    step, 24 a ResNet-20 step, and inside a capture CuPy refuses each. Now none is read, and
    their forward is captured (batch norm's backward multiplies through cuBLAS)."""
    step = _lookup_and_loss()
    step()  # what is made lazily
    with gpu_stand_in.counting() as counts:
        step().backward()
    assert counts.syncs == 0
    graph = CUDAGraph()
    captured = graph.capture(step)
    graph.replay()
    np.testing.assert_array_equal(host(captured.data), host(step().data))


def test_labels_and_indices_out_of_range_give_nan_rows_on_the_device(gpu_stand_in):
    """Where nothing is read back, a label or an index outside its range is a NaN row (the
    NumPy backend raises a ValueError naming the range, ``test_nn.py``)."""
    logits = fleet.to_tensor(np.zeros((3, 4), np.float32), stop_gradient=False)
    loss = F.cross_entropy(logits, fleet.to_tensor(np.array([0, 4, -1])), reduction="none")
    loss.backward(fleet.to_tensor(np.ones(3, np.float32)))
    assert np.isnan(host(loss.data)).tolist() == [False, True, True]
    assert np.isnan(host(logits.grad)).all(axis=1).tolist() == [False, True, True]
    weight = fleet.to_tensor(np.ones((10, 2), np.float32))
    rows = F.embedding(fleet.to_tensor(np.array([1, 10, -1])), weight)
    assert np.isnan(host(rows.data)).all(axis=1).tolist() == [False, True, True]


# -- what CuPy 14 refuses while a stream captures ------------------------------------------------

@pytest.fixture
def capturing(gpu_stand_in):
    """A stream of its own capturing (current inside the block), as ``CUDAGraph`` makes one;
    the fixture's value is ``(cupy, stream)``; the capture is ended afterwards."""
    stream = gpu_stand_in.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        yield gpu_stand_in, stream
    if stream.capture is not None:
        with contextlib.suppress(CUDARuntimeError):  # one a test invalidated
            stream.end_capture()


def operands(cupy):
    return (cupy.asarray(np.arange(6, dtype=np.float32).reshape(2, 3)),
            cupy.asarray(np.ones((3, 2), np.float32)))


@pytest.mark.parametrize("product", [
    lambda cupy, a, b: a @ b, lambda cupy, a, b: cupy.matmul(a, b),
    lambda cupy, a, b: cupy.dot(a, b), lambda cupy, a, b: a.dot(b),
    lambda cupy, a, b: cupy.tensordot(a, b, axes=1),
    lambda cupy, a, b: cupy.einsum("ij,jk->ik", a, b),
    lambda cupy, a, b: cupy.einsum("nci,nci->c", a[None], b.T[None])],
    ids=["@", "matmul", "dot", "ndarray.dot", "tensordot", "einsum", "einsum batched"])
def test_a_cublas_call_inside_a_capture_raises_cupys_not_implemented_error(gpu_stand_in,
                                                                          product):
    a, b = operands(gpu_stand_in)
    expected = product(np, host(a), host(b))
    np.testing.assert_array_equal(host(product(gpu_stand_in, a, b)), expected)  # eager
    stream = gpu_stand_in.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        with pytest.raises(NotImplementedError, match=f"^{CUBLAS}$"):
            product(gpu_stand_in, a, b)
        stream.end_capture()  # the refusal is CuPy's own: the capture stays valid


def test_elementwise_work_and_reductions_are_captured_and_replayed(gpu_stand_in):
    cupy = gpu_stand_in
    x = cupy.zeros(4, np.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        y = cupy.einsum("i->", x * 2 + 1)  # an einsum that contracts nothing: no cuBLAS
        x += 1
        graph = stream.end_capture()
    assert float(y) == 4.0 and float(x.sum()) == 0.0  # y made while recorded; x untouched
    graph.launch()
    graph.launch()
    assert float(x.sum()) == 8.0 and float(y) == 4 * (2 * 1 + 1)  # from x as replay 2 found it


HOST_READS = {
    "get": lambda cupy, x: x.get(), "asnumpy": lambda cupy, x: cupy.asnumpy(x),
    "float": lambda cupy, x: float(x), "int": lambda cupy, x: int(x),
    "bool": lambda cupy, x: bool(x[0]), "item": lambda cupy, x: x[0].item(),
    "tolist": lambda cupy, x: x.tolist(), "boolean mask": lambda cupy, x: x[x > 0],
}


@pytest.mark.parametrize("read", sorted(HOST_READS))
def test_a_copy_to_the_host_inside_a_capture_raises_cupys_runtime_error(capturing, read):
    cupy, _ = capturing
    x = cupy.ones(1, np.float32)
    with pytest.raises(RuntimeError, match=f"^{D2H}$"):
        HOST_READS[read](cupy, x)


def test_a_copy_from_the_host_inside_a_capture_raises_and_a_scalar_is_a_fill(capturing):
    cupy, stream = capturing
    with pytest.raises(RuntimeError, match=f"^{H2D}$"):
        cupy.asarray(np.ones(3, np.float32))
    with pytest.raises(RuntimeError, match=f"^{H2D}$"):
        cupy.zeros(3)[np.array([0, 1])]  # CuPy copies NumPy indices to the device
    scalar = cupy.asarray(np.float32(5))  # a 0-d value is a fill kernel, which is captured
    graph = stream.end_capture()
    graph.launch()
    assert float(scalar) == 5.0


@pytest.mark.parametrize("wait", ["stream", "device", "backend"])
def test_a_synchronize_inside_a_capture_raises_and_invalidates_it(capturing, wait):
    cupy, stream = capturing
    x = cupy.zeros(2)
    synchronize = {"stream": stream.synchronize, "device": cupy.cuda.Device().synchronize,
                   "backend": lambda: cupy.cuda.get_current_stream().synchronize()}[wait]
    with pytest.raises(CUDARuntimeError, match="^cudaErrorStreamCaptureUnsupported: operation "
                                               "not permitted when stream is capturing$"):
        synchronize()
    with pytest.raises(CUDADriverError, match="CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"):
        x += 1
    with pytest.raises(RuntimeError, match=f"^{INVALIDATED}$"):
        x.get()
    with pytest.raises(CUDARuntimeError, match="^cudaErrorStreamCaptureInvalidated"):
        stream.end_capture()
    assert float(x.sum()) == 0.0  # after the capture, eager again


def test_waiting_on_an_event_recorded_outside_the_capture_is_refused(gpu_stand_in):
    cuda = gpu_stand_in.cuda
    before = cuda.get_current_stream().record()
    stream = cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        with pytest.raises(CUDARuntimeError, match="^cudaErrorStreamCaptureIsolation"):
            stream.wait_event(before)
        with pytest.raises(CUDARuntimeError, match="^cudaErrorStreamCaptureInvalidated"):
            stream.end_capture()


def test_an_event_recorded_inside_the_capture_forks_it_and_cannot_be_waited_on(capturing):
    cupy, stream = capturing
    x = cupy.zeros(2)
    inside = stream.record()
    with pytest.raises(CUDARuntimeError, match="^cudaErrorCapturedEvent"):
        inside.synchronize()
    side = cupy.cuda.Stream(non_blocking=True)
    side.wait_event(stream.record())  # the side stream joins the capture, as in CUDA's fork
    with side:
        x += 1
    stream.wait_event(side.record())
    graph = stream.end_capture()
    assert float(x.sum()) == 0.0 and not side.is_capturing()
    graph.launch()
    assert float(x.sum()) == 2.0


def test_numpy_arrays_are_refused_as_cupy_refuses_them(gpu_stand_in):
    """What CuPy raises where host and device arrays mix (the first of these failed the
    H200's fused-kernel tests)."""
    x, host_array = gpu_stand_in.zeros(3, np.float32), np.ones(3, np.float32)
    with pytest.raises(TypeError, match="expected cupy._core.core._ndarray_base, got ndarray"):
        gpu_stand_in.ascontiguousarray(host_array)
    with pytest.raises(TypeError, match="^Unsupported type <class 'numpy.ndarray'>$"):
        x + host_array
    with pytest.raises(TypeError, match="^Implicit conversion to a NumPy array is not allowed"):
        np.asarray(x)
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray cannot be used for copyto"):
        gpu_stand_in.copyto(x, host_array)
    kernel = gpu_stand_in.RawModule(code='extern "C" __global__ void k(float* x) {}')
    with pytest.raises(TypeError, match="^Unsupported type <class 'numpy.ndarray'>$"):
        kernel.get_function("k")((1,), (1,), (host_array,))


def test_a_captured_draw_draws_anew_at_each_replay(gpu_stand_in):
    cupy = gpu_stand_in
    generator = cupy.random.default_rng(7)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        draws = generator.random((4,), dtype=np.float32)
        graph = stream.end_capture()
    seen = []
    for _ in range(2):
        graph.launch()
        seen.append(draws.get())
    assert not np.array_equal(seen[0], seen[1])
    again = cupy.random.default_rng(7)
    np.testing.assert_array_equal(seen[0], again.random((4,), dtype=np.float32).get())


def test_a_library_call_through_the_hook_is_counted_captured_and_replayed(gpu_stand_in):
    """``cupy_stand_in.library_call``: how a stand-in of cuBLASLt or cuDNN, which reads and
    writes device memory at its addresses, queues its work on the stand-in's streams."""
    x = gpu_stand_in.zeros(2)
    memory = np.ctypeslib.as_array((ctypes.c_double * 2).from_address(x.data.ptr))
    stream = gpu_stand_in.cuda.Stream(non_blocking=True)
    with gpu_stand_in.counting() as counts, stream:
        stream.begin_capture()
        library_call("cublasLt", "matmul", lambda: np.add(memory, 1, out=memory))
        graph = stream.end_capture()
    assert counts.library_calls == {"cublasLt": 1} and counts.launches == 0
    assert float(x.sum()) == 0.0
    graph.launch()
    graph.launch()
    assert float(x.sum()) == 4.0


# -- a graphed step captures, its products through cuBLASLt --------------------------------------

@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_graphed_step_of_a_benchmark_model_captures_with_no_cublas_call(gpu_stand_in, name):
    """On the H200 every captured step failed at CuPy's cuBLAS wrapper; here each product of
    the step is a cuBLASLt call, queued on the capturing stream, and CuPy's cuBLAS is never
    called."""
    trainer = Trainer(name, "fp32")
    step = fleet.graphed_step(trainer.train_step, (trainer.x, trainer.y), warmup_steps=1)
    with gpu_stand_in.counting() as counts:
        for _ in range(3):
            step(trainer.x, trainer.y)
    assert isinstance(step.graph, CUDAGraph)
    assert counts.library_calls["cublasLt"] and not counts.library_calls["cublas"], counts


def test_the_benchmarks_kernel_count_captures_a_gpt_step(gpu_stand_in, monkeypatch):
    """``benchmarks/throughput_run/kernels.py`` counts a step's kernels by capturing it with
    CuPy's stream capture alone. On the H200 the GPT-2 rows gave no count: "the step does not
    capture (RuntimeError: the current stream is capturing, so D2H transfers are
    disallowed)", the embedding's index check reading the ids back; now nothing is read, and
    the products are cuBLASLt's."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    from throughput_run.kernels import _captured

    trainer = Trainer("gpt", "fp32")
    trainer.step(read=False)
    graph, failure = _captured(lambda: trainer.step(read=False))
    if failure is not None:
        raise failure
    assert graph is not None


@pytest.mark.parametrize("setup", sorted(SETUPS) + [f"amp {name}" for name in sorted(AMP_SETUPS)])
def test_a_graphed_mlp_step_trains_bit_for_bit_as_the_eager_one_on_cuda_graphs(
        gpu_stand_in, setup):
    """The equality tests of ``test_cuda_graphs.py`` on CUDA graphs over the stand-in, with
    CuPy's refusals in force: the step's products run through cuBLASLt."""
    if setup.startswith("amp "):
        test_cuda_graphs.test_a_graphed_amp_step_skips_and_scales_bit_for_bit_as_the_eager_step(
            setup[4:])
    else:
        test_cuda_graphs.test_a_graphed_step_trains_bit_for_bit_as_the_eager_step(setup)


@pytest.mark.parametrize("name, precision", GRAPHED_CASES,
                         ids=[f"{n}-{p}" for n, p in GRAPHED_CASES])
def test_a_graphed_model_step_trains_bit_for_bit_as_the_eager_one_on_cuda_graphs(
        gpu_stand_in, name, precision):
    """The same for GPT-tiny and ResNet-20: their fused kernels, the embedding, batch norm
    and amp captured and replayed, bit for bit as the eager step."""
    results = []
    for enabled in (False, True):
        trainer = Trainer(name, precision)
        step = fleet.graphed_step(trainer.train_step, (trainer.x, trainer.y), warmup_steps=1,
                                  enabled=enabled)
        losses = [host(step(trainer.x, trainer.y).data) for _ in range(3)]
        results.append((losses, trainer.parameters(), step.graph))
        release_communicators()
    (eager, eager_parameters, _), (graphed, parameters, graph) = results
    assert isinstance(graph, CUDAGraph)
    np.testing.assert_array_equal(graphed, eager)
    for a, b in zip(parameters, eager_parameters):
        np.testing.assert_array_equal(a, b)


# -- what one eager step asks of the device ------------------------------------------------------

# cuBLASLt calls of one step: three per product (forward, and the gradients of both operands),
# less the input gradient of a first layer. The MLP: 3 Linear layers. GPT-tiny: 4 per
# transformer block (qkv, projection, the feed-forward's two) and the tied head; attention is
# attention.cu's. ResNet-20 without cuDNN: 21 convolutions as im2col products and the
# classifier (batch norm's per-channel sums are reductions).
PRODUCTS = {"mlp": 3 * 3 - 1, "gpt": 3 * (4 * 4 + 1), "resnet20": 3 * 22 - 1}
# What a step waits for on the host: the verdict of the non-finite check (fp32), of amp's
# overflow check (amp), of GradScaler.step (auto_cast).
OPTIMIZER_KERNELS = {"mlp": "multi_tensor_momentum_float32",
                     "gpt": "multi_tensor_adam_float32",
                     "resnet20": "multi_tensor_momentum_float32"}


def step_counts(cupy, name, precision, steps=3):
    """The ``Counts`` of each of ``steps`` eager steps of a new trainer."""
    trainer = Trainer(name, precision)
    counts = []
    for _ in range(steps):
        with cupy.counting() as record:
            trainer.step(read=False)
        counts.append(record)
    return counts


@pytest.mark.parametrize("name, precision", CASES, ids=[f"{n}-{p}" for n, p in CASES])
def test_what_an_eager_step_asks_of_the_device(gpu_stand_in, name, precision):
    first, second, third = step_counts(gpu_stand_in, name, precision)
    assert third.syncs == 1  # the step's verdict on inf and NaN, read on the host
    assert third.library_calls == {"cublasLt": PRODUCTS[name]}
    assert third.kernels[OPTIMIZER_KERNELS[name]] == 1  # the whole update: one launch
    check = "multi_tensor_check_finite_float32" if precision == "fp32" else \
        "multi_tensor_unscale_float32"
    assert third.kernels[check] == 1  # the whole check of the gradients: one launch
    assert first.host_to_device > 0 and second.host_to_device == third.host_to_device == 0
    assert (second.launches, second.kernels) == (third.launches, third.kernels)
    assert second.allocations == third.allocations <= first.allocations
    assert third.new_memory == 0  # served by the blocks the step before freed
    assert third.graph_launches == 0


@pytest.mark.parametrize("name", sorted(MODELS))
def test_an_eager_fp32_step_without_the_non_finite_check_waits_for_nothing(
        gpu_stand_in, name, monkeypatch):
    monkeypatch.setenv(NONFINITE.name, "off")
    *_, last = step_counts(gpu_stand_in, name, "fp32", steps=2)
    assert last.syncs == 0 and last.kernels["multi_tensor_check_finite_float32"] == 0

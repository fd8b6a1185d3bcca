"""Tensor-parallel layers against their serial layers: at N ranks (the whole world one
model-parallel group, N = 2, 3 or 4) every rank's part of the initial weight is its slice of
the serial layer's initial weight from the same seed, the forward equals the serial forward,
and the gradients of the input and of the rank's parameters equal the serial gradients (their
slices); the parallel cross entropy equals the serial one without the logits ever gathered.
Alone (a group of one) each layer is its serial layer."""
import numpy as np
import pytest

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from fleetmpi.core import backend
from fleetmpi import nn, to_tensor
from fleetmpi.comm import get_communicator
from comm_support import close, equal, host, raises

IN, OUT, VOCAB, ROWS = 12, 24, 24, 5
TOL = {"rtol": 1e-10, "atol": 1e-12}


def group():
    fleet.init(is_collective=True)
    return get_communicator()


def inputs(shape, seed):
    """The same values on every rank."""
    return np.random.default_rng(seed).standard_normal(shape)


def part(array, comm, axis):
    width = array.shape[axis] // comm.size
    index = [slice(None)] * array.ndim
    index[axis] = slice(comm.rank * width, (comm.rank + 1) * width)
    return array[tuple(index)]


def run(layer, x, upstream):
    """``layer(x)``, and after backward of ``sum(output * upstream)`` the input's gradient."""
    x = to_tensor(x, stop_gradient=False)
    out = layer(x)
    (out * to_tensor(upstream)).sum().backward()
    return host(out), host(x.grad)


def serial_and_parallel(make_serial, make_parallel, seed=3):
    nn.set_default_dtype("float64")
    try:
        backend.manual_seed(seed)
        serial = make_serial()
        backend.manual_seed(seed)
        parallel = make_parallel()
    finally:
        nn.set_default_dtype("float32")
    return serial, parallel


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("gather_output", [True, False])
def test_column_parallel_linear_equals_linear(gather_output):
    comm = group()
    serial, parallel = serial_and_parallel(
        lambda: nn.Linear(IN, OUT),
        lambda: nn.ColumnParallelLinear(IN, OUT, has_bias=True, gather_output=gather_output,
                                        mp_group=comm))
    equal(parallel.weight.numpy(), part(serial.weight.numpy(), comm, 1))
    equal(parallel.bias.numpy(), part(serial.bias.numpy(), comm, 0))
    x, upstream = inputs((3, 2, IN), 0), inputs((3, 2, OUT), 1)
    want_out, want_dx = run(serial, x, upstream)
    got_out, got_dx = run(parallel, x, upstream if gather_output else part(upstream, comm, 2))
    close(got_out, want_out if gather_output else part(want_out, comm, 2), **TOL)
    close(got_dx, want_dx, **TOL)
    close(host(parallel.weight.grad), part(host(serial.weight.grad), comm, 1), **TOL)
    close(host(parallel.bias.grad), part(host(serial.bias.grad), comm, 0), **TOL)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_linear_equals_linear(input_is_parallel):
    comm = group()
    serial, parallel = serial_and_parallel(
        lambda: nn.Linear(IN, OUT),
        lambda: nn.RowParallelLinear(IN, OUT, input_is_parallel=input_is_parallel,
                                     mp_group=comm))
    equal(parallel.weight.numpy(), part(serial.weight.numpy(), comm, 0))
    equal(parallel.bias.numpy(), serial.bias.numpy())
    x, upstream = inputs((ROWS, IN), 2), inputs((ROWS, OUT), 3)
    want_out, want_dx = run(serial, x, upstream)
    got_out, got_dx = run(parallel, part(x, comm, 1) if input_is_parallel else x, upstream)
    close(got_out, want_out, **TOL)
    close(got_dx, part(want_dx, comm, 1) if input_is_parallel else want_dx, **TOL)
    close(host(parallel.weight.grad), part(host(serial.weight.grad), comm, 0), **TOL)
    close(host(parallel.bias.grad), host(serial.bias.grad), **TOL)


@pytest.mark.mpi(min_size=2)
def test_column_then_row_is_the_serial_mlp():
    """Megatron's MLP: the column layer's part feeds the row layer's part, one allreduce in
    forward and one in backward."""
    comm = group()

    def mlp(first, second):
        return nn.Sequential(("fc", first), ("act", nn.Tanh()), ("proj", second))
    serial, parallel = serial_and_parallel(
        lambda: mlp(nn.Linear(IN, OUT), nn.Linear(OUT, IN)),
        lambda: mlp(nn.ColumnParallelLinear(IN, OUT, has_bias=True, gather_output=False,
                                            mp_group=comm),
                    nn.RowParallelLinear(OUT, IN, input_is_parallel=True, mp_group=comm)))
    x, upstream = inputs((ROWS, IN), 4), inputs((ROWS, IN), 5)
    want_out, want_dx = run(serial, x, upstream)
    got_out, got_dx = run(parallel, x, upstream)
    close(got_out, want_out, **TOL)
    close(got_dx, want_dx, **TOL)
    close(host(parallel.fc.weight.grad), part(host(serial.fc.weight.grad), comm, 1), **TOL)
    close(host(parallel.proj.weight.grad), part(host(serial.proj.weight.grad), comm, 0),
          **TOL)


@pytest.mark.mpi(min_size=2)
def test_query_key_value_blocks_keep_each_ranks_heads():
    comm = group()
    serial, parallel = serial_and_parallel(
        lambda: nn.Linear(IN, 3 * OUT),
        lambda: nn.ColumnParallelLinear(IN, 3 * OUT, has_bias=True, gather_output=False,
                                        mp_group=comm, output_blocks=3))
    blocks = np.split(serial.weight.numpy(), 3, axis=1)
    equal(parallel.weight.numpy(), np.concatenate([part(b, comm, 1) for b in blocks], axis=1))
    x = inputs((ROWS, IN), 6)
    want = np.split(host(serial(x)), 3, axis=1)
    close(host(parallel(x)), np.concatenate([part(b, comm, 1) for b in want], axis=1), **TOL)


@pytest.mark.mpi(min_size=2)
def test_vocab_parallel_embedding_equals_embedding():
    comm = group()
    serial, parallel = serial_and_parallel(
        lambda: nn.Embedding(VOCAB, IN),
        lambda: nn.VocabParallelEmbedding(VOCAB, IN, mp_group=comm))
    equal(parallel.weight.numpy(), part(serial.weight.numpy(), comm, 0))
    ids = np.random.default_rng(7).integers(0, VOCAB, (4, 6))
    upstream = inputs((4, 6, IN), 8)
    outputs = []
    for layer in (serial, parallel):
        out = layer(ids)
        (out * to_tensor(upstream)).sum().backward()
        outputs.append(host(out))
    close(outputs[1], outputs[0], **TOL)
    close(host(parallel.weight.grad), part(host(serial.weight.grad), comm, 0), **TOL)
    with raises(ValueError):
        parallel(np.array([VOCAB]))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_parallel_cross_entropy_equals_cross_entropy(reduction):
    comm = group()
    logits = inputs((3, 4, VOCAB), 9) * 4
    labels = np.random.default_rng(10).integers(0, VOCAB, (3, 4))
    whole = to_tensor(logits, stop_gradient=False)
    mine = to_tensor(part(logits, comm, 2), stop_gradient=False)
    want = F.cross_entropy(whole, labels, reduction)
    got = nn.ParallelCrossEntropy(mp_group=comm, reduction=reduction)(mine, labels)
    if reduction == "none":  # Paddle's shape: the labels' with a trailing 1
        assert tuple(got.shape) == (3, 4, 1)
        got = got.reshape([3, 4])
    close(host(got), host(want), **TOL)
    upstream = inputs((3, 4), 11)
    weight = to_tensor(upstream) if reduction == "none" else 1.0
    (want * weight).sum().backward()
    (got * weight).sum().backward()
    close(host(mine.grad), part(host(whole.grad), comm, 2), **TOL)
    with raises(ValueError, match=f"labels must lie in \\[0, {VOCAB}\\)"):
        F.parallel_cross_entropy(mine, np.full((3, 4), VOCAB), comm)


@pytest.mark.mpi(min_size=2)
def test_sizes_that_do_not_split_are_refused_naming_the_size():
    comm = group()
    with raises(ValueError, match=f"in_features=7 does not split over the {comm.size} ranks"):
        nn.RowParallelLinear(7, 4, mp_group=comm)
    with raises(ValueError, match="num_embeddings=13"):
        nn.VocabParallelEmbedding(13, 4, mp_group=comm)


def test_alone_each_layer_is_its_serial_layer():
    serial, parallel = serial_and_parallel(lambda: nn.Linear(IN, OUT),
                                           lambda: nn.ColumnParallelLinear(IN, OUT, has_bias=True))
    assert parallel.mp_group is None
    np.testing.assert_array_equal(parallel.weight.numpy(), serial.weight.numpy())
    x = inputs((ROWS, IN), 12)
    np.testing.assert_array_equal(host(parallel(x)), host(serial(x)))
    serial, parallel = serial_and_parallel(lambda: nn.Embedding(VOCAB, IN),
                                           lambda: nn.VocabParallelEmbedding(VOCAB, IN))
    np.testing.assert_array_equal(parallel.weight.numpy(), serial.weight.numpy())
    logits = inputs((ROWS, VOCAB), 13)
    labels = np.arange(ROWS)
    np.testing.assert_allclose(host(F.parallel_cross_entropy(logits, labels, None)),
                               host(F.cross_entropy(logits, labels)), rtol=1e-12)
    with pytest.raises(ValueError, match="output_blocks > 1"):
        nn.ColumnParallelLinear(IN, 3 * OUT, output_blocks=3)

"""fp16 compression: the documented error bound, identical bits on every rank, overflow to inf."""
import numpy as np
import pytest

from fleetmpi.comm.compression import error_bound

from comm_support import all_data, equal, ok, raises, small_chunks, world


def algorithms(comm):
    return ["ring", "hierarchical", None]


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fp16_error_stays_within_the_documented_bound(dtype):
    comm = small_chunks()
    for scale in (1e-3, 1.0, 300.0):
        stack = all_data(comm.size, 513, dtype, case=int(scale * 1000), scale=scale)
        exact = stack.astype(np.float64).sum(axis=0)
        bound = error_bound(np.abs(stack.astype(np.float64)).sum(axis=0), comm.size)
        for algorithm in algorithms(comm):
            got = comm.allreduce(stack[comm.rank], algorithm=algorithm, compression="fp16")
            ok(got.dtype == np.dtype(dtype))
            error = np.abs(got.astype(np.float64) - exact)
            ok(np.all(error <= bound), (algorithm, scale, float(np.max(error / bound))))
            if comm.size > 1:
                # Really rounded through float16: the results are float16 values.
                equal(got, got.astype(np.float16).astype(dtype))


@pytest.mark.mpi
def test_fp16_mean_and_float16_inputs():
    comm = small_chunks()
    stack = all_data(comm.size, 300, np.float16, case=5, scale=3.0)
    exact = stack.astype(np.float64).sum(axis=0)
    bound = error_bound(np.abs(stack.astype(np.float64)).sum(axis=0), comm.size)
    for compression in (None, "fp16"):
        got = comm.allreduce(stack[comm.rank], compression=compression, algorithm="ring")
        ok(got.dtype == np.float16)
        ok(np.all(np.abs(got.astype(np.float64) - exact) <= bound))
        mean = comm.allreduce(stack[comm.rank], op="mean", compression=compression)
        ok(np.all(np.abs(mean.astype(np.float64) - exact / comm.size)
                      <= bound / comm.size + 2.0 ** -24))


@pytest.mark.mpi
def test_fp16_results_are_bit_identical_on_every_rank():
    comm = small_chunks()
    stack = all_data(comm.size, 1000, np.float32, case=9)
    for algorithm in ("ring", "hierarchical"):
        got = comm.allreduce(stack[comm.rank], algorithm=algorithm, compression="fp16")
        everyone = comm.allgather(got, algorithm="native", stack=True)
        for r in range(comm.size):
            equal(everyone[r].view(np.uint32), got.view(np.uint32))


@pytest.mark.mpi(min_size=2)
def test_fp16_overflow_is_inf_on_every_rank():
    comm = world()
    x = np.full(7, 40000.0, dtype=np.float32)
    x[1] = -40000.0
    x[2] = 1.0
    for algorithm in ("ring", "hierarchical"):
        got = comm.allreduce(x, algorithm=algorithm, compression="fp16")
        ok(np.isposinf(got[0]) and np.isneginf(got[1]))
        ok(got[2] == comm.size)
        everyone = comm.allgather(got, algorithm="native", stack=True)
        for r in range(comm.size):
            equal(everyone[r].view(np.uint32), got.view(np.uint32))


@pytest.mark.mpi
def test_fp16_with_integers_or_native_is_refused_on_every_rank():
    comm = world()
    with raises(TypeError, match="floating-point arrays, not int32"):
        comm.allreduce(np.ones(3, np.int32), compression="fp16")
    with raises(ValueError, match="needs algorithm 'ring' or 'hierarchical'"):
        comm.allreduce(np.ones(3, np.float32), compression="fp16", algorithm="native")
    with raises(ValueError, match="compression='bf16' is not known"):
        comm.allreduce(np.ones(3, np.float32), compression="bf16")

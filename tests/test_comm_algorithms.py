"""Every collective algorithm against the native MPI result and single-process math, at any world size."""
import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.comm import Communicator, dispatch, transport_mpi
from fleetmpi.comm.algorithm_choice import NATIVE_BELOW_BYTES

from comm_support import (all_data, close, equal, ok, raises, rank_data,
                          single_process, small_chunks, tolerance, world)

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]
OPS = ["sum", "mean", "max", "min"]


def sizes(p):
    """Element counts around the world size (not multiples of it, smaller than it) and larger."""
    return sorted({0, 1, p - 1, p + 1, 3 * p + 2, 257})


def algorithms(comm):
    names = ["ring", "hierarchical"]
    if comm.topology.local_size == comm.size:
        names.append("shm")
    return names


def check_close(got, want, dtype, size):
    ok(got.dtype == np.dtype(dtype))
    if np.dtype(dtype).kind == "f":
        rtol, atol = tolerance(dtype, size)
        close(got.astype(np.float64), want.astype(np.float64), rtol=rtol,
                                   atol=atol)
    else:
        equal(got, want)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_matches_native_and_single_process(dtype):
    comm = small_chunks()
    for case, n in enumerate(sizes(comm.size)):
        stack = all_data(comm.size, n, dtype, case)
        x = stack[comm.rank]
        for op in OPS:
            native = comm.allreduce(x, op=op, algorithm="native")
            expected = single_process(stack, op)
            check_close(native, expected, dtype, comm.size)
            for algorithm in algorithms(comm):
                got = comm.allreduce(x, op=op, algorithm=algorithm)
                ok(got.shape == x.shape)
                check_close(got, expected, dtype, comm.size)
                if op in ("max", "min") or np.dtype(dtype).kind == "i":
                    equal(got, native)
        equal(x, stack[comm.rank])


@pytest.mark.mpi
def test_float16_is_reduced_in_float32_where_the_mpi_has_no_float16(monkeypatch):
    """Open MPI 4 has no float16 datatype: the native calls then reduce float16 in float32 and
    round once, in every form a caller reaches them (in place, into ``out``, a new array,
    reduce-scatter)."""
    monkeypatch.setattr(transport_mpi, "reduces_float16", lambda: False)
    comm = small_chunks()
    stack = all_data(comm.size, 3 * comm.size + 2, np.float16, 7)
    x = stack[comm.rank]
    for op in OPS:
        expected = single_process(stack, op)
        check_close(comm.allreduce(x, op=op, algorithm="native"), expected, np.float16,
                    comm.size)
        out = np.empty_like(x)
        comm.allreduce(x, op=op, algorithm="native", out=out)
        check_close(out, expected, np.float16, comm.size)
        inplace = x.copy()
        comm.allreduce(inplace, op=op, algorithm="native", out=inplace)
        check_close(inplace, expected, np.float16, comm.size)
        got = comm.reduce_scatter(x, op=op, algorithm="native")
        check_close(got, np.array_split(expected, comm.size)[comm.rank], np.float16, comm.size)
    equal(x, stack[comm.rank])


@pytest.mark.mpi
def test_allreduce_results_are_identical_on_every_rank():
    comm = small_chunks()
    for algorithm in algorithms(comm) + [None]:
        x = rank_data(comm.rank, 1001, np.float32, case=7)
        got = comm.allreduce(x, algorithm=algorithm)
        everyone = comm.allgather(got, algorithm="native", stack=True)
        for r in range(comm.size):
            equal(everyone[r], got)


@pytest.mark.mpi
def test_allreduce_default_algorithm_on_large_and_small_arrays():
    comm = world()
    for n in (5, 300_000):
        stack = all_data(comm.size, n, np.float64, case=n)
        got = comm.allreduce(stack[comm.rank])
        close(got, stack.sum(axis=0), rtol=1e-12, atol=1e-9)


@pytest.mark.mpi
def test_single_node_pick_is_measured_once_and_the_same_on_every_rank():
    fleet.init()
    comm = Communicator(fleet.world.topology())
    large = NATIVE_BELOW_BYTES
    if comm.size == 1 or comm.topology.local_size != comm.size:
        ok(comm.allreduce_algorithm(large) == "ring")
        return
    ok(comm.allreduce_algorithm(large - 1) == "native")
    pick = comm.allreduce_algorithm(large)
    ok(pick in ("ring", "shm"), pick)
    everyone = comm.allgather(np.array([pick == "shm"], np.int64), algorithm="native",
                              stack=True)
    equal(everyone.reshape(-1), np.full(comm.size, everyone.reshape(-1)[0]))
    # Decided once for every size above the threshold; a default allreduce of that size is right.
    ok(comm.allreduce_algorithm(64 * large) == pick)
    stack = all_data(comm.size, large // 8, np.float64, case=3)
    close(comm.allreduce(stack[comm.rank]), stack.sum(axis=0), rtol=1e-12, atol=1e-9)
    comm.free()


@pytest.mark.mpi(min_size=2)
def test_the_single_node_probe_times_written_memory(monkeypatch):
    """A probe buffer that was never written reads the kernel's shared zero page and times
    shm's copies as cheaper than they are on real gradients."""
    fleet.init()
    comm = Communicator(fleet.world.topology())
    if comm.topology.local_size != comm.size:
        pytest.skip("one node only")  # the same on every rank
    probes = []
    run = dispatch.allreduce_flat
    monkeypatch.setattr(dispatch, "allreduce_flat", lambda comm, buf, *args, **kwargs: (
        probes.append((buf.min(), buf.max())), run(comm, buf, *args, **kwargs))[-1])
    comm.allreduce_algorithm(NATIVE_BELOW_BYTES)
    ok(len(probes) == 6, f"{len(probes)} probe runs")
    ok(all(low > 0 for low, _ in probes), f"probe values {probes}")
    comm.free()


@pytest.mark.mpi
def test_allreduce_keeps_shape_of_multidimensional_input():
    comm = world()
    x = rank_data(comm.rank, 24, np.float64).reshape(2, 3, 4)
    got = comm.allreduce(x, algorithm="ring", op="max")
    want = np.max([rank_data(r, 24, np.float64).reshape(2, 3, 4) for r in range(comm.size)],
                  axis=0)
    equal(got, want)


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", [None, "tree", "chain", "native"])
def test_broadcast_from_every_root(algorithm):
    comm = small_chunks()
    for root in range(comm.size):
        for n in (0, 1, 3 * comm.size + 1, 2000):
            x = rank_data(comm.rank, n, np.float32, case=root)
            got = comm.broadcast(x, root=root, algorithm=algorithm)
            equal(got, rank_data(root, n, np.float32, case=root))
            equal(x, rank_data(comm.rank, n, np.float32, case=root))


@pytest.mark.mpi
def test_broadcast_chain_of_a_large_buffer():
    comm = world()
    n = 200_000
    x = rank_data(comm.rank, n, np.float64, case=3)
    got = comm.broadcast(x, root=comm.size - 1, algorithm="chain")
    equal(got, rank_data(comm.size - 1, n, np.float64, case=3))


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.float16, np.int64, np.int32])
@pytest.mark.parametrize("algorithm", [None, "ring", "native"])
def test_allgather_stacks_every_rank(algorithm, dtype):
    comm = small_chunks()
    for n in (0, 1, 37):
        x = rank_data(comm.rank, n, dtype).reshape(1, n)
        got = comm.allgather(x, algorithm=algorithm, stack=True)
        ok(got.shape == (comm.size, 1, n))
        for r in range(comm.size):
            equal(got[r], rank_data(r, n, dtype).reshape(1, n))


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algorithm", [None, "native"])
def test_reduce_scatter_gives_this_ranks_block(algorithm, dtype):
    comm = small_chunks()
    for rows in (0, 1, comm.size + 1, 10):
        stack = all_data(comm.size, rows * 3, dtype, case=rows)
        x = stack[comm.rank].reshape(rows, 3)
        for op in OPS:
            got = comm.reduce_scatter(x, op=op, algorithm=algorithm)
            want = np.array_split(single_process(stack, op).reshape(rows, 3), comm.size)[comm.rank]
            ok(got.shape == want.shape)
            check_close(got, want, dtype, comm.size)


@pytest.mark.mpi
@pytest.mark.parametrize("compression", [None, "fp16"])
def test_reduce_scatter_overwriting_its_input_gives_the_same_block(compression):
    """With ``overwrite_input`` the ring reduces in ``x`` itself; without compression the
    block returned is then ``x``'s own memory, with the same values as a reduction into a
    copy."""
    comm = small_chunks()
    stack = all_data(comm.size, 7 * comm.size + 2, np.float32, case=5)
    x = stack[comm.rank].copy()
    want = comm.reduce_scatter(x, op="mean", compression=compression)
    equal(x, stack[comm.rank])
    got = comm.reduce_scatter(x, op="mean", compression=compression, overwrite_input=True)
    equal(got, want)
    ok(np.shares_memory(got, x) == (compression is None),
       "the block's memory is not as documented")


@pytest.mark.mpi
def test_reduce_scatter_then_allgather_equals_allreduce():
    comm = small_chunks()
    x = rank_data(comm.rank, 4 * comm.size, np.float32, case=11)
    blocks = comm.allgather(comm.reduce_scatter(x), stack=True)
    equal(blocks.reshape(-1), comm.allreduce(x, algorithm="ring"))


@pytest.mark.mpi
def test_barrier_and_send_recv_around_the_ring():
    comm = world()
    comm.barrier()
    if comm.size == 1:
        return
    x = rank_data(comm.rank, 50, np.int64)
    out = np.empty_like(x)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    if comm.rank % 2 == 0:
        comm.send(x, right)
        comm.recv(out, left)
    else:
        comm.recv(out, left)
        comm.send(x, right)
    equal(out, rank_data(left, 50, np.int64))
    comm.barrier()


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.float16, np.float64, np.int32])
def test_shared_memory_allreduce_over_many_small_chunks(dtype):
    from mpi4py import MPI

    from fleetmpi.comm.shm import SharedMemoryAllreduce

    shm = SharedMemoryAllreduce(MPI.COMM_WORLD.Dup(), chunk_bytes=64)
    try:
        size, rank = shm.size, shm.rank
        for n in (1, size + 1, 333):
            stack = all_data(size, n, dtype, case=n)
            for op in ("sum", "mean", "max"):
                out = np.empty(n, dtype)
                shm.allreduce(stack[rank], out, op)
                check_close(out, single_process(stack, op), dtype, size)
                everyone = np.empty((size, n), dtype)
                MPI.COMM_WORLD.Allgather(out, everyone)
                equal(everyone, np.broadcast_to(out, (size, n)))
    finally:
        shm.free()


@pytest.mark.mpi
def test_allreduce_into_out_and_in_place():
    comm = world()
    stack = all_data(comm.size, 1000, np.float64, case=21)
    for algorithm in algorithms(comm) + ["native"]:
        out = np.empty(1000)
        got = comm.allreduce(stack[comm.rank], algorithm=algorithm, out=out)
        ok(got is out)
        close(out, stack.sum(axis=0), rtol=1e-12)
        x = stack[comm.rank].copy()
        comm.allreduce(x, op="max", algorithm=algorithm, out=x)
        equal(x, stack.max(axis=0))
    with raises(ValueError, match=r"out must be a C-contiguous float64 array of shape \(1000,\), "
                                  r"not float32 \(1000,\)"):
        comm.allreduce(stack[comm.rank], out=np.empty(1000, np.float32))

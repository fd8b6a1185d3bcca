"""Collectives whose parts differ per rank: MPI's ``Allgatherv`` and ``Reduce_scatter`` (which
sharding stages 2 and 3 use), Horovod's allgather (first dimension free per rank), alltoall
with equal and explicit splits, gather to and scatter from a root. Uneven parts and empty
parts at any world size; every rank checks its own result against what it computes of all
ranks' inputs; arguments that disagree raise on every rank."""
import re

import numpy as np
import pytest

from comm_support import equal, ok, raises, small_chunks, world


def uneven_counts(size, case):
    """Per-rank counts with empty parts: all on one rank, growing, zeros between."""
    if case == "one":
        return [0] * (size - 1) + [7]
    if case == "growing":
        return [r * 3 for r in range(size)]
    return [5 if r % 2 == 0 else 0 for r in range(size)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("case", ["one", "growing", "alternating"])
def test_allgatherv_joins_every_part_in_rank_order(case, chunked):
    comm = small_chunks() if chunked else world()
    counts = uneven_counts(comm.size, case)
    parts = [np.arange(c, dtype=np.float64) + 100 * r for r, c in enumerate(counts)]
    out = comm.allgatherv(parts[comm.rank], counts)
    equal(out, np.concatenate(parts))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", [None, "native"])
@pytest.mark.parametrize("case", ["one", "growing", "alternating"])
def test_reduce_scatter_with_counts_gives_each_rank_its_rows(case, algorithm):
    comm = world()
    counts = uneven_counts(comm.size, case)
    rows = sum(counts)
    inputs = [np.random.default_rng(r).standard_normal((rows, 2)) for r in range(comm.size)]
    block = comm.reduce_scatter(inputs[comm.rank], op="mean", algorithm=algorithm,
                                counts=counts)
    start = sum(counts[:comm.rank])
    expected = np.mean(inputs, axis=0)[start:start + counts[comm.rank]]
    ok(block.shape == expected.shape, f"shape {block.shape}, expected {expected.shape}")
    np.testing.assert_allclose(block, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.mpi(min_size=2)
def test_counts_that_differ_between_ranks_raise_on_every_rank():
    comm = world()
    counts = [1] * comm.size
    if comm.rank == 0:
        counts = [2] + [1] * (comm.size - 2) + [0]
    with raises(ValueError, match="allgatherv"):
        comm.allgatherv(np.zeros(counts[comm.rank]), counts)


@pytest.mark.mpi(min_size=2)
def test_bad_counts_are_named():
    comm = world()
    with raises(ValueError, match=r"counts=\[1\] must be a list of \d+ non-negative"):
        comm.allgatherv(np.zeros(1), [1])
    with raises(ValueError, match=r"add up to \d+, but the length of x is 3"):
        comm.reduce_scatter(np.zeros(3), counts=[4] + [0] * (comm.size - 1))
    with raises(ValueError, match=r"got 2 elements on rank \d+, but counts"):
        comm.allgatherv(np.zeros(2), [1] * comm.size)


def rank_rows(rank, n, width=3):
    """Rank ``rank``'s ``n`` rows of ``width`` values, distinct from every other rank's."""
    return (np.arange(n * width, dtype=np.float32).reshape(n, width) + 1000 * rank)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", [None, "ring"])
@pytest.mark.parametrize("case", ["one", "growing", "alternating"])
def test_allgather_joins_a_first_dimension_that_differs_per_rank(case, algorithm):
    comm = world()
    counts = uneven_counts(comm.size, case)
    got = comm.allgather(rank_rows(comm.rank, counts[comm.rank]), algorithm=algorithm)
    equal(got, np.concatenate([rank_rows(r, c) for r, c in enumerate(counts)]))


@pytest.mark.mpi(min_size=2)
def test_allgather_refuses_native_for_unequal_rows_and_other_shapes_on_every_rank():
    comm = world()
    with raises(ValueError, match=r"algorithm='native' gathers equal shapes.+first dimensions"):
        comm.allgather(rank_rows(comm.rank, comm.rank + 1), algorithm="native")
    with raises(ValueError, match="shapes differ"):
        comm.allgather(np.zeros((2, 3 if comm.rank == 0 else 4)))


def mismatched_part(collective, rank, size):
    """Rank ``rank``'s part for ``collective``: rows that differ per rank, as allowed, and a
    row width (a dtype for allgatherv) that differs too, which is not. Dtypes and widths no
    other test passes: a call that one rank alone has agreed on before skips the exchange
    (``fleetmpi.comm.call_checks.agree``), and this test is about the exchange's report."""
    if collective == "allgatherv":
        return np.zeros(rank + 1, dtype=np.int16 if rank == 0 else np.uint16)
    rows = (rank + 1) * size if collective == "alltoall" else rank + 1
    return np.zeros((rows, 5 if rank == 0 else 6), dtype=np.int16)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("collective", ["allgather", "alltoall", "gather", "allgatherv"])
def test_a_mismatch_prints_every_ranks_true_shape_on_every_rank(collective):
    """The arguments agreed on stand for ``x[:0]`` (the first dimension may differ); the
    report still prints each rank's whole array, as the caller passed it."""
    comm = world()
    x, counts = mismatched_part(collective, comm.rank, comm.size), list(range(1, comm.size + 1))
    calls = {"allgather": lambda: comm.allgather(x), "alltoall": lambda: comm.alltoall(x),
             "gather": lambda: comm.gather(x), "allgatherv": lambda: comm.allgatherv(x, counts)}
    layout = f", counts {counts}" if collective == "allgatherv" else ""
    parts = [mismatched_part(collective, r, comm.size) for r in range(comm.size)]
    seen = ", ".join(f"rank {r}: {p.dtype} {p.shape}{layout}" for r, p in enumerate(parts))
    with raises(ValueError, match=re.escape(f"shapes differ ({seen})")):
        calls[collective]()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("explicit", [False, True])
def test_alltoall_sends_each_rank_its_rows(explicit):
    """Rank s sends ``splits_of(s)[r]`` rows to rank r (zero for some pairs when explicit)."""
    comm = world()
    size = comm.size

    def splits_of(s):
        return [(s + r) % 3 for r in range(size)] if explicit else [2] * size

    def sent(s):
        return rank_rows(s, sum(splits_of(s)))
    received, received_splits = comm.alltoall(sent(comm.rank),
                                              splits_of(comm.rank) if explicit else None)
    parts = []
    for s in range(size):
        start = sum(splits_of(s)[:comm.rank])
        parts.append(sent(s)[start:start + splits_of(s)[comm.rank]])
    equal(received, np.concatenate(parts))
    ok(received_splits == [splits_of(s)[comm.rank] for s in range(size)], f"{received_splits}")


@pytest.mark.mpi(min_size=2)
def test_alltoall_refuses_splits_that_do_not_fit():
    comm = world()
    with raises(ValueError, match=r"does not divide it; pass splits"):
        comm.alltoall(np.zeros((comm.size + 1, 2)))
    with raises(ValueError, match=r"add up to \d+, but the first dimension of x is 2"):
        comm.alltoall(np.zeros((2, 2)), splits=[3] + [0] * (comm.size - 1))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", ["one", "growing", "alternating"])
def test_gather_joins_every_rank_on_the_root_only(case):
    comm = world()
    counts = uneven_counts(comm.size, case)
    root = comm.size - 1
    got = comm.gather(rank_rows(comm.rank, counts[comm.rank]), root=root)
    if comm.rank == root:
        equal(got, np.concatenate([rank_rows(r, c) for r, c in enumerate(counts)]))
    else:
        ok(got is None, "a non-root rank got a result")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", [None, "one", "growing", "alternating"])
def test_scatter_gives_each_rank_its_part_of_the_roots_array(case):
    comm = world()
    splits = None if case is None else uneven_counts(comm.size, case)
    parts = splits or [2] * comm.size
    whole = rank_rows(0, sum(parts), width=4).reshape(sum(parts), 2, 2)
    root = 1
    mine = comm.scatter(whole if comm.rank == root else np.empty(0, np.float32), root=root,
                        splits=splits if comm.rank == root else None)
    start = sum(parts[:comm.rank])
    equal(mine, whole[start:start + parts[comm.rank]])


@pytest.mark.mpi(min_size=2)
def test_gather_and_scatter_with_different_dtypes_raise_on_every_rank():
    comm = world()
    dtype = np.float32 if comm.rank == 0 else np.float64
    with raises(ValueError, match="dtype differs"):
        comm.gather(np.zeros((1, 2), dtype))
    with raises(ValueError, match="dtype differs"):
        comm.scatter(np.zeros((comm.size, 2), dtype))

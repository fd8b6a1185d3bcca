"""Collectives with per-rank counts (MPI's ``Allgatherv`` and ``Reduce_scatter``), which
sharding stages 2 and 3 use: uneven parts and empty parts at any world size, every rank checks
its own result against the single-process one, and counts that disagree raise on every rank."""
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

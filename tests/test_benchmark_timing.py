"""The benchmarks' timing loop ends on every rank at the same call, whatever each rank's
clock says (a rank that left the loop alone would wait in a collective nobody joins)."""
import importlib.util
import os
import types

import numpy as np
import pytest

BENCHMARK = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "allreduce.py")


def load_benchmark():
    spec = importlib.util.spec_from_file_location("allreduce_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.mpi(min_size=2)
def test_timing_loop_ends_together_when_clocks_disagree(monkeypatch):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    benchmark = load_benchmark()
    ticks = [0.0]

    def skewed_clock():
        """Each rank's clock runs at its own rate: rank r ticks (r + 1) centiseconds a read."""
        ticks[0] += 0.01 * (rank + 1)
        return ticks[0]

    monkeypatch.setattr(benchmark, "time", types.SimpleNamespace(perf_counter=skewed_clock))
    calls = [0]

    def call():
        calls[0] += 1

    for budget in np.arange(0.05, 1.5, 0.01):
        calls[0] = 0
        benchmark.timed(call, world, budget)
        counts = world.allgather(calls[0])
        assert len(set(counts)) == 1, f"budget {budget:.2f}: calls per rank {counts}"
        assert counts[0] >= 1 + benchmark.MIN_RUNS, counts  # the warm-up call, then the runs
    assert np.isfinite(benchmark.timed(call, world, 0.01))

"""Does gradient reduction overlap backward? A synthetic backward at 2 ranks.

    mpiexec -n 2 python benchmarks/overlap.py [--layers 8] [--bucket-kb 1024] [--compute-ms 4]

A "backward" of ``--layers`` layers: each layer computes for about ``--compute-ms``
milliseconds, with the GIL released, then reports a real gradient bucket of ``--bucket-kb``
KiB (float32) for reduction (``op="mean"``, the communicator's default algorithm). Two kinds of
compute: ``blas`` (NumPy matrix products, one BLAS thread, using a core as a CPU backward does)
and ``sleep`` (the host idles while the layer runs, as it does while a GPU computes). Printed,
per kind, with the slowest rank's median step time:

* ``compute``: the layers without reduction; ``comm``: the buckets reduced back to back;
* ``compute + comm`` and ``max(compute, comm)``: no overlap, and perfect overlap;
* ``blocking``: each bucket reduced as its layer finishes (``allreduce_many``);
* ``thread``: each bucket started on the communicator's thread (``allreduce_many_async``),
  all waited for after the last layer, as ``FLEETMPI_OVERLAP_ALLREDUCE=1`` does;
* ``Iallreduce``: MPI's nonblocking allreduce on the same buckets, tested after every layer
  (the alternative to a thread: MPICH moves it forward only inside MPI calls).

Every step's reduced buckets are checked against the exact mean.
"""
import argparse
import time

import numpy as np
from mpi4py import MPI

import fleetmpi as fleet
from fleetmpi.comm import get_communicator


class Compute:
    """About ``ms`` milliseconds of work that releases the GIL."""

    def __init__(self, kind, ms):
        self.kind = kind
        self.ms = ms
        self.a = np.random.default_rng(0).standard_normal((128, 128)).astype(np.float32)
        self.repeats = 0
        if kind == "blas" and ms > 0:
            start, n = time.perf_counter(), 50
            for _ in range(n):
                self.a @ self.a
            per = (time.perf_counter() - start) / n
            self.repeats = max(1, round(ms * 1e-3 / per))

    def __call__(self):
        if self.kind == "sleep":
            time.sleep(self.ms * 1e-3)
            return
        for _ in range(self.repeats):
            self.a @ self.a


def step(mode, buckets, compute, comm):
    """One backward of ``len(buckets)`` layers, reducing as ``mode`` says."""
    handles, requests = [], []
    for bucket in buckets:
        compute()
        if mode == "blocking":
            comm.allreduce_many([bucket], op="mean")
        elif mode == "thread":
            handles.append(comm.allreduce_many_async([bucket], op="mean"))
        elif mode == "Iallreduce":
            requests.append(MPI.COMM_WORLD.Iallreduce(MPI.IN_PLACE, bucket))
            MPI.Request.Testall(requests)
    for handle in handles:
        handle.wait()
    if requests:
        MPI.Request.Waitall(requests)
        for bucket in buckets:
            bucket /= comm.size


def comm_only(buckets, comm):
    for bucket in buckets:
        comm.allreduce_many([bucket], op="mean")


def timed(fn, repeats):
    """The slowest rank's median seconds of ``fn()``, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        MPI.COMM_WORLD.Barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return MPI.COMM_WORLD.allreduce(float(np.median(times)), op=MPI.MAX)


def fresh(args, rank):
    n = args.bucket_kb * 256
    return [np.full(n, rank + i, np.float32) for i in range(args.layers)]


def check(buckets, size):
    for i, bucket in enumerate(buckets):
        expected = np.float32(sum(range(size)) / size + i)
        if not np.allclose(bucket, expected):
            raise AssertionError(f"bucket {i} holds {bucket[:3]}, expected {expected}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--bucket-kb", type=int, default=1024)
    parser.add_argument("--compute-ms", type=float, nargs="+", default=[1.0, 4.0, 16.0])
    parser.add_argument("--kinds", nargs="+", default=["blas", "sleep"], choices=["blas", "sleep"])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    fleet.init(is_collective=True)
    comm = get_communicator()
    rank = comm.rank
    if rank == 0:
        print(f"{comm.size} ranks, {args.layers} layers, buckets of {args.bucket_kb} KiB "
              f"(algorithm {comm.allreduce_algorithm(args.bucket_kb << 10)}), "
              f"median of {args.repeats} steps, slowest rank, ms per step")
        print(f"{'compute':>7} {'per layer':>9} | {'compute':>8} {'comm':>8} {'sum':>8} "
              f"{'max':>8} | {'blocking':>8} {'thread':>8} {'Iallred.':>8} | "
              f"{'thread/max':>10}")
    else:
        comm.allreduce_algorithm(args.bucket_kb << 10)
    for kind in args.kinds:
        for ms in args.compute_ms:
            compute = Compute(kind, ms)
            buckets = fresh(args, rank)
            t_compute = timed(lambda: [compute() for _ in buckets], args.repeats)
            t_comm = timed(lambda: comm_only(buckets, comm), args.repeats)
            row = {}
            for mode in ("blocking", "thread", "Iallreduce"):
                buckets = fresh(args, rank)
                step(mode, buckets, compute, comm)
                check(buckets, comm.size)
                row[mode] = timed(lambda: step(mode, buckets, compute, comm), args.repeats)
            best = max(t_compute, t_comm)
            if rank == 0:
                print(f"{kind:>7} {ms:>7.1f}ms | {t_compute * 1e3:8.2f} {t_comm * 1e3:8.2f} "
                      f"{(t_compute + t_comm) * 1e3:8.2f} {best * 1e3:8.2f} | "
                      f"{row['blocking'] * 1e3:8.2f} {row['thread'] * 1e3:8.2f} "
                      f"{row['Iallreduce'] * 1e3:8.2f} | {row['thread'] / best:10.2f}",
                      flush=True)


if __name__ == "__main__":
    main()

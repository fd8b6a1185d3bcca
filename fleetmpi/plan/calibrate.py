"""Calibrating the planner's model of this machine from a short two-rank job.

``calibrate()`` runs ``mpiexec -n 2 python -m fleetmpi.plan.calibrate``, which times, as the
trainer calls them (``allreduce_many`` of one float32 array, ``op="mean"``, argument agreement
included), on one node:

* ``alpha``: half a round trip of a 4-byte ``sendrecv`` of our MPI transport;
* a 4-byte native allreduce: the call overhead is what is left of it after the messages;
* our ring at 256 KiB to 16 MiB: ``beta`` by least squares over the ring's cost formula;
* the library's allreduce at 16 to 512 KiB: its own ``beta``;
* the shared-memory allreduce at 1 to 16 MiB: its barrier latency and copy cost;
* the slowdown of a rank's compute (float32 matrix products) while the other rank computes
  too, against computing alone (cores share caches and memory bandwidth);

and on rank 0 alone the arithmetic the algorithms do: a float32 add into an accumulator
(``gamma``), the float32 to float16 cast, dgc's top-k selection and its scatter-add. Each time is
the lower quartile over repetitions of the slowest rank, so that a moment of outside load on a
shared machine does not enter the constants. The result is a ``Cluster`` of one node with
``local_ranks`` ranks on its ``os.cpu_count()`` cores.
"""
import math
import os
import time

import numpy as np

from . import costs, jobs
from .links import Link
from .predict import Cluster, Device, SharedMemory

RING_SIZES = [256 << 10, 1 << 20, 4 << 20, 16 << 20]
NATIVE_SIZES = [16 << 10, 64 << 10, 256 << 10, 512 << 10]
SHM_SIZES = [1 << 20, 4 << 20, 16 << 20]
# The typical size of a gradient entry (the median |g| of the MLPs of docs/plan.md is ~1e-3).
GRADIENT_SCALE = 1e-3


def calibrate(local_ranks=64, repeats=15, timeout=300):
    """A ``Cluster`` describing this machine, measured now (about 10 s)."""
    m = jobs.run("fleetmpi.plan.calibrate", 2, ["--repeats", repeats], timeout=timeout)
    return cluster_from_measurements(m, local_ranks)


def _fit_slope(xs, ys):
    """Least-squares ``b >= 0`` of ``y = b * x``."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    return max(0.0, float(xs @ ys / (xs @ xs)))


def _fit_nonnegative(a, y):
    """Least-squares ``(x0, x1) >= 0`` of ``a @ x = y``; a negative coefficient is dropped and
    the other refitted alone."""
    a, y = np.asarray(a, float), np.asarray(y, float)
    x, *_ = np.linalg.lstsq(a, y, rcond=None)
    if x[0] < 0:
        return 0.0, _fit_slope(a[:, 1], y)
    if x[1] < 0:
        return _fit_slope(a[:, 0], y), 0.0
    return float(x[0]), float(x[1])


def cluster_from_measurements(m, local_ranks=64):
    """Fit the link and device constants to the measurements ``m`` of the two-rank job."""
    p = 2
    gamma, cast = m["gamma"], m["cast"]
    alpha = m["alpha"]
    probe = Link("local", alpha, 0.0)
    # A 4-byte native call: agreement (overhead + 2 alpha at 2 ranks) and 2 alpha of messages.
    overhead = max(0.0, m["tiny"] - costs.agreement(p, probe, 0.0) - 2 * alpha)
    call = costs.agreement(p, probe, overhead)

    def residual(seconds, fixed):
        return seconds - call - fixed

    ring_x, ring_y = [], []
    for n, t in zip(RING_SIZES, m["ring"]):
        messages = costs.ring_allreduce(n, p, probe, 0.0)
        reduction = costs.ring_allreduce(n, p, Link("none", 0.0, 0.0), gamma)
        ring_x.append(2 * (p - 1) / p * n)
        ring_y.append(residual(t, messages + reduction))
    beta = _fit_slope(ring_x, ring_y)
    # The library's allreduce: its own per-message cost and bandwidth (2 (p - 1) messages).
    native_a = [[2 * (p - 1), 2 * (p - 1) / p * n] for n in NATIVE_SIZES]
    native_y = [residual(t, costs.native_allreduce(n, p, Link("none", 0.0, 0.0), gamma))
                for n, t in zip(NATIVE_SIZES, m["native"])]
    native_alpha, native_beta = _fit_nonnegative(native_a, native_y)
    shm_a = [[math.ceil(n / costs.SHM_CHUNK_BYTES) * 2, 2 * n] for n in SHM_SIZES]
    shm_y = [residual(t, costs.shm_allreduce(n, p, 0.0, 0.0, gamma))
             for n, t in zip(SHM_SIZES, m["shm"])]
    barrier_alpha, copy_beta = _fit_nonnegative(shm_a, shm_y)
    device = Device("local cpu", gamma=gamma, cast=cast, widen=m["widen"], select=m["select"],
                    scatter=m["scatter"], call_overhead=overhead)
    link = Link("local", alpha, beta)
    return Cluster(local_ranks, link, link, device, transport="mpi",
                   native=Link("local native", alpha, native_beta),
                   shm=SharedMemory(max(0.0, float(barrier_alpha)), max(0.0, float(copy_beta))),
                   cores=os.cpu_count() or 1)


def _quartile_slowest(fn, world, repeats):
    from mpi4py import MPI

    fn()
    times = []
    for _ in range(repeats):
        world.Barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    local = np.array([np.percentile(times, 25)])
    world.Allreduce(MPI.IN_PLACE, local, op=MPI.MAX)
    return float(local[0])


def _per_unit(fn, units, repeats=20):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.percentile(times, 25)) / units


def _arithmetic():
    """Seconds per byte of a float32 add, a float32 to float16 cast and a float16 add into
    float32, and per element of dgc's selection and scatter-add, on this rank. The casts are
    timed on values of gradient size (``GRADIENT_SCALE``): NumPy's float16 conversion is much
    slower for values that float16 holds only as subnormals (below 6.1e-5)."""
    from fleetmpi.comm.ring import DEFAULT_CHUNK_BYTES
    from fleetmpi.strategies.dgc import top_k

    n = DEFAULT_CHUNK_BYTES // 4
    rng = np.random.default_rng(0)
    acc, other = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n,
                                                                                dtype=np.float32)
    grads = acc * np.float32(GRADIENT_SCALE)
    wire = np.empty(n, np.float16)
    received = grads.astype(np.float16)
    big = rng.standard_normal(1 << 20, dtype=np.float32)
    k = big.size // 1000
    idx = rng.choice(big.size, k * 16, replace=False).astype(np.int32)
    vals = rng.standard_normal(idx.size, dtype=np.float32)
    return {
        "gamma": _per_unit(lambda: np.add(acc, other, out=acc), acc.nbytes),
        "cast": _per_unit(lambda: np.copyto(wire, grads, casting="unsafe"), grads.nbytes),
        "widen": _per_unit(lambda: np.add(grads, received, out=grads, casting="unsafe"),
                           received.nbytes),
        "select": _per_unit(lambda: big[top_k(big, k)], big.size),
        "scatter": _per_unit(lambda: big.__setitem__(idx, big[idx] + vals), idx.size),
    }


def _compute_alone_and_together(world, repeats):
    """Rank 0's seconds for a fixed block of matrix products alone (rank 1 sleeps) and with
    rank 1 running the same block at the same time."""
    a = np.random.default_rng(0).standard_normal((384, 384), dtype=np.float32)

    def work():
        for _ in range(10):
            a @ a

    alone = None
    if world.Get_rank() == 0:
        alone = _per_unit(work, 1, repeats)
        world.send(None, dest=1, tag=77)
    else:
        while not world.Iprobe(source=0, tag=77):
            time.sleep(1e-3)
        world.recv(source=0, tag=77)
    together = _quartile_slowest(work, world, repeats)
    return alone, together


def main():
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    import fleetmpi as fleet
    from mpi4py import MPI

    from fleetmpi.comm import get_communicator

    fleet.init(is_collective=True)
    comm = get_communicator()
    world = MPI.COMM_WORLD
    transport = comm.transports[0]
    peer = 1 - comm.rank
    token, back = np.zeros(1, np.float32), np.zeros(1, np.float32)
    round_trip = _quartile_slowest(
        lambda: [transport.sendrecv(token, peer, back, peer) for _ in range(100)], world,
        args.repeats)
    result = {"alpha": round_trip / 100}

    def timed(nbytes, algorithm):
        x = np.ones(nbytes // 4, np.float32)
        return _quartile_slowest(lambda: comm.allreduce_many([x], op="mean", algorithm=algorithm),
                               world, args.repeats)

    result["tiny"] = timed(4, "native")
    result["ring"] = [timed(n, "ring") for n in RING_SIZES]
    result["native"] = [timed(n, "native") for n in NATIVE_SIZES]
    result["shm"] = [timed(n, "shm") for n in SHM_SIZES]
    result["alone"], result["together"] = _compute_alone_and_together(world, args.repeats)
    if comm.rank == 0:
        result.update(_arithmetic())
        jobs.report(result)


if __name__ == "__main__":
    main()

"""Allreduce benchmark: fleetmpi's algorithms next to native MPI (and torch.distributed's gloo).

    mpiexec -n 2 python benchmarks/allreduce.py [--min-bytes 4096] [--max-bytes 67108864]

Prints, for float32 buffers from 4 KB to 64 MB: time per call, algorithm bandwidth
(``bytes / time``) and bus bandwidth (``algbw * 2 * (n - 1) / n``, nccl-tests' definition) of
``comm.allreduce`` with its default pick, of the ring, hierarchical and (on one node)
shared-memory allreduce, of native MPI_Allreduce (mpi4py's ``Allreduce``), and
of gloo when torch is installed, with each one's speed relative to native MPI. Every result is
checked against the exact sum before it is timed. Like MPI_Allreduce with a separate receive
buffer, ours write into a preallocated ``out=`` array. Times are the slowest rank's, median of
the timed runs.
"""
import argparse
import os
import socket
import time

import numpy as np
from mpi4py import MPI

import fleetmpi as fleet
from fleetmpi.comm import get_communicator


def timed(fn, comm, budget_s):
    """Median seconds per call of ``fn`` (slowest rank), after a warm-up call."""
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < budget_s and len(times) < 200):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        stop = np.array([time.perf_counter() - start > budget_s], dtype=np.int32)
        comm.Allreduce(MPI.IN_PLACE, stop, op=MPI.MAX)
        if len(times) >= 5 and stop[0]:
            break
    local = np.array([np.median(times)])
    comm.Allreduce(MPI.IN_PLACE, local, op=MPI.MAX)
    return float(local[0])


def gloo_group(world):
    """torch.distributed's gloo process group over the same ranks, or a reason it is absent."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None, "torch not installed"
    port = None
    if world.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.bcast(port, root=0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=world.Get_rank(), world_size=world.Get_size())
    return (torch, dist), None


def human(nbytes):
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:g} {unit}"
        nbytes /= 1024


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-bytes", type=int, default=4 << 10)
    parser.add_argument("--max-bytes", type=int, default=64 << 20)
    parser.add_argument("--budget", type=float, default=1.0,
                        help="seconds of timed runs per size and algorithm")
    parser.add_argument("--no-gloo", action="store_true")
    args = parser.parse_args()

    fleet.init()
    comm = get_communicator()
    world = MPI.COMM_WORLD
    n, rank = comm.size, comm.rank
    gloo, why = (None, "skipped (--no-gloo)") if args.no_gloo else gloo_group(world)

    algorithms = ["ring", "hierarchical"]
    if comm.topology.local_size == n:
        algorithms.append("shm")
    rows = []
    nbytes = args.min_bytes
    while nbytes <= args.max_bytes:
        count = nbytes // 4
        x = (np.arange(count, dtype=np.float32) % 97) * (rank + 1)
        exact = (np.arange(count, dtype=np.float32) % 97) * (n * (n + 1) // 2)
        results = {}
        recv = np.empty_like(x)

        def native():
            world.Allreduce(x, recv, op=MPI.SUM)
        native()
        assert np.array_equal(recv, exact), "native allreduce gave a wrong sum"
        results["native MPI"] = timed(native, world, args.budget)
        for name in [None] + algorithms:
            assert np.array_equal(comm.allreduce(x, algorithm=name, out=recv), exact), name
            label = name or f"default ({comm.allreduce_algorithm(nbytes)})"
            results[label] = timed(lambda: comm.allreduce(x, algorithm=name, out=recv), world,
                                   args.budget)
        if gloo is not None:
            torch, dist = gloo
            tensor = torch.from_numpy(x.copy())

            def gloo_call():
                tensor.copy_(torch.from_numpy(x))
                dist.all_reduce(tensor)
            gloo_call()
            assert np.array_equal(tensor.numpy(), exact), "gloo gave a wrong sum"
            results["gloo"] = timed(gloo_call, world, args.budget)
        for name, seconds in results.items():
            algbw = nbytes / seconds / 1e9
            busbw = algbw * 2 * (n - 1) / n
            rows.append((human(nbytes), name, seconds, algbw, busbw,
                         results["native MPI"] / seconds))
        nbytes *= 4

    if rank == 0:
        print(f"allreduce of float32, {n} rank(s) on {comm.topology.num_nodes} node(s), "
              f"MPI: {MPI.Get_library_version().splitlines()[0].strip()}"
              + ("" if gloo else f"; gloo: {why}"))
        print()
        print("| size | algorithm | time | algbw (GB/s) | busbw (GB/s) | speed vs native MPI |")
        print("| ---: | --- | ---: | ---: | ---: | ---: |")
        for size, name, seconds, algbw, busbw, ratio in rows:
            shown = f"{seconds * 1e6:.0f} us" if seconds < 1e-2 else f"{seconds * 1e3:.1f} ms"
            print(f"| {size} | {name} | {shown} | {algbw:.2f} | {busbw:.2f} | {ratio:.2f}x |")
    if gloo is not None:
        gloo[1].destroy_process_group()


if __name__ == "__main__":
    main()

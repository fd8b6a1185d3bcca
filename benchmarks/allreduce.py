"""Allreduce benchmark: fleetmpi's algorithms next to native MPI (and torch.distributed's gloo).

    mpiexec -n 2 python benchmarks/allreduce.py [--min-bytes 4096] [--max-bytes 67108864]
                                                [--device cpu|gpu]

``--device gpu`` (one GPU per rank) gives the NCCL rows instead: the buffers are CuPy arrays on
each rank's GPU, fleetmpi's communicator runs over its NCCL transport, the baseline is NCCL's
own ``ncclAllReduce`` (``cupy.cuda.nccl``) and the peer torch.distributed's ``nccl`` backend;
every run of calls ends with the device synchronized before the clock is read.

Prints, for float32 buffers from 4 KB to 64 MB: time per call, algorithm bandwidth
(``bytes / time``) and bus bandwidth (``algbw * 2 * (n - 1) / n``, nccl-tests' definition) of
``comm.allreduce`` with its default pick, of the ring, hierarchical and (on one node)
shared-memory allreduce, of native MPI_Allreduce (mpi4py's ``Allreduce``), and
of gloo when torch is installed, with each one's speed relative to native MPI. Every result is
checked against the exact sum before it is timed. Like MPI_Allreduce with a separate receive
buffer, ours write into a preallocated ``out=`` array. Times are the slowest rank's, median of
the timed runs.

Every contestant is timed the same way: runs of back-to-back calls (as a training loop makes
them, each run lasting about ``RUN_SECONDS``) between barriers, the time per call being the
run's over its calls; PyTorch gets one intra-op thread per rank, as fleetmpi's ranks have one
BLAS thread. ``--max-seconds`` bounds the whole benchmark: each size gets an equal share of
what is left, and once it is spent the remaining rows say so instead of being timed.

Whether a timing loop goes on is decided by all ranks together (one MAX allreduce per run),
never by a rank's own clock: a rank that left the loop alone would wait in a collective nobody
else joins. That was why the gloo comparison once ran for 12 minutes without printing; gloo's
collectives now also raise after ``--gloo-timeout`` seconds.

gloo's small-message times here are not yet understood: a 4 KB gloo allreduce took 2.3-3.8 ms
in this benchmark, and in a standalone loop 0.5 ms back to back but 3.3-4.0 ms when each call
followed an MPI barrier, varying between runs of the same loop (2 ranks, 2 cores, MPICH 5.0.2,
torch 2.13.0).
"""
import argparse
import datetime
import os
import socket
import time

import numpy as np
from mpi4py import MPI

import fleetmpi as fleet
from fleetmpi.core import backend, knobs
from fleetmpi.comm import get_communicator


RUN_SECONDS = 20e-3
MIN_RUNS = 3


def timed(fn, comm, budget_s, sync=lambda: None):
    """Median seconds per call of ``fn`` (slowest rank) over runs of back-to-back calls, after
    a warm-up call, each run ended by ``sync()`` (the device's queue drained); at least
    ``MIN_RUNS`` runs, more while ``budget_s`` lasts. The ranks decide together when to stop
    (module docstring)."""
    start = time.perf_counter()
    fn()
    sync()
    once = np.array([time.perf_counter() - start])
    comm.Allreduce(MPI.IN_PLACE, once, op=MPI.MAX)
    calls = max(1, min(1000, int(RUN_SECONDS / max(once[0], 1e-7))))
    times = []
    start = time.perf_counter()
    while True:
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / calls)
        stop = np.array([time.perf_counter() - start > budget_s or len(times) >= 200],
                        dtype=np.int32)
        comm.Allreduce(MPI.IN_PLACE, stop, op=MPI.MAX)
        if len(times) >= MIN_RUNS and stop[0]:
            break
    local = np.array([np.median(times)])
    comm.Allreduce(MPI.IN_PLACE, local, op=MPI.MAX)
    return float(local[0])


def torch_group(world, device, timeout_s):
    """torch.distributed over the same ranks (gloo on the CPU, nccl on each rank's GPU), or a
    reason it is absent. Its collectives raise after ``timeout_s`` seconds instead of waiting
    for ever; torch runs one intra-op thread per rank, as the MPI side has one BLAS thread."""
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
    torch.set_num_threads(1)  # one thread per rank, as fleetmpi's ranks on this machine
    if device == "gpu":
        import cupy

        torch.cuda.set_device(cupy.cuda.Device().id)
    dist.init_process_group("nccl" if device == "gpu" else "gloo", rank=world.Get_rank(),
                            world_size=world.Get_size(),
                            timeout=datetime.timedelta(seconds=timeout_s))
    return (torch, dist), None


def nccl_allreduce(world):
    """NCCL's own ``ncclAllReduce`` of float32 sums over the ranks of ``world``, as
    ``fn(x, recv)`` on CuPy arrays (a ``cupy.cuda.nccl`` communicator from a unique id that
    rank 0 makes and MPI broadcasts)."""
    import cupy
    from cupy.cuda import nccl

    uid = world.bcast(nccl.get_unique_id() if world.Get_rank() == 0 else None, root=0)
    raw = nccl.NcclCommunicator(world.Get_size(), uid, world.Get_rank())

    def allreduce(x, recv):
        raw.allReduce(x.data.ptr, recv.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                      cupy.cuda.get_current_stream().ptr)
    return allreduce


def mpi_allreduce(world):
    """MPI_Allreduce (mpi4py's ``Allreduce``) of float32 sums, as ``fn(x, recv)``."""
    return lambda x, recv: world.Allreduce(x, recv, op=MPI.SUM)


def human(nbytes):
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:g} {unit}"
        nbytes /= 1024


def time_size(nbytes, comm, peers, budget):
    """``{contestant: seconds per call}`` for one size: the baseline, fleetmpi's default pick
    and ``peers["algorithms"]``, and the torch peer when present, each checked first."""
    world, n, rank = MPI.COMM_WORLD, comm.size, comm.rank
    count = nbytes // 4
    host = (np.arange(count, dtype=np.float32) % 97) * (rank + 1)
    exact = (np.arange(count, dtype=np.float32) % 97) * (n * (n + 1) // 2)
    x = backend.asarray(host)
    recv = backend.array_module().empty_like(x)
    baseline_name, baseline = peers["baseline"]
    results = {}

    def check(got, what):
        assert np.array_equal(backend.to_numpy(got), exact), f"{what} gave a wrong sum"

    baseline(x, recv)
    backend.synchronize()
    check(recv, baseline_name)
    results[baseline_name] = timed(lambda: baseline(x, recv), world, budget,
                                   backend.synchronize)
    for name in [None] + peers["algorithms"]:
        check(comm.allreduce(x, algorithm=name, out=recv), name or "the default")
        label = name or f"default ({comm.allreduce_algorithm(nbytes)})"
        results[label] = timed(lambda: comm.allreduce(x, algorithm=name, out=recv), world,
                               budget, backend.synchronize)
    if peers["torch"] is not None:
        torch, dist = peers["torch"]
        source = torch.from_numpy(host).to("cuda" if backend.on_gpu() else "cpu")
        tensor = source.clone()

        def torch_call():
            tensor.copy_(source)
            dist.all_reduce(tensor)
        torch_call()
        check(tensor.cpu().numpy(), peers["torch_name"])
        sync = torch.cuda.synchronize if backend.on_gpu() else (lambda: None)
        results[peers["torch_name"]] = timed(torch_call, world, budget, sync)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-bytes", type=int, default=4 << 10)
    parser.add_argument("--max-bytes", type=int, default=64 << 20)
    parser.add_argument("--budget", type=float, default=1.0,
                        help="seconds of timed runs per size and algorithm")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                        help="gpu: CuPy buffers over NCCL, one GPU per rank")
    parser.add_argument("--no-gloo", action="store_true", help="leave out the torch peer")
    parser.add_argument("--gloo-timeout", type=float, default=60.0,
                        help="seconds after which a torch collective raises")
    parser.add_argument("--max-seconds", type=float, default=300.0,
                        help="bound on the whole benchmark (the sizes share it)")
    args = parser.parse_args()
    began = time.perf_counter()

    os.environ[knobs.DEVICE.name] = args.device
    fleet.init()
    comm = get_communicator()
    world = MPI.COMM_WORLD
    n = comm.size
    gpu = args.device == "gpu"
    torch_peer, why = ((None, "skipped (--no-gloo)") if args.no_gloo
                       else torch_group(world, args.device, args.gloo_timeout))
    peers = {"baseline": (("native NCCL", nccl_allreduce(world)) if gpu
                          else ("native MPI", mpi_allreduce(world))),
             "algorithms": ["ring", "hierarchical"], "torch": torch_peer,
             "torch_name": "torch nccl" if gpu else "gloo"}
    if comm.topology.local_size == n and not gpu:
        peers["algorithms"].append("shm")
    rows = []
    sizes = []
    nbytes = args.min_bytes
    while nbytes <= args.max_bytes:
        sizes.append(nbytes)
        nbytes *= 4
    for i, nbytes in enumerate(sizes):
        left = np.array([args.max_seconds - (time.perf_counter() - began)])
        world.Allreduce(MPI.IN_PLACE, left, op=MPI.MIN)
        if left[0] <= 0:
            rows.append((human(nbytes), "not timed: the --max-seconds bound was reached",
                         None, None, None, None))
            continue
        contestants = 2 + len(peers["algorithms"]) + (torch_peer is not None)
        budget = min(args.budget, left[0] / (len(sizes) - i) / contestants)
        results = time_size(nbytes, comm, peers, budget)
        base = results[peers["baseline"][0]]
        for name, seconds in results.items():
            algbw = nbytes / seconds / 1e9
            busbw = algbw * 2 * (n - 1) / n
            rows.append((human(nbytes), name, seconds, algbw, busbw, base / seconds))
    if comm.rank == 0:
        print_table(rows, comm, peers, why)
    if torch_peer is not None:
        torch_peer[1].destroy_process_group()


def print_table(rows, comm, peers, why):
    baseline = peers["baseline"][0]
    print(f"allreduce of float32, {comm.size} rank(s) on {comm.topology.num_nodes} node(s), "
          f"MPI: {MPI.Get_library_version().splitlines()[0].strip()}"
          + ("" if peers["torch"] else f"; {peers['torch_name']}: {why}"))
    print()
    print(f"| size | algorithm | time | algbw (GB/s) | busbw (GB/s) | speed vs {baseline} |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for size, name, seconds, algbw, busbw, ratio in rows:
        if seconds is None:
            print(f"| {size} | {name} | | | | |")
            continue
        shown = f"{seconds * 1e6:.0f} us" if seconds < 1e-2 else f"{seconds * 1e3:.1f} ms"
        print(f"| {size} | {name} | {shown} | {algbw:.2f} | {busbw:.2f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()

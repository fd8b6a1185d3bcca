"""Fixed cost of one collective call: the argument agreement every collective starts with.

    mpiexec -n 2 python benchmarks/agreement.py [--calls 500] [--rounds 10]

Prints, on rank 0, the time per call of:

- the exchange of one agreement row as a blocking ``Allgather`` (how the agreement exchanged
  its rows before the stall inspector),
- the polled exchange the stall inspector uses (``fleetmpi.comm.stall.gather_rows``),
- the whole ``agree`` step (row building, exchange, comparison),
- a one-element ``allreduce`` with the library's own algorithm, with the agreement at every
  call (``check="always"``), once per distinct call (``check=True``, the default: repeated
  calls make no exchange) and without it (``check=False``).

The variants run in alternating rounds of ``--calls`` calls and the median round is printed,
so a machine shared with other work slows them alike.
"""
import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import fleetmpi as fleet
from fleetmpi.comm import Communicator
from fleetmpi.comm.agreement import FIELDS, agree
from fleetmpi.comm.stall import gather_rows
from fleetmpi.world import topology

TABLES = {"collective": ("bench",)}


def per_call(fn, calls):
    MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    return MPI.COMM_WORLD.allreduce(elapsed, op=MPI.MAX) / calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    fleet.init()
    comm = MPI.COMM_WORLD.Dup()
    row = np.zeros(len(FIELDS), dtype=np.int64)
    rows = np.empty((comm.Get_size(), len(FIELDS)), dtype=np.int64)
    always = Communicator(topology(), check="always")
    once = Communicator(topology(), check=True)
    unchecked = Communicator(topology(), check=False)
    x = np.ones(1)
    variants = {
        "row exchange, blocking Allgather": lambda: comm.Allgather(row, rows),
        "row exchange, polled (stall inspector)": lambda: gather_rows(comm, row, "bench"),
        "agree (whole step)": lambda: agree(comm, "bench", TABLES),
        "allreduce(1 float64), check='always'":
            lambda: always.allreduce(x, algorithm="native"),
        "allreduce(1 float64), check once per call":
            lambda: once.allreduce(x, algorithm="native"),
        "allreduce(1 float64), check=False": lambda: unchecked.allreduce(x, algorithm="native"),
    }
    times = {name: [] for name in variants}
    for fn in variants.values():
        per_call(fn, args.calls // 5)
    for _ in range(args.rounds):
        for name, fn in variants.items():
            times[name].append(per_call(fn, args.calls))
    if comm.Get_rank() == 0:
        print(f"{comm.Get_size()} ranks, median of {args.rounds} rounds of {args.calls} calls")
        for name, seconds in times.items():
            print(f"{name:40s} {statistics.median(seconds) * 1e6:8.1f} us/call")


if __name__ == "__main__":
    main()

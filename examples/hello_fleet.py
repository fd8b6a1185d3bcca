"""The smallest real fleetmpi job: every rank joins, rank 0 writes a strategy, every rank
reads it back, and all ranks check over MPI that they hold the same strategy.

    mpiexec -n 2 python examples/hello_fleet.py
"""
import hashlib
import os
import sys
import tempfile

import numpy as np
from mpi4py import MPI

import fleetmpi as fleet


def main():
    fleet.init(is_collective=True)
    world = MPI.COMM_WORLD
    path = os.path.join(tempfile.gettempdir(), f"fleetmpi-hello-{os.getppid()}.prototxt")
    path = world.bcast(path if fleet.is_first_worker() else None, root=0)

    if fleet.is_first_worker():
        strategy = fleet.DistributedStrategy()
        strategy.gradient_merge = True
        strategy.gradient_merge_configs = {"k_steps": 4, "avg": True}
        strategy.amp = True
        strategy.amp_configs = {"init_loss_scaling": 128}
        strategy.save_to_prototxt(path)
    fleet.barrier_worker()

    strategy = fleet.DistributedStrategy().load_from_prototxt(path)
    digest = hashlib.sha256(str(strategy).encode()).digest()
    mine = np.frombuffer(digest, dtype=np.uint8).astype(np.int64)
    lowest, highest = mine.copy(), mine.copy()
    world.Allreduce(MPI.IN_PLACE, lowest, op=MPI.MIN)
    world.Allreduce(MPI.IN_PLACE, highest, op=MPI.MAX)
    agree = bool(np.array_equal(lowest, highest))

    sys.stdout.write(f"worker {fleet.worker_index()}/{fleet.worker_num()} "
                     f"(node {fleet.node_index()}, local rank {fleet.local_rank()}/"
                     f"{fleet.local_size()}): strategy agrees on every rank: {agree}\n")
    sys.stdout.flush()
    fleet.barrier_worker()
    if fleet.is_first_worker():
        print(strategy)
        os.remove(path)
    if not agree:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

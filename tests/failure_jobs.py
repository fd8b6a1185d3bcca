"""Jobs that tests/test_failure.py, test_stall.py and test_environment.py start under a launcher.

    mpiexec -n N python tests/failure_jobs.py raise       # rank 1 raises, rank 0 waits
    mpiexec -n N python tests/failure_jobs.py raise-thread
    mpiexec -n N python tests/failure_jobs.py stall LATE COLLECTIVE [sleep|skip]
    mpiexec -n N python tests/failure_jobs.py place       # prints this rank's place
    mpiexec -n N python tests/failure_jobs.py exit0       # rank 1 leaves with os._exit(0)
    mpiexec -n N python tests/failure_jobs.py kill9       # rank 1 is killed with SIGKILL
    mpiexec -n N python tests/failure_jobs.py kill9-async # ... during an asynchronous allreduce
    mpiexec -n N python tests/failure_jobs.py nan         # rank 1's batch of step 3 holds a NaN
    mpiexec -n N python tests/failure_jobs.py damaged-checkpoint  # rank 1's file damaged
    mpiexec -n N python tests/failure_jobs.py amp-nan     # the last rank's batches all NaN

``raise``: rank 1 raises ``RuntimeError`` after ``fleet.init`` (in a thread for
``raise-thread``) while every other rank enters an allreduce that rank 1 never joins.
``stall``: every rank makes one ``COLLECTIVE`` call, then rank ``LATE`` sleeps a minute
(``sleep``) or leaves without the second call (``skip``) while the others make it;
``COLLECTIVE`` is a communicator's ``allreduce``, ``broadcast`` or ``barrier``,
``fleet.barrier_worker()``, ``checkpoint`` (a save into ``$FAILURE_JOB_DIR``), or
``allreduce_async`` (started and waited for, except by rank ``LATE``, which never waits on its
handles).
``exit0``: rank 1 leaves with status 0 without finalizing MPI while the others train on;
``kill9``: rank 1 prints its process id and kills itself with SIGKILL; ``kill9-async`` does so
just after every rank has started an asynchronous allreduce of 64 MiB, which the others wait on.
``nan``: data-parallel training whose rank 1 gets a NaN in its batch at step 3 (the non-finite
check at its default, ``stop``). ``damaged-checkpoint``: every rank saves a checkpoint into
``$FAILURE_JOB_DIR``, rank 1 flips a byte of its own file, and every rank loads.
``amp-nan``: data-parallel training under amp (``init_loss_scaling=8``) whose last rank's
batches all hold a NaN, so that every step is skipped.
"""
import os
import signal
import sys
import threading
import time

import numpy as np

import fleetmpi as fleet
from fleetmpi.training import checkpoint
from fleetmpi import nn, optimizer
from fleetmpi.comm import Communicator
from fleetmpi.world import topology

FAILURE_TEXT = "rank 1 fails on purpose"


def fail():
    raise RuntimeError(FAILURE_TEXT)


def fault():
    """Print when the fault happens (``FAULT <epoch seconds>``), for benchmarks/faults.py."""
    print(f"FAULT {time.time():.6f}", flush=True)


def call(comm, collective, late=None):
    x = np.ones(4)
    if collective == "allreduce_async":
        handle = comm.allreduce_async(x)
        if comm.rank != late:
            handle.wait()
    elif collective == "barrier_worker":
        fleet.barrier_worker()
    elif collective == "checkpoint":
        checkpoint.save(os.environ["FAILURE_JOB_DIR"], nn.Linear(2, 2), None, step=comm.rank)
    elif collective == "allreduce":
        comm.allreduce(x)
    elif collective == "broadcast":
        comm.broadcast(x)
    elif collective == "barrier":
        comm.barrier()
    else:
        raise ValueError(f"unknown collective {collective!r}")


def train_with_a_nan(rank):
    """Five data-parallel steps of a small MLP; rank 1's batch of step 3 holds a NaN."""
    fleet.seed(0)
    model = fleet.distributed_model(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
    opt = fleet.distributed_optimizer(optimizer.SGD(0.1, parameters=model.parameters()))
    rng = np.random.default_rng(rank)
    for step in range(5):
        x = rng.standard_normal((8, 4)).astype(np.float32)
        if step == 3 and rank == 1:
            x[0, 0] = np.nan
            fault()
        opt.minimize(model, nn.CrossEntropyLoss(), x, rng.integers(0, 2, 8))
    print(f"rank {rank} finished", flush=True)


def train_amp_on_nan(rank, size):
    """Twenty amp steps of a small MLP; every batch of the last rank holds a NaN."""
    fleet.seed(0)
    model = fleet.distributed_model(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
    strategy = fleet.DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {"init_loss_scaling": 8}
    opt = fleet.distributed_optimizer(optimizer.SGD(0.1, parameters=model.parameters()),
                                      strategy)
    rng = np.random.default_rng(rank)
    if rank == size - 1:
        fault()
    for _ in range(20):
        x = rng.standard_normal((8, 4)).astype(np.float32)
        if rank == size - 1:
            x[0, 0] = np.nan
        opt.minimize(model, nn.CrossEntropyLoss(), x, rng.integers(0, 2, 8))
    print(f"rank {rank} finished", flush=True)


def load_a_damaged_checkpoint(rank):
    """Every rank saves; rank 1 damages its own file; every rank loads."""
    directory = os.environ["FAILURE_JOB_DIR"]
    model = nn.Linear(4, 4)
    path = checkpoint.save(directory, model, None, step=1)
    fleet.barrier_worker()
    if rank == 1:
        with open(path, "r+b") as f:
            f.seek(64)
            byte = f.read(1)[0]
            f.seek(64)
            f.write(bytes([byte ^ 0xFF]))
        fault()
    checkpoint.load(directory, model)
    print(f"rank {rank} finished", flush=True)


def main(args):
    fleet.init()
    comm = Communicator(topology())
    mode = args[0]
    if mode.startswith("raise"):
        if comm.rank == 1:
            fault()
            if mode == "raise-thread":
                worker = threading.Thread(target=fail, name="loader")
                worker.start()
                worker.join()
                time.sleep(60)
            else:
                fail()
        comm.allreduce(np.ones(4))
        print(f"rank {comm.rank} left the allreduce", flush=True)
    elif mode == "stall":
        late, collective, how = int(args[1]), args[2], args[3]
        call(comm, collective, late)
        if comm.rank == late:
            fault()
            if how == "sleep":
                time.sleep(60)
            return
        call(comm, collective, late)
        print(f"rank {comm.rank} finished", flush=True)
    elif mode == "diverge":
        # Repeated calls skip the agreement; then rank 1 alone changes its arrays in place.
        x, out = np.ones(8), np.empty(8)
        for _ in range(3):
            comm.allreduce(x, out=out)
        if comm.rank == 1:
            x.dtype = out.dtype = np.float32
            fault()
        comm.allreduce(x, out=out)
        print(f"rank {comm.rank} finished", flush=True)
    elif mode.startswith("kill9"):
        handle = comm.allreduce_async(np.ones(8 << 20)) if mode == "kill9-async" else None
        if comm.rank == 1:
            print(f"rank 1 pid {os.getpid()}", flush=True)
            fault()
            os.kill(os.getpid(), signal.SIGKILL)
        if handle is not None:
            handle.wait()
        time.sleep(5)
        print(f"rank {comm.rank} finished", flush=True)
    elif mode == "exit0":
        if comm.rank == 1:
            fault()
            os._exit(0)
        time.sleep(5)
        print(f"rank {comm.rank} finished", flush=True)
    elif mode == "nan":
        train_with_a_nan(comm.rank)
    elif mode == "amp-nan":
        train_amp_on_nan(comm.rank, comm.size)
    elif mode == "damaged-checkpoint":
        load_a_damaged_checkpoint(comm.rank)
    elif mode == "place":
        print(f"place rank {fleet.worker_index()} of {fleet.worker_num()}", flush=True)
        comm.barrier()
    else:
        raise ValueError(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])

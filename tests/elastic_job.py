"""The training job of tests/test_elastic.py, started under ``fleetmpirun [--elastic]``.

    python elastic_job.py CHECKPOINTS OUT STEPS COMMIT_EVERY [DIE_RANK DIE_STEP [DIE_ATTEMPTS]]

Data parallelism with a fixed global batch of ``GLOBAL_BATCH`` samples, dealt by
``DistributedSampler`` (the same global batches at any number of ranks that divides it), and
Momentum, whose state must survive a restart. ``fleetmpi.training.elastic.State`` commits every
``COMMIT_EVERY`` steps and restores at start. In the first ``DIE_ATTEMPTS`` attempts (1 by
default), rank ``DIE_RANK`` prints ``FAULT <time> ...`` and kills itself with SIGKILL before
step ``DIE_STEP``; after a restart rank 0 prints ``RESUMED <time> ...`` once restored
(benchmarks/faults.py). Rank 0 prints the MPICH shared-memory segments it mapped
(``SEGMENTS name ...``). At the end every rank writes its parameters, the world size and the
attempt into ``OUT.<rank>.npz``.
"""
import os
import signal
import sys
import time

import numpy as np

import fleetmpi as fleet
from fleetmpi.training import elastic
from fleetmpi import nn
from fleetmpi.training.data import ArrayDataset, DistributedSampler
from fleetmpi.launch import shm
from strategy_support import make_mlp, make_strategy, momentum

GLOBAL_BATCH = 12
SAMPLES = 48  # four global batches an epoch


def dataset():
    rng = np.random.default_rng(3)
    return ArrayDataset(rng.standard_normal((SAMPLES, 6)), rng.integers(0, 4, SAMPLES))


def main(directory, out, steps, commit_every, die_rank=-1, die_step=-1, die_attempts=1):
    fleet.init(is_collective=True)
    rank, size = fleet.worker_index(), fleet.worker_num()
    if rank == 0:
        print("SEGMENTS", *sorted(shm.mapped_segments(os.getpid())), flush=True)
    fleet.seed(0)
    model = fleet.distributed_model(make_mlp((6, 16, 4)))
    opt = fleet.distributed_optimizer(momentum(model.parameters()), make_strategy())
    state = elastic.State(directory, model, opt, commit_every=commit_every)
    data = dataset()
    sampler = DistributedSampler(SAMPLES, GLOBAL_BATCH // size, seed=5)
    loss_fn = nn.CrossEntropyLoss()
    step = state.restore()
    if rank == 0 and state.restart_count:
        print(f"RESUMED {time.time():.6f} at step {step} on {size} rank(s)", flush=True)
    while step < steps:
        sampler.set_epoch(step // len(sampler))
        batches = list(sampler)
        for indices in batches[step % len(sampler):]:
            if step >= steps:
                break
            if rank == die_rank and step == die_step and state.restart_count < die_attempts:
                print(f"FAULT {time.time():.6f} rank {rank} before step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = data.batch(indices)
            opt.minimize(model, loss_fn, x, y)
            step += 1
            state.commit(step)
    np.savez(f"{out}.{rank}.npz", size=size, attempt=state.restart_count,
             **model.state_dict())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:]))

"""Jobs that tests/test_stall_repeats.py and test_uneven.py start under a launcher.

    mpiexec -n N python tests/stall_jobs.py repeat COLLECTIVE CALLS [ELEMENTS [ALGORITHM]]
    mpiexec -n N python tests/stall_jobs.py train IDIOM STEPS
    mpiexec -n N python tests/stall_jobs.py uneven IDIOM STEPS_0,STEPS_1,...
    mpiexec -n N python tests/stall_jobs.py leave WHERE
    mpiexec -n N python tests/stall_jobs.py diverge HOW

``repeat``: every rank makes ``CALLS - 1`` calls of ``COLLECTIVE`` on the same reused arrays
(``ELEMENTS`` float64 elements, ``ALGORITHM`` where the collective takes one); rank 1 then
hangs (sleeps a minute) while the others make call number ``CALLS``. ``COLLECTIVE`` is a
communicator's method, or ``allreduce_async``: started and waited for, except by rank 1,
which never waits on its handles.
``train``: a data-parallel training step in ``IDIOM`` (``minimize`` or ``backward``:
``loss.backward(); opt.step()``) ``STEPS - 1`` times, then rank 1 hangs before step ``STEPS``.
``uneven``: rank ``r`` trains ``STEPS_r`` steps on its own batches, then the script ends.
``leave``: rank 0 leaves its training loop after 2 steps for ``fleet.barrier_worker()``,
``checkpoint.save`` or an evaluation (``WHERE``: ``barrier``, ``checkpoint``, ``evaluate``)
while rank 1 trains a third step.
``diverge``: every rank broadcasts rank 0's array 3 times (repeated calls skip the argument
agreement), except that rank 1 skips the second broadcast (``HOW``: ``skip``) or passes
another shape to the third (``shape``); then the script ends. ``HOW`` ``allgather``: every
rank allgathers 3 times, rank 1's third array float32 where the others' are float64.
Each job prints ``FAULT <epoch seconds>`` when the fault happens, for benchmarks/faults.py.
"""
import os
import sys
import tempfile
import time

import numpy as np

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from fleetmpi.core import backend
from fleetmpi.training import checkpoint
from fleetmpi import nn, optimizer
from fleetmpi.comm import Communicator, get_communicator
from fleetmpi.world import topology

LATE = 1


def fault():
    print(f"FAULT {time.time():.6f}", flush=True)


def hang():
    fault()
    time.sleep(60)


def collective_call(comm, collective, elements, algorithm):
    """A function making one call of ``collective`` on arrays made once. The root of a
    broadcast or scatter is the rank that hangs, and a gather's is rank 0: a rank that only
    sends may finish its call before the others arrive."""
    x, out = np.ones(elements), np.empty(elements)
    arrays = [np.ones(elements // 2), np.ones(elements - elements // 2)]
    algo = {} if algorithm is None else {"algorithm": algorithm}
    calls = {
        "allreduce": lambda: comm.allreduce(x, out=out, **algo),
        "allreduce_many": lambda: comm.allreduce_many(arrays, **algo),
        "broadcast": lambda: comm.broadcast(x, root=LATE, **algo),
        "broadcast_many": lambda: comm.broadcast_many(arrays, root=LATE, **algo),
        "barrier": comm.barrier,
        "allgather": lambda: comm.allgather(x, **algo),
        "reduce_scatter": lambda: comm.reduce_scatter(x, **algo),
        "alltoall": lambda: comm.alltoall(x[:comm.size * (elements // comm.size)]),
        "allgatherv": lambda: comm.allgatherv(x[:comm.rank + 1],
                                              list(range(1, comm.size + 1))),
        "gather": lambda: comm.gather(x),
        "scatter": lambda: comm.scatter(x[:comm.size], root=LATE),
    }
    if collective == "allreduce_async":
        def started():
            handle = comm.allreduce_async(x, out=out)
            if comm.rank != LATE:
                handle.wait()
        return started
    return calls[collective]


def repeat(collective, calls, elements=1000, algorithm=None):
    fleet.init()
    comm = Communicator(topology())
    call = collective_call(comm, collective, elements, algorithm)
    for _ in range(calls - 1):
        call()
    if comm.rank == LATE:
        hang()
    call()
    print(f"rank {comm.rank} finished", flush=True)


def model_and_optimizer():
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = fleet.distributed_model(nn.Sequential(nn.Linear(6, 8, dtype="float64"), nn.Tanh(),
                                                  nn.Linear(8, 3, dtype="float64")))
    opt = optimizer.Momentum(learning_rate=0.1, momentum=0.9, parameters=model.parameters())
    return model, fleet.distributed_optimizer(opt)


def batch(rank, step):
    rng = np.random.default_rng(1000 * rank + step)
    return rng.standard_normal((4, 6)), rng.integers(0, 3, 4)


def train_step(model, opt, idiom, x, y):
    if idiom == "minimize":
        opt.minimize(model, nn.CrossEntropyLoss(), x, y)
        return
    loss = F.cross_entropy(model(fleet.to_tensor(x)), fleet.to_tensor(y))
    loss.backward()
    opt.step()
    opt.clear_grad()


def train(idiom, steps):
    model, opt = model_and_optimizer()
    rank = fleet.worker_index()
    for step in range(1, steps + 1):
        if step == steps and rank == LATE:
            hang()
        train_step(model, opt, idiom, *batch(rank, step))
    print(f"rank {rank} finished", flush=True)


def uneven(idiom, counts):
    model, opt = model_and_optimizer()
    rank = fleet.worker_index()
    for step in range(counts[rank]):
        train_step(model, opt, idiom, *batch(rank, step))
    if counts[rank] == min(counts):
        fault()  # this rank ran out of batches first
    print(f"rank {rank} finished", flush=True)


def leave(where):
    model, opt = model_and_optimizer()
    rank = fleet.worker_index()
    for step in range(1, 4):
        if step == 3 and rank == 0:
            fault()
            if where == "barrier":
                fleet.barrier_worker()
            elif where == "checkpoint":
                checkpoint.save(tempfile.mkdtemp(), model, opt, step=step)
            else:
                x, _ = batch(rank, step)
                scores = model(fleet.to_tensor(x)).numpy()
                get_communicator().allreduce(scores.mean(axis=0))
            break
        train_step(model, opt, "backward", *batch(rank, step))
    print(f"rank {rank} finished", flush=True)


def diverge(how):
    fleet.init()
    comm = Communicator(topology())
    if how == "allgather":
        for call in range(1, 4):
            late = comm.rank == LATE and call == 3
            if late:
                fault()
            comm.allgather(np.ones(4, np.float32 if late else np.float64))
        print(f"rank {comm.rank} finished", flush=True)
        return
    for call in range(1, 4):
        late = comm.rank == LATE
        if late and call == 2 and how == "skip":
            fault()
            continue
        if late and call == 3 and how == "shape":
            fault()
            comm.broadcast(np.ones(5), root=0)
            continue
        comm.broadcast(np.ones(4), root=0)
    print(f"rank {comm.rank} finished", flush=True)


def main(args):
    mode = args[0]
    if mode == "repeat":
        repeat(args[1], int(args[2]), *([int(args[3])] if len(args) > 3 else []),
               *(args[4:5]))
    elif mode == "train":
        train(args[1], int(args[2]))
    elif mode == "uneven":
        uneven(args[1], [int(v) for v in args[2].split(",")])
    elif mode == "leave":
        leave(args[1])
    elif mode == "diverge":
        diverge(args[1])
    else:
        raise ValueError(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1:])

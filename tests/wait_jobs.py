"""Jobs that tests/test_every_wait.py and benchmarks/faults.py start under a launcher: waits
outside the collectives, each of which must be reported and end the job.

    fleetmpirun --np 2 python tests/wait_jobs.py recv HOW
    fleetmpirun --np 2 python tests/wait_jobs.py pipeline HOW
    fleetmpirun --np 2 python tests/wait_jobs.py exit broadcast
    FLEETMPI_TIMELINE=FOLDER mpiexec -n 2 python tests/wait_jobs.py timeline allreduce

``recv``: rank 1 sends rank 0 one array, then rank 0 waits for a second while rank 1, instead
of sending it, sleeps a minute (``HOW``: ``sleep``), ends its script (``finish``), waits in a
``recv`` from rank 0 (``recv``) or in a ``barrier`` (``barrier``).
``pipeline``: a 2-stage ``PipelineLayer`` trained by ``train_batch``; at step 2 the last
stage's loss raises, which the script catches; that rank then ends its script (``finish``)
or sleeps a minute (``sleep``), and the first stage waits for gradients that never come.
``exit``: every rank makes 10 broadcasts from rank 0, except rank 1, which hangs (sleeps a
minute) before its last: rank 0's broadcast, a send, returns, and rank 0 ends its script.
``timeline``: 3 allreduces, then the script ends (the timeline is written at exit).
Every rank prints ``PID <pid>`` and ``SEGMENTS <the MPICH segments it mapped>`` once started,
and the job prints ``FAULT <epoch seconds>`` when the fault happens.
"""
import os
import sys
import time

import numpy as np

import fleetmpi as fleet
from fleetmpi import nn, optimizer
from fleetmpi.comm import Communicator
from fleetmpi.launch import shm
from fleetmpi.meta_parallel import LayerDesc, PipelineLayer
from fleetmpi.world import topology


def started():
    print(f"PID {os.getpid()}", flush=True)
    print("SEGMENTS", *sorted(shm.mapped_segments(os.getpid())), flush=True)


def fault():
    print(f"FAULT {time.time():.6f}", flush=True)


def peer_fault(how, comm):
    """Rank 1's way of not sending (module docstring)."""
    fault()
    if how == "sleep":
        time.sleep(60)
    elif how == "recv":
        comm.recv(np.empty(3), 0)
    elif how == "barrier":
        comm.barrier()
    elif how != "finish":
        raise ValueError(f"unknown HOW {how!r}")


def recv_job(how):
    fleet.init()
    started()
    comm = Communicator(topology())
    if comm.rank == 1:
        comm.send(np.arange(3.0), 0)
        peer_fault(how, comm)
    else:
        comm.recv(np.empty(3), 1)
        comm.recv(np.empty(3), 1)
    print(f"rank {comm.rank} finished", flush=True)


class FailingLoss(nn.Layer):
    """Cross entropy that raises at its call ``fail_at_call`` (one call per micro-batch, two
    per step: call 3 is step 2's first)."""

    def __init__(self, fail_at_call):
        super().__init__()
        self.calls, self.fail_at_call = 0, fail_at_call
        self.loss = nn.CrossEntropyLoss()

    def forward(self, logits, labels):
        self.calls += 1
        if self.calls == self.fail_at_call:
            fault()
            raise RuntimeError("the last stage's loss fails on purpose")
        return self.loss(logits, labels)


def pipeline_job(how):
    strategy = fleet.DistributedStrategy()
    strategy.pipeline = True
    strategy.pipeline_configs = {"accumulate_steps": 2, "micro_batch_size": 4}
    fleet.init(is_collective=True, strategy=strategy)
    started()
    sizes = [6, 16, 12, 4]
    descs = []
    for a, b in zip(sizes, sizes[1:]):
        descs += [LayerDesc(nn.Linear, a, b, dtype="float64"), LayerDesc(nn.Tanh)]
    layer = PipelineLayer(descs[:-1], num_stages=2, loss_fn=FailingLoss(fail_at_call=3),
                          seg_method="uniform")
    model = fleet.distributed_model(layer)
    opt = fleet.distributed_optimizer(
        optimizer.Momentum(learning_rate=0.05, momentum=0.9, parameters=model.parameters()),
        strategy)
    rank = fleet.worker_index()
    for step in range(3):
        rng = np.random.default_rng(step)
        batch = [rng.standard_normal((8, 6)), rng.integers(0, 4, 8)]
        try:
            model.train_batch(batch, opt)
        except RuntimeError as error:
            print(f"rank {rank} caught: {error}", flush=True)
            if how == "sleep":
                time.sleep(60)
            break
    print(f"rank {rank} finished", flush=True)


def timeline_job(collective):
    fleet.init()
    started()
    comm = Communicator(topology())
    for _ in range(3):
        getattr(comm, collective)(np.ones(4))
    fault()
    print(f"rank {comm.rank} finished", flush=True)


def exit_job(collective):
    fleet.init()
    started()
    comm = Communicator(topology())
    x = np.arange(4.0)
    for call in range(10):
        if call == 9 and comm.rank == 1:
            fault()
            time.sleep(60)
        getattr(comm, collective)(x, root=0)
    print(f"rank {comm.rank} finished", flush=True)


if __name__ == "__main__":
    mode, how = sys.argv[1:3]
    {"recv": recv_job, "pipeline": pipeline_job, "exit": exit_job,
     "timeline": timeline_job}[mode](how)

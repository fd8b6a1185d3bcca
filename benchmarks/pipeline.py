"""Step time and measured bubble fraction of a 2-stage pipeline against micro_batch.

    python benchmarks/pipeline.py [--micro-batches 1 2 4 8] [--width 1024] [--layers 4]
                                  [--batch 512] [--steps 6] [--schedule-mode 1F1B]

Starts ``mpiexec -n 2`` itself (``--worker`` is the per-rank part). The model is two stages of
nearly equal cost: each holds ``--layers`` Linear(width, width)+Tanh layers; the last stage also
holds the Linear(width, 10) head (1/width of one layer's work more), and the first stage
computes no gradient for its input, the batch (one matrix product of the 3 x ``--layers`` of a
step less). The mini-batch of ``--batch`` samples is split into ``micro_batch`` micro-batches;
``OMP_NUM_THREADS=1`` keeps each rank on one core.

For each micro_batch, after a warm-up step, every rank times ``--steps`` steps (each after a
barrier) and reads the strategy's ``compute_seconds`` (time spent in its own forward and
backward passes) and ``schedule_seconds`` (the wall time of those passes with the waits and
transfers between them; the optimizer update after them is not part of the pipeline). The
bubble of a rank in a step is ``1 - compute_seconds / schedule_seconds``: the share of the
schedule it spends waiting for its neighbour or moving activations; the table gives the median
over the steps of the mean over the two ranks, next to the formula
``(stages - 1) / (micro_batch + stages - 1)`` for equal-cost stages and free communication.
"""
import argparse
import os
import subprocess
import sys
import time

import numpy as np

STAGES = 2
CLASSES = 10


def staged_model(width, layers):
    import fleetmpi as fleet
    from fleetmpi import nn

    parts = []
    for stage in range(STAGES):
        with fleet.device_guard(f"stage:{stage}"):
            for i in range(layers):
                parts.append((f"fc_s{stage}_{i}", nn.Linear(width, width)))
                parts.append((f"act_s{stage}_{i}", nn.Tanh()))
            if stage == STAGES - 1:
                parts.append(("head", nn.Linear(width, CLASSES)))
    return nn.Sequential(*parts)


def worker(args):
    import fleetmpi as fleet
    from fleetmpi.core import backend
    from fleetmpi import nn, optimizer
    from fleetmpi.comm import get_communicator

    fleet.init(is_collective=True)
    comm = get_communicator()
    rows = []
    for micro_batch in args.micro_batches:
        backend.manual_seed(0)
        model = fleet.distributed_model(staged_model(args.width, args.layers))
        strategy = fleet.DistributedStrategy()
        strategy.pipeline = True
        strategy.pipeline_configs = {"micro_batch": micro_batch,
                                     "schedule_mode": args.schedule_mode}
        opt = fleet.distributed_optimizer(
            optimizer.Momentum(learning_rate=0.01, parameters=model.parameters()), strategy)
        pipeline = opt.strategies["pipeline"]
        rng = np.random.default_rng(0)
        x = rng.standard_normal((args.batch, args.width)).astype(np.float32)
        y = rng.integers(0, CLASSES, args.batch)
        loss_fn = nn.CrossEntropyLoss()
        opt.minimize(model, loss_fn, x, y)
        times, bubbles = [], []
        for _ in range(args.steps):
            comm.barrier()
            start = time.perf_counter()
            opt.minimize(model, loss_fn, x, y)
            elapsed = time.perf_counter() - start
            bubble = 1 - pipeline.compute_seconds / pipeline.schedule_seconds
            both = comm.allgather(np.array([elapsed, bubble]), stack=True)
            times.append(both[:, 0].max())
            bubbles.append(both[:, 1].mean())
        rows.append((micro_batch, float(np.median(times)), float(np.median(bubbles))))
    if fleet.worker_index() == 0:
        print(f"2 stages, {args.layers} x Linear({args.width}) + Tanh per stage, batch "
              f"{args.batch}, {args.schedule_mode}, median of {args.steps} steps")
        print()
        print("| micro_batch | step time (ms) | measured bubble | (S-1)/(M+S-1) |")
        print("| ---: | ---: | ---: | ---: |")
        for micro_batch, step, bubble in rows:
            formula = (STAGES - 1) / (micro_batch + STAGES - 1)
            print(f"| {micro_batch} | {step * 1e3:.1f} | {bubble:.3f} | {formula:.3f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--schedule-mode", default="1F1B", choices=["1F1B", "F-then-B"])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    from fleetmpi.launch.mpi_command import local_command

    command = local_command(STAGES, [sys.executable, os.path.abspath(__file__), "--worker"]
                            + sys.argv[1:])
    sys.exit(subprocess.run(command, env=env, timeout=1800).returncode)


if __name__ == "__main__":
    main()

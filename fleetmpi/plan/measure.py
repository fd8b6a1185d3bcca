"""Measured step time of data-parallel training, for checking the planner against.

    mpiexec -n 2 python -m fleetmpi.plan.measure --model mlp:64,256,256,10 --batch 64

trains the model with ``fleet.distributed_optimizer`` (Momentum, the strategy of
``--algorithm``) on synthetic data, cycling through ``BATCHES`` different batches so that the
gradients keep the size they have in training (on one repeated batch they shrink towards zero,
and NumPy's float16 conversion of tiny values is many times slower). It reports the median and
the fastest, over ``--windows`` windows of ``--steps`` steps, of the seconds per step (every
window starts and ends with a barrier). At one rank this is the compute time per step the
planner takes as its input.
"""
import argparse
import time

import numpy as np

from . import jobs

BATCHES = 8
STRATEGY_FLAGS = {"ring": {}, "hierarchical": {"use_hierarchical_allreduce": True},
                  "fp16": {"fp16_allreduce": True}}


def measure_step(spec, batch, ranks, algorithm="ring", steps=10, windows=5, timeout=300,
                 statistic="median"):
    """Seconds per step of ``spec`` (see ``buckets.model_from_spec``) on ``ranks`` ranks: the
    median over the windows, or with ``statistic="best"`` the fastest window (the one least
    disturbed by other work on a shared machine)."""
    if statistic not in ("median", "best"):
        raise ValueError(f"statistic={statistic!r} is not known; allowed: 'median', 'best'")
    result = jobs.run("fleetmpi.plan.measure", ranks,
                      ["--model", spec, "--batch", batch, "--algorithm", algorithm,
                       "--steps", steps, "--windows", windows], timeout=timeout)
    return result["step_s" if statistic == "median" else "best_step_s"]


def _input_shape(spec):
    if spec.startswith("mlp:"):
        return (int(spec[4:].split(",")[0]),)
    return (3, 32, 32) if spec == "resnet20" else (3, 224, 224)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--algorithm", choices=sorted(STRATEGY_FLAGS), default="ring")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--windows", type=int, default=5)
    args = parser.parse_args()

    import fleetmpi as fleet
    from fleetmpi.core import backend
    from fleetmpi import nn, optimizer
    from mpi4py import MPI

    from .buckets import model_from_spec

    fleet.init(is_collective=True)
    model = fleet.distributed_model(model_from_spec(args.model))
    strategy = fleet.DistributedStrategy()
    strategy.fuse_all_optimizer_ops = True
    for field, value in STRATEGY_FLAGS[args.algorithm].items():
        setattr(strategy, field, value)
    opt = fleet.distributed_optimizer(optimizer.Momentum(
        learning_rate=0.01, momentum=0.9, parameters=model.parameters()), strategy)
    loss_fn = nn.CrossEntropyLoss()
    world = MPI.COMM_WORLD
    rng = np.random.default_rng(world.Get_rank())
    with fleet.no_grad():
        # Outside a recorded step: calling the model here opens no training step.
        classes = model(np.zeros((1,) + _input_shape(args.model), np.float32)).shape[1]
    xs = rng.standard_normal((BATCHES, args.batch) + _input_shape(args.model),
                             dtype=np.float32)
    ys = rng.integers(0, classes, (BATCHES, args.batch))
    for i in range(2):
        opt.minimize(model, loss_fn, xs[i], ys[i])
    per_window = []
    for _ in range(args.windows):
        world.Barrier()
        start = time.perf_counter()
        for i in range(args.steps):
            opt.minimize(model, loss_fn, xs[i % BATCHES], ys[i % BATCHES])
        backend.synchronize()
        world.Barrier()
        per_window.append((time.perf_counter() - start) / args.steps)
    if world.Get_rank() == 0:
        jobs.report({"step_s": float(np.median(per_window)),
                     "best_step_s": float(np.min(per_window))})


if __name__ == "__main__":
    main()

"""strategy.auto next to plain data parallel: calibration seconds, the setting chosen, and the
step time of the chosen setting against the default strategy's, on the digits MLP and a larger
MLP.

    python benchmarks/auto.py [--ranks 2] [--steps 30] [--rounds 3] [--auto-seconds 3]

One ``mpiexec`` job per run. For each model two copies start from the same weights: one under
the default ``DistributedStrategy`` (plain data parallel), one under ``strategy.auto`` (whose
first ``minimize`` calibrates, timed on its own). Then both train on the same batches in
alternating blocks of ``--steps`` steps, ``--rounds`` times, so drifts of a shared machine hit
both alike; a block's time is the slowest rank's, and the table shows the median block per
step. Rank 0 prints auto's own report as each model calibrates, then the table.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np

MODELS = {
    # name: (layer widths, batch per rank, batch norm)
    "digits MLP 64-256-256-10, batch norm": ((64, 256, 256, 10), 32, True),
    "MLP 512-1024-1024-1024-10": ((512, 1024, 1024, 1024, 10), 64, False),
}


def make_model(widths, batch_norm):
    from fleetmpi import nn

    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append((f"fc{i}", nn.Linear(fan_in, fan_out)))
        if i < len(widths) - 2:
            if batch_norm:
                layers.append((f"bn{i}", nn.BatchNorm1D(fan_out)))
            layers.append((f"act{i}", nn.ReLU()))
    return nn.Sequential(*layers)


def batches(widths, batch, rank, digits):
    """The same endless stream of per-rank batches for both copies of a model."""
    if digits is not None:
        features, labels = digits.features, digits.labels
    else:
        rng = np.random.default_rng(7)
        features = rng.standard_normal((16 * batch, widths[0])).astype(np.float32)
        labels = rng.integers(0, widths[-1], len(features))
    count = len(features) // batch
    index = rank
    while True:
        lo = (index % count) * batch
        yield features[lo:lo + batch], labels[lo:lo + batch]
        index += 1


def slowest(seconds):
    from mpi4py import MPI

    return MPI.COMM_WORLD.allreduce(seconds, op=MPI.MAX)


def block(opt, model, loss_fn, stream, steps):
    import fleetmpi as fleet

    fleet.barrier_worker()
    begin = time.perf_counter()
    for _ in range(steps):
        x, y = next(stream)
        opt.minimize(model, loss_fn, x, y)
    return slowest(time.perf_counter() - begin) / steps


def run_model(name, args, digits):
    import fleetmpi as fleet
    from fleetmpi.core import backend
    from fleetmpi import nn, optimizer

    widths, batch, batch_norm = MODELS[name]
    copies = {}
    for label in ("default", "auto"):
        backend.manual_seed(args.seed)
        model = fleet.distributed_model(make_model(widths, batch_norm))
        strategy = fleet.DistributedStrategy()
        strategy.auto = label == "auto"
        opt = fleet.distributed_optimizer(
            optimizer.Momentum(learning_rate=0.01, momentum=0.9, parameters=model.parameters()),
            strategy, **({"auto_seconds": args.auto_seconds} if strategy.auto else {}))
        stream = batches(widths, batch, fleet.worker_index(), digits if batch_norm else None)
        copies[label] = (opt, model, nn.CrossEntropyLoss(), stream)
    block(*copies["auto"], 1)
    report = fleet.applied_strategy().calibration
    block(*copies["default"], 1)
    times = {"default": [], "auto": []}
    for _ in range(args.rounds):
        for label in ("default", "auto"):
            times[label].append(block(*copies[label], args.steps))
    default, chosen = (statistics.median(times[k]) for k in ("default", "auto"))
    return dict(name=name, batch=batch, calibration=report.seconds, chosen=report.chosen.name,
                default=default, auto=chosen)


def worker(args):
    import fleetmpi as fleet
    from fleetmpi.training import data

    fleet.init(is_collective=True)
    digits, _ = data.load_digits()
    rows = [run_model(name, args, digits) for name in MODELS]
    if fleet.is_first_worker():
        print_table(rows, args)


def print_table(rows, args):
    print(f"{args.ranks} ranks, CPU, Momentum; auto_seconds {args.auto_seconds:g}; step times "
          f"the median of {args.rounds} blocks of {args.steps} steps, slowest rank")
    print()
    print("| model | batch per rank | default DP ms/step | auto's choice | auto ms/step | "
          "speed-up | calibration s | calibration in steps of default DP | share of a "
          "10,000-step run |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        steps = r["calibration"] / r["default"]
        print(f"| {r['name']} | {r['batch']} | {r['default'] * 1e3:.2f} | {r['chosen']} | "
              f"{r['auto'] * 1e3:.2f} | {r['default'] / r['auto']:.2f}x | "
              f"{r['calibration']:.2f} | {steps:.0f} | {steps / 10000:.2%} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--auto-seconds", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    env = dict(os.environ, FLEETMPI_DEVICE=os.environ.get("FLEETMPI_DEVICE", "cpu"),
               OMP_NUM_THREADS="1")
    from fleetmpi.launch.mpi_command import local_command

    command = local_command(args.ranks, [
        sys.executable, os.path.abspath(__file__), "--worker", "--steps", str(args.steps),
        "--rounds", str(args.rounds), "--auto-seconds", str(args.auto_seconds),
        "--seed", str(args.seed), "--ranks", str(args.ranks)])
    sys.exit(subprocess.run(command, env=env).returncode)


if __name__ == "__main__":
    main()

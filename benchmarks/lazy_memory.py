"""Whole-process peak memory of building and training a user's MLP under data parallel and
sharding, with and without ``LazyGuard``.

    python benchmarks/lazy_memory.py [--ranks 4] [--layers 8] [--width 512] [--batch 64]
                                     [--steps 2] [--fuse_grad_MB 1]

For each configuration one ``mpiexec`` job runs the ranks. Each rank starts ``tracemalloc``
(NumPy reports its allocations to it) right after ``fleet.init()`` and reads its peak twice:
after the model, ``distributed_model``, Adam and ``distributed_optimizer`` are built (the
construction peak), and after ``--steps`` training steps (the whole-process peak, construction
included). Each figure is the largest over the ranks; the ratio is to data parallel's. The model
is a user's ``nn.Layer``: ``--layers`` Linear layers of ``--width`` x ``--width`` with ReLU,
then a head of 10 classes, float32. Every configuration uses ``fuse_grad_size_in_MB =
--fuse_grad_MB``: under stages 2 and 3 a gradient bucket holds storage from backward's first
write into it until it is reduce-scattered, so the bucket size bounds that part of a step.
"""
import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tracemalloc

import numpy as np

# name: (sharding stage, 0 for data parallel; built under LazyGuard)
CONFIGS = {"dp": (0, False), "stage 1": (1, False), "stage 2": (2, False),
           "stage 3": (3, False), "stage 1, LazyGuard": (1, True),
           "stage 3, LazyGuard": (3, True)}
TARGET = ("stage 3, LazyGuard", 0.35)
MIB = 2 ** 20


def _model(args):
    from fleetmpi import nn
    import fleetmpi.nn.functional as F

    class Net(nn.Layer):
        def __init__(self):
            super().__init__()
            self.blocks = nn.LayerList([nn.Linear(args.width, args.width)
                                        for _ in range(args.layers)])
            self.head = nn.Linear(args.width, 10)

        def forward(self, x):
            for block in self.blocks:
                x = F.relu(block(x))
            return self.head(x)

    return Net()


def rank_main(args):
    """One rank of one configuration: prints a JSON line of its peaks and last loss."""
    import fleetmpi as fleet
    import fleetmpi.nn.functional as F
    from fleetmpi import backend, optimizer

    fleet.init(is_collective=True)
    stage, lazy = CONFIGS[args.config]
    strategy = fleet.DistributedStrategy()
    strategy.fuse_grad_size_in_MB = args.fuse_grad_MB
    if stage:
        strategy.sharding = True
        strategy.sharding_configs = {"stage": stage}
    rng = np.random.default_rng(fleet.worker_index())
    x = rng.standard_normal((args.batch, args.width)).astype(np.float32)
    y = rng.integers(0, 10, args.batch)
    tracemalloc.start()
    backend.manual_seed(0)
    with fleet.LazyGuard() if lazy else contextlib.nullcontext():
        model = _model(args)
    model = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(optimizer.Adam(parameters=model.parameters()), strategy)
    construction = tracemalloc.get_traced_memory()[1]
    for _ in range(args.steps):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(json.dumps({"rank": fleet.worker_index(), "construction": construction,
                      "peak": peak, "loss": float(backend.to_numpy(loss.data))}), flush=True)


def run_config(args, config):
    """``{"construction", "peak"}``: the largest over the ranks of one mpiexec job."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    command = [mpiexec if os.path.exists(mpiexec) else "mpiexec", "-n", str(args.ranks),
               sys.executable, os.path.abspath(__file__), "--config", config,
               "--layers", str(args.layers), "--width", str(args.width),
               "--batch", str(args.batch), "--steps", str(args.steps),
               "--fuse_grad_MB", str(args.fuse_grad_MB)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    # The ranks' lines may interleave in the job's output.
    rows = [json.loads(found) for found in re.findall(r"\{[^{}]*\}", done.stdout)]
    if done.returncode or len(rows) != args.ranks:
        raise RuntimeError(f"{config}: mpiexec exit status {done.returncode}\n"
                           f"{done.stdout}\n{done.stderr[-4000:]}")
    return {key: max(row[key] for row in rows) for key in ("construction", "peak")}


def report(args, results):
    parameters = args.layers * (args.width + 1) * args.width + (args.width + 1) * 10
    lines = [f"{args.layers} x Linear {args.width}x{args.width} + head of 10, float32 "
             f"({parameters:,} parameters, {parameters * 4 / MIB:.2f} MiB); Adam; {args.ranks} "
             f"ranks; per-rank batch {args.batch}; {args.steps} steps; fuse_grad_size_in_MB "
             f"{args.fuse_grad_MB}; tracemalloc from after fleet.init(), largest over the ranks",
             "", "| run | construction peak MiB | / DP | peak, construction and steps, MiB "
             "| / DP |", "| --- | ---: | ---: | ---: | ---: |"]
    dp = results["dp"]
    for config, row in results.items():
        lines.append(f"| {config} | {row['construction'] / MIB:.2f} | "
                     f"{row['construction'] / dp['construction']:.3f} | "
                     f"{row['peak'] / MIB:.2f} | {row['peak'] / dp['peak']:.3f} |")
    name, target = TARGET
    ratio = results[name]["peak"] / dp["peak"]
    lines += ["", f"target {name} <= {target:.2f}x of data parallel's peak: {ratio:.3f}x, "
                  f"{'met' if ratio <= target else 'MISSED'}"]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--fuse_grad_MB", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mpiexec job")
    parser.add_argument("--config", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.config:
        rank_main(args)
        return
    print(report(args, {config: run_config(args, config) for config in CONFIGS}))


if __name__ == "__main__":
    main()

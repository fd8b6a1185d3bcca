"""Optimizer-state bytes per rank and step time of sharding next to plain data parallel.

    python benchmarks/sharding.py [--ranks 1 2 4] [--width 1024] [--layers 4] [--steps 20]

For each rank count one ``mpiexec`` job trains a float32 MLP (``--layers`` Linear+ReLU layers
of ``--width``) with Momentum and with Adam, each under plain data parallelism and under
``sharding``, from the same weights on the same data (a per-rank batch of 64). Per
configuration it reports the largest optimizer-state bytes any rank holds
(``Optimizer.state_nbytes``), the median step time over ``--steps`` timed steps after two
warm-up steps (the slowest rank's; the ranks start each step together after a barrier, and the
two runs alternate step by step so that both see the same load on the machine), and the
ratios sharding / data parallel, and the largest difference between the parameters the two
runs end with (float32: the reduce-scatter sums in another order than the allreduce, and those
last-bit differences grow over the steps; in float64 the two agree to 1e-16).
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

PER_RANK_BATCH = 64
CLASSES = 10


def worker(width, layers, steps):
    import fleetmpi as fleet
    from fleetmpi import backend, nn, optimizer
    from mpi4py import MPI

    fleet.init(is_collective=True)
    rank, size = fleet.worker_index(), fleet.worker_num()
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((PER_RANK_BATCH, width)).astype(np.float32)
    y = rng.integers(0, CLASSES, PER_RANK_BATCH)
    makers = {
        "Momentum": lambda ps: optimizer.Momentum(learning_rate=0.01, momentum=0.9,
                                                  parameters=ps),
        "Adam": lambda ps: optimizer.Adam(learning_rate=1e-4, parameters=ps),
    }
    def build(make, sharded):
        backend.manual_seed(0)
        body = []
        for i in range(layers):
            body += [(f"fc{i}", nn.Linear(width, width)), (f"act{i}", nn.ReLU())]
        model = fleet.distributed_model(nn.Sequential(*body, ("out", nn.Linear(width, CLASSES))))
        strategy = fleet.DistributedStrategy()
        strategy.sharding = sharded
        return model, fleet.distributed_optimizer(make(model.parameters()), strategy)

    def most(value, op):
        result = np.empty_like(value)
        MPI.COMM_WORLD.Allreduce(value, result, op=op)
        return result

    loss_fn = nn.CrossEntropyLoss()
    rows = []
    for name, make in makers.items():
        runs = {sharded: build(make, sharded) for sharded in (False, True)}
        times = {sharded: [] for sharded in runs}
        for _ in range(steps + 2):
            # Alternate the two runs step by step, so that both see the same load.
            for sharded, (model, opt) in runs.items():
                MPI.COMM_WORLD.Barrier()
                start = time.perf_counter()
                opt.minimize(model, loss_fn, x, y)
                backend.synchronize()
                times[sharded].append(time.perf_counter() - start)
        result = {}
        for sharded, (model, opt) in runs.items():
            slowest = most(np.array(times[sharded]), MPI.MAX)
            state = most(np.array([opt.inner.state_nbytes()], dtype=np.int64), MPI.MAX)
            params = np.concatenate([v.reshape(-1) for v in model.state_dict().values()])
            result[sharded] = (int(state[0]), float(np.median(slowest[2:])), params)
        (dp_bytes, dp_time, dp_params), (sh_bytes, sh_time, sh_params) = \
            result[False], result[True]
        rows.append({"ranks": size, "optimizer": name, "dp_bytes": dp_bytes,
                     "sharded_bytes": sh_bytes, "dp_ms": dp_time * 1e3,
                     "sharded_ms": sh_time * 1e3,
                     "difference": float(np.abs(sh_params - dp_params).max()),
                     "largest": float(np.abs(dp_params).max())})
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)


def launch(ranks, args):
    from fleetmpi.launch.mpi_command import local_command

    command = local_command(ranks) + [sys.executable, os.path.abspath(__file__), "--worker",
                                      "--width", str(args.width), "--layers", str(args.layers),
                                      "--steps", str(args.steps)]
    env = dict(os.environ, FLEETMPI_DEVICE=os.environ.get("FLEETMPI_DEVICE", "cpu"))
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"mpiexec -n {ranks} failed:\n{done.stdout}\n{done.stderr}")


def table(rows, width, layers):
    parameters = layers * (width * width + width) + width * CLASSES + CLASSES
    lines = [f"float32 MLP, {layers} x {width} + {CLASSES} ({parameters:,} parameters), "
             f"per-rank batch {PER_RANK_BATCH}", "",
             "| ranks | optimizer | state bytes/rank, DP | state bytes/rank, sharding | "
             "ratio | step ms, DP | step ms, sharding | ratio | max abs parameter difference |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['ranks']} | {r['optimizer']} | {r['dp_bytes']:,} | "
                     f"{r['sharded_bytes']:,} | {r['sharded_bytes'] / r['dp_bytes']:.3f} | "
                     f"{r['dp_ms']:.1f} | {r['sharded_ms']:.1f} | "
                     f"{r['sharded_ms'] / r['dp_ms']:.2f} | {r['difference']:.1e} "
                     f"(largest parameter {r['largest']:.2f}) |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.width, args.layers, args.steps)
        return
    rows = []
    for ranks in args.ranks:
        rows += launch(ranks, args)
    print(table(rows, args.width, args.layers))


if __name__ == "__main__":
    main()

"""Training throughput of parameter-server mode (sync, async, GEO) against collective data
parallelism, at 2 servers x 2 workers (collective: the 2 workers alone).

    python benchmarks/pserver.py [--steps 300] [--rows 1000000] [--big-rows 10000000]

Models: the digits MLP (64-256-256-10, batch 32 per worker) and a sparse embedding model
(8 ids per sample into a ``rows x 16`` float32 table, summed, then 16-64-10; batch 256 per
worker): ``Embedding(sparse=True)`` on the servers in parameter-server mode, a dense
``Embedding`` on every rank in collective mode. Then the same sparse model with a
``big-rows x 16`` table, parameter-server mode only, with each process's peak resident
memory. Prints a Markdown table; each job runs under ``mpiexec`` and reports samples/s over
every worker (steps after a warm-up, timed on worker 0 between two worker barriers).
"""
import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time

import numpy as np

from fleetmpi import nn

HERE = os.path.abspath(__file__)
DIM, IDS, GEO_K = 16, 8, 4


class SumIds(nn.Layer):
    """Sums the embeddings of a sample's ids: (batch, ids, dim) -> (batch, dim)."""

    def forward(self, x):
        return x.sum(axis=1)


def job(args):
    import fleetmpi as fleet
    from fleetmpi.core import backend
    from fleetmpi.training import data
    from fleetmpi import optimizer

    ps = args.mode != "collective"
    fleet.init(is_collective=not ps)
    backend.manual_seed(0)
    if args.model == "mlp":
        model = nn.MLP([64, 256, 256, 10])
        batch = 32
    else:
        model = nn.Sequential(nn.Embedding(args.rows, DIM, sparse=ps), SumIds(),
                              nn.Linear(DIM, 64), nn.ReLU(), nn.Linear(64, 10))
        batch = 256
    model = fleet.distributed_model(model)
    strategy = fleet.DistributedStrategy()
    strategy.a_sync = args.mode in ("async", "geo")
    strategy.a_sync_configs = {"k_steps": GEO_K if args.mode == "geo" else 0}
    opt = fleet.distributed_optimizer(
        optimizer.SGD(learning_rate=0.05, parameters=model.parameters()), strategy)
    if ps and fleet.is_server():
        fleet.init_server()
        fleet.run_server()
        _emit({"role": "server", "peak_rss_mb": _peak_mb()})
        return
    if ps:
        fleet.init_worker()
    rng = np.random.default_rng(fleet.worker_index())
    if args.model == "mlp":
        train, _ = data.load_digits()
        batches = [(train.features[i:i + batch], train.labels[i:i + batch])
                   for i in range(0, len(train) - batch, batch)]
    else:
        batches = [(rng.integers(0, args.rows, (batch, IDS)), rng.integers(0, 10, batch))
                   for _ in range(16)]
    loss_fn = nn.CrossEntropyLoss()
    warmup = 10
    for step in range(args.steps + warmup):
        if step == warmup:
            fleet.barrier_worker()
            start = time.perf_counter()
        opt.minimize(model, loss_fn, *batches[step % len(batches)])
    fleet.barrier_worker()
    seconds = time.perf_counter() - start
    staleness = opt.staleness if args.mode == "async" else []
    if ps:
        fleet.stop_worker()
    _emit({"role": "worker", "worker": fleet.worker_index(), "peak_rss_mb": _peak_mb(),
           "samples_per_s": args.steps * batch * fleet.worker_num() / seconds,
           "staleness_mean": float(np.mean(staleness)) if staleness else None})


def _peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _emit(record):
    print("RESULT " + json.dumps(record), flush=True)


def launch(mode, model, steps, rows):
    """The RESULT records of one job: 2 ranks for collective, 2 servers + 2 workers else."""
    from fleetmpi.launch.mpi_command import local_command

    script = [HERE, "--job", "--mode", mode, "--model", model, "--steps", str(steps),
              "--rows", str(rows)]
    if mode == "collective":
        command = local_command(2) + [sys.executable] + script
    else:
        command = [sys.executable, "-m", "fleetmpi.launch", "--server_num", "2",
                   "--worker_num", "2"] + script
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    # the launcher may join lines of different ranks: find the records, not the lines
    records = [json.loads(m.group(1))
               for m in re.finditer(r"RESULT (\{[^{}]*\})", done.stdout)]
    if done.returncode != 0 or not records:
        raise SystemExit(f"{mode} {model} failed:\n{done.stdout}\n{done.stderr}")
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="sync")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--big-rows", type=int, default=10_000_000)
    args = parser.parse_args()
    if args.job:
        return job(args)
    print("| model | mode | samples/s | vs collective | async staleness (mean) | "
          "peak RSS worker / server (MB) |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    runs = [("mlp", args.rows), ("sparse", args.rows)]
    for model, rows in runs:
        base = None
        for mode in ("collective", "sync", "async", "geo"):
            records = launch(mode, model, args.steps, rows)
            _row(model, rows, mode, records, base)
            base = base or _speed(records)
    for mode in ("sync", "async", "geo"):
        _row("sparse", args.big_rows, mode, launch(mode, "sparse", args.steps, args.big_rows),
             None)


def _speed(records):
    return [r for r in records if r["role"] == "worker" and r["worker"] == 0][0]["samples_per_s"]


def _row(model, rows, mode, records, base):
    speed = _speed(records)
    workers = [r for r in records if r["role"] == "worker"]
    servers = [r for r in records if r["role"] == "server"]
    stale = workers[0]["staleness_mean"]
    name = "digits MLP" if model == "mlp" else f"sparse {rows:,} x {DIM}"
    memory = (f"{max(r['peak_rss_mb'] for r in workers):.0f} / "
              f"{max(r['peak_rss_mb'] for r in servers):.0f}" if servers
              else f"{max(r['peak_rss_mb'] for r in workers):.0f} / -")
    ratio = f"{speed / base:.2f}x" if base else ("1.00x" if mode == "collective" else "-")
    print(f"| {name} | {mode} | {speed:,.0f} | {ratio} | "
          f"{'-' if stale is None else f'{stale:.2f}'} | {memory} |", flush=True)


if __name__ == "__main__":
    main()

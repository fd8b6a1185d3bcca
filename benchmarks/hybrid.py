"""Per-rank parameter bytes and step time of a GPT for every hybrid layout of four ranks: dp4,
mp2 x dp2, mp4, pp2 x dp2 and pp2 x mp2, in one run.

    python benchmarks/hybrid.py [--layers 4] [--width 128] [--heads 8] [--vocab 512]
                                [--seq 32] [--batch 16] [--steps 5] [--micro_batch 4]

One ``mpiexec -n 4`` job trains the same GPT (float32, AdamW, seed 0) under each layout in
turn on the same global batch of token ids, each data-parallel replica on its share. The model
is ``nn.gpt_pipeline``: ``nn.GPT``'s layers as a Sequential that pipeline can cut, with an
output projection of its own (a stage boundary separates it from the token embedding); every
layout trains this same model, on two stages under pp_degree 2. The token embedding,
attention heads, MLP and output projection are split over the model-parallel group and the
loss is ``nn.ParallelCrossEntropy``.

Reported per layout: the largest over the ranks of the parameter bytes and of the optimizer
state bytes a rank holds, the ratio of the parameter bytes to dp4's, the median over
``--steps`` steps (after one warm-up step, a barrier before each) of the slowest rank's step
time and its ratio to dp4's, and the last step's loss (the mean over the data replicas) minus
dp4's, which is zero to float32 rounding when the layouts compute the same math.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

LAYOUTS = {
    "dp4": {"dp_degree": 4},
    "mp2 x dp2": {"dp_degree": 2, "mp_degree": 2},
    "mp4": {"mp_degree": 4},
    "pp2 x dp2": {"dp_degree": 2, "pp_degree": 2},
    "pp2 x mp2": {"pp_degree": 2, "mp_degree": 2},
}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16, help="global batch of sequences")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro_batch", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def run_layout(name, layout, args):
    import fleetmpi as fleet
    from fleetmpi.core import backend
    from fleetmpi import nn, optimizer

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = layout
    strategy.pipeline_configs = {"micro_batch": args.micro_batch}
    fleet.init(is_collective=True, strategy=strategy)
    group = fleet.get_hybrid_communicate_group() if layout.get("mp_degree", 1) > 1 or \
        layout.get("pp_degree", 1) > 1 else None
    backend.manual_seed(0)
    model = fleet.distributed_model(nn.gpt_pipeline(
        args.vocab, args.seq, args.layers, args.heads, args.width,
        stages=layout.get("pp_degree", 1)))
    opt = fleet.distributed_optimizer(
        optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters()), strategy)
    replicas = layout.get("dp_degree", 1)
    replica = fleet.worker_index() if group is None else group.get_data_parallel_rank()
    share = args.batch // replicas
    tokens = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq + 1))
    x = tokens[replica * share:(replica + 1) * share, :-1]
    y = tokens[replica * share:(replica + 1) * share, 1:]
    times, loss = [], None
    for step in range(args.steps + 1):
        fleet.barrier_worker()
        start = time.perf_counter()
        loss = float(opt.minimize(model, nn.ParallelCrossEntropy(reduction="mean"), x, y))
        backend.synchronize()
        if step:
            times.append(time.perf_counter() - start)
    stage = None if group is None else group.get_stage_id()
    held = [p for p in model.parameters()
            if stage is None or p.pipeline_stage in (None, stage)]
    state = opt.state_dict()
    return {"layout": name, "rank": fleet.worker_index(),
            "parameter_bytes": int(sum(p.size * p.dtype.itemsize for p in held)),
            "optimizer_bytes": int(sum(v.nbytes for v in state.values()
                                       if isinstance(v, np.ndarray))),
            "times": times, "loss": loss, "replica": replica,
            "last_stage": stage in (None, layout.get("pp_degree", 1) - 1)}


def worker(args):
    import fleetmpi as fleet
    from mpi4py import MPI

    fleet.init(is_collective=True)
    rows = [run_layout(name, layout, args) for name, layout in LAYOUTS.items()]
    gathered = MPI.COMM_WORLD.gather(rows, root=0)
    if MPI.COMM_WORLD.rank == 0:
        print("RESULT " + json.dumps(gathered))


def report(per_rank, args):
    by_layout = {}
    for rows in per_rank:
        for row in rows:
            by_layout.setdefault(row["layout"], []).append(row)
    summary = {}
    for name, rows in by_layout.items():
        times = np.max(np.array([r["times"] for r in rows]), axis=0)
        losses = {r["replica"]: r["loss"] for r in rows if r["last_stage"]}
        summary[name] = {"parameter_bytes": max(r["parameter_bytes"] for r in rows),
                         "optimizer_bytes": max(r["optimizer_bytes"] for r in rows),
                         "step_s": float(np.median(times)),
                         "loss": float(np.mean(list(losses.values())))}
    base = summary["dp4"]
    print(f"GPT: {args.layers} layers, width {args.width}, {args.heads} heads, vocabulary "
          f"{args.vocab}, {args.seq} tokens, global batch {args.batch}, float32, AdamW, "
          f"4 ranks; micro_batch {args.micro_batch} under pipeline; median of {args.steps} "
          f"steps")
    print(f"{'layout':<11} {'params/rank':>12} {'vs dp4':>7} {'opt state/rank':>15} "
          f"{'step ms':>9} {'vs dp4':>7} {'loss - dp4':>11}")
    for name in LAYOUTS:
        row = summary[name]
        print(f"{name:<11} {row['parameter_bytes'] / 2**20:>9.2f} MB "
              f"{row['parameter_bytes'] / base['parameter_bytes']:>7.2f} "
              f"{row['optimizer_bytes'] / 2**20:>12.2f} MB {row['step_s'] * 1e3:>9.1f} "
              f"{row['step_s'] / base['step_s']:>7.2f} {row['loss'] - base['loss']:>11.1e}")


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        worker(args)
        return 0
    from fleetmpi.launch.mpi_command import local_command

    command = local_command(4) + [sys.executable, os.path.abspath(__file__), "--worker"] + \
        [a for a in (sys.argv[1:] if argv is None else argv)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout,
                            env=dict(os.environ, FLEETMPI_DEVICE=os.environ.get(
                                "FLEETMPI_DEVICE", "cpu")))
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        print(result.stdout[-4000:], result.stderr[-4000:])
        return 1
    report(json.loads(lines[-1][len("RESULT "):]), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

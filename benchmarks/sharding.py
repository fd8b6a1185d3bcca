"""Whole-process memory per rank and step time of sharding stages 1, 2 and 3 next to plain data
parallel, and a model that data parallel cannot build under a per-rank memory cap, trained under
stage 3.

    python benchmarks/sharding.py [--ranks 1 2 4] [--models gpt mlp] [--steps 5] [--repeats 7]
                                  [--parts memory time] [--cap_MB MB]
                                  [--layers 4] [--width 384] [--vocab 1024] [--seq 32]
                                  [--batch 2] [--mlp_layers 12] [--mlp_width 1024]
                                  [--mlp_batch 64]

Two models, float32, with Adam and the default strategy fields (``fuse_grad_size_in_MB`` 32):
``nn.GPT`` (``--layers`` blocks of width ``--width``, a tied embedding) and a user's
``nn.Layer`` of ``--mlp_layers`` Linear layers of ``--mlp_width`` with ReLU and a head of 10
classes, large enough for two data-parallel buckets. Seven runs of each: data parallel,
``sharding`` stages 1, 2 and 3 built as usual, and stage 3 built under ``fleet.LazyGuard``,
without and with ``sharding_configs["prefetch_depth"]`` 1 (the next unit's all-gather runs
ahead, on the communicator's background thread), the latter also with one layer a unit
(``unit_size_MB`` below any layer's size; the default joins adjacent layers up to the largest
layer's size).

Memory: one ``mpiexec`` job per rank count, model and run. Each rank starts ``tracemalloc``
(NumPy reports its allocations to it) right after ``fleet.init()`` and reads it after building
the model, ``distributed_model``, Adam and ``distributed_optimizer`` (the construction peak) and
after two training steps (the whole-process peak, construction included; also what is alive
between steps: the model state). Each figure is the largest over the ranks; the ratios are to
data parallel's at the same rank count.

Time: one more job per rank count builds every run of every model from the same seed, trains
each one warm-up step, then ``--repeats`` rounds: in each, every run trains ``--steps`` steps
(a barrier before each), in an order rotated from round to round, so that a change in the load
of shared cores falls on every run alike. A step's time is the slowest rank's. Reported: the
median of all of a run's steps, and its ratio to data parallel's: the median over the rounds
of the ratio of the two runs' medians in the round, with the least and greatest round's ratio
as the spread; and the last loss (mean over the ranks) minus data parallel's. ``--parts``
measures memory (and the cap) or time alone.

The cap: at the largest rank count, two jobs of the GPT under a per-rank limit on the data
segment (``RLIMIT_DATA``: heap and private mappings, where NumPy's arrays live) of what a rank
holds after ``fleet.init()`` and a first matrix product large enough for OpenBLAS to map its work
buffer (32 MiB, which a small product does not) plus ``--cap_MB``. The default cap is data
parallel's construction peak as ``tracemalloc`` measured it: every traced allocation lies in
the data segment, so data parallel cannot build the model under it, while stage 3 under the
guard has to fit with what ``tracemalloc`` does not see (the heap's free space, MPI's
buffers). An allocation beyond the cap raises ``MemoryError``, which each rank reports with
the phase it failed in; data parallel and stage 3 under the guard each try to build the model
and train ``--steps`` steps. Every job runs under ``--timeout``, so the benchmark ends even
when a rank that failed leaves the others waiting in a collective.
"""
import argparse
import contextlib
import json
import os
import re
import resource
import subprocess
import sys
import time
import tracemalloc

import numpy as np

# A unit_size_MB below any layer's size: one layer a unit.
LAYER_UNITS_MB = 1e-6
# name: (sharding stage, 0 for data parallel; built under LazyGuard; prefetch_depth;
# unit_size_MB)
RUNS = {"dp": (0, False, 0, 0), "stage 1": (1, False, 0, 0), "stage 2": (2, False, 0, 0),
        "stage 3": (3, False, 0, 0), "stage 3, LazyGuard": (3, True, 0, 0),
        "stage 3, LazyGuard, prefetch 1": (3, True, 1, 0),
        "stage 3, LazyGuard, prefetch 1, a unit per layer": (3, True, 1, LAYER_UNITS_MB)}
MODELS = ("gpt", "mlp")
# Whole-process peak per rank relative to data parallel at TARGET_RANKS (the targets).
TARGETS = {"stage 1": 0.75, "stage 2": 0.6, "stage 3, LazyGuard": 0.35,
           "stage 3, LazyGuard, prefetch 1": 0.35}
TIME_TARGETS = {"stage 3, LazyGuard": 1.25, "stage 3, LazyGuard, prefetch 1": 1.25}
TARGET_RANKS = 4
MEMORY_STEPS = 2
CAPPED = ("dp", "stage 3, LazyGuard")
MIB = 2 ** 20
OPTIONS = ("layers", "width", "vocab", "seq", "batch", "mlp_layers", "mlp_width", "mlp_batch",
           "steps", "repeats", "cap_MB")


# -- one rank ---------------------------------------------------------------------------------

def _model(args, model):
    from fleetmpi import nn
    import fleetmpi.nn.functional as F

    if model == "gpt":
        return nn.GPT(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers,
                      n_head=max(1, args.width // 64), n_embd=args.width, dtype="float32")

    class UserMLP(nn.Layer):
        def __init__(self):
            super().__init__()
            self.blocks = nn.LayerList([nn.Linear(args.mlp_width, args.mlp_width)
                                        for _ in range(args.mlp_layers)])
            self.head = nn.Linear(args.mlp_width, 10)

        def forward(self, x):
            for block in self.blocks:
                x = F.relu(block(x))
            return self.head(x)

    return UserMLP()


def _batch(args, model, rank):
    """``(inputs, loss function of the outputs)`` of this rank."""
    from fleetmpi.core import backend
    from fleetmpi import nn

    rng = np.random.default_rng(rank)
    if model == "gpt":
        tokens = rng.integers(0, args.vocab, (args.batch, args.seq + 1))
        x, y = backend.asarray(tokens[:, :-1]), backend.asarray(tokens[:, 1:])
    else:
        x = backend.asarray(rng.standard_normal((args.mlp_batch, args.mlp_width))
                            .astype(np.float32))
        y = backend.asarray(rng.integers(0, 10, args.mlp_batch))
    loss_fn = nn.CrossEntropyLoss()
    return x, lambda out: loss_fn(out, y)


def _build(args, model, run):
    """``(model, distributed optimizer)`` of ``run`` from seed 0."""
    import fleetmpi as fleet
    from fleetmpi.core import backend
    from fleetmpi import optimizer

    stage, lazy, depth, unit_MB = RUNS[run]
    backend.manual_seed(0)
    with fleet.LazyGuard() if lazy else contextlib.nullcontext():
        net = _model(args, model)
    net = fleet.distributed_model(net)
    strategy = fleet.DistributedStrategy()
    if stage:
        strategy.sharding = True
        strategy.sharding_configs = {"stage": stage, "prefetch_depth": depth,
                                     "unit_size_MB": unit_MB}
    opt = optimizer.Adam(learning_rate=1e-4, parameters=net.parameters())
    return net, fleet.distributed_optimizer(opt, strategy)


def _step(net, opt, x, loss_of):
    loss = loss_of(net(x))
    loss.backward()
    opt.step()
    opt.clear_grad()
    return float(loss)


def memory_worker(args):
    """One rank of one run: its construction peak, model state and whole-process peak."""
    import fleetmpi as fleet

    fleet.init(is_collective=True)
    x, loss_of = _batch(args, args.model, fleet.worker_index())
    tracemalloc.start()
    net, opt = _build(args, args.model, args.run)
    construction = tracemalloc.get_traced_memory()[1]
    state = tracemalloc.get_traced_memory()[0]
    for _ in range(MEMORY_STEPS):
        _step(net, opt, x, loss_of)
        state = max(state, tracemalloc.get_traced_memory()[0])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print("MEMORY " + json.dumps({"construction": construction, "state": state,
                                  "peak": peak, "parameters": sum(
                                      int(p.size) for p in net.parameters())}), flush=True)


def time_worker(args):
    """Every run of every model built at once, then ``--repeats`` rounds: in each, every run
    trains ``--steps`` steps in turn, in an order rotated from round to round (a barrier
    before each step, so that all ranks start it together). Prints, per run, the slowest
    rank's step times of each round."""
    import fleetmpi as fleet
    from fleetmpi.core import backend
    from mpi4py import MPI

    fleet.init(is_collective=True)
    world = MPI.COMM_WORLD
    built = {}
    for model in args.models:
        x, loss_of = _batch(args, model, world.Get_rank())
        for run in RUNS:
            built[model, run] = (*_build(args, model, run), x, loss_of)
    keys = list(built)
    times = {key: np.empty((args.repeats, args.steps)) for key in keys}
    losses = {key: _step(*built[key]) for key in keys}   # the warm-up step of each run
    for repeat in range(args.repeats):
        shift = repeat * len(keys) // args.repeats
        for key in keys[shift:] + keys[:shift]:
            for step in range(args.steps):
                world.Barrier()
                start = time.perf_counter()
                losses[key] = _step(*built[key])
                backend.synchronize()
                times[key][repeat, step] = time.perf_counter() - start
    rows = []
    for key in keys:
        slowest = np.empty_like(times[key])
        world.Allreduce(times[key], slowest, op=MPI.MAX)
        rows.append({"model": key[0], "run": key[1], "step_s": slowest.tolist(),
                     "parameters": sum(int(p.size) for p in built[key][0].parameters()),
                     "loss": world.allreduce(losses[key], op=MPI.SUM) / world.Get_size()})
    if world.Get_rank() == 0:
        print("TIME " + json.dumps(rows), flush=True)


def step_summary(row, dp):
    """``row``'s median step (ms) over every step, and its step time relative to ``dp``'s
    (both rows of one time job, one model): the ratio of the medians of each round, whose
    median is the figure and whose least and greatest show the spread."""
    mine, base = np.array(row["step_s"]), np.array(dp["step_s"])
    ratios = np.median(mine, axis=1) / np.median(base, axis=1)
    return {"step_ms": float(np.median(mine)) * 1e3, "ratio": float(np.median(ratios)),
            "low": float(ratios.min()), "high": float(ratios.max()),
            "loss": row["loss"] - dp["loss"]}


def _vm_data_bytes():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


def capped_worker(args):
    """Build and train one run with this rank's data segment limited to what it holds now
    plus ``--cap_MB``; print this rank's outcome as soon as it is known."""
    import fleetmpi as fleet
    from mpi4py import MPI

    fleet.init(is_collective=True)
    rank = fleet.worker_index()
    x, loss_of = _batch(args, "gpt", rank)
    # OpenBLAS maps its work buffer (32 MiB) at the first product too large for its small-
    # matrix kernels, and the first collective starts the stall watchdog's thread (its stack
    # is 8 MiB of data segment): both before the cap is measured.
    np.ones((256, 256), np.float32) @ np.ones((256, 256), np.float32)
    fleet.barrier_worker()
    base = _vm_data_bytes()
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (base + int(args.cap_MB * MIB), hard))
    phase, losses = "building the model and the optimizer", []
    try:
        net, opt = _build(args, "gpt", args.run)
        for step in range(args.steps):
            phase = f"step {step + 1}"
            losses.append(_step(net, opt, x, loss_of))
        outcome = {"ok": True, "losses": losses}
    except MemoryError as error:
        outcome = {"ok": False, "phase": phase, "error": f"MemoryError: {error}"[:160]}
    outcome.update(rank=rank, data_MB=(_vm_data_bytes() - base) / MIB)
    print("OUTCOME " + json.dumps(outcome), flush=True)
    MPI.COMM_WORLD.Barrier()


# -- the driver -------------------------------------------------------------------------------

def _job(ranks, args, *worker):
    """``(stdout, a note on how the job ended, or "")`` of ``mpiexec -n ranks`` of a worker."""
    from fleetmpi.launch.mpi_command import local_command

    options = [item for name in OPTIONS for item in (f"--{name}", str(getattr(args, name)))]
    command = local_command(ranks, [sys.executable, os.path.abspath(__file__), *worker,
                                    *options, "--models", *args.models])
    env = dict(os.environ, FLEETMPI_DEVICE="cpu", OMP_NUM_THREADS="1",
               FLEETMPI_NUM_THREADS="1")
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout
        out = out.decode(errors="replace") if isinstance(out, bytes) else out or ""
        return out, f"timed out after {args.timeout} s"
    note = f"exit status {done.returncode}: {done.stderr.strip()[-2000:]}" \
        if done.returncode else ""
    return done.stdout, note


def measure_memory(ranks, model, run, args):
    out, note = _job(ranks, args, "--worker", "memory", "--model", model, "--run", run)
    rows = [json.loads(m) for m in re.findall(r"MEMORY (\{[^{}]*\})", out)]
    if note or len(rows) != ranks:
        raise RuntimeError(f"{model}, {run}, {ranks} ranks (memory job): {note}\n{out}")
    largest = {key: max(row[key] for row in rows) for key in ("construction", "state", "peak")}
    return dict(largest, ranks=ranks, model=model, run=run, parameters=rows[0]["parameters"])


def measure_time(ranks, args):
    out, note = _job(ranks, args, "--worker", "time")
    for line in out.splitlines():
        if line.startswith("TIME "):
            rows = {(r["model"], r["run"]): r for r in json.loads(line[len("TIME "):])}
            return {key: dict(step_summary(row, rows[key[0], "dp"]),
                              parameters=row["parameters"]) for key, row in rows.items()}
    raise RuntimeError(f"{ranks} ranks (time job): {note}\n{out}")


def capped(ranks, run, args):
    out, note = _job(ranks, args, "--worker", "capped", "--run", run)
    # The ranks print at once, and their lines may interleave.
    outcomes = [json.loads(m) for m in re.findall(r"OUTCOME (\{[^{}]*\})", out)]
    return sorted(outcomes, key=lambda o: o["rank"]), note


def mib(nbytes):
    return f"{nbytes / MIB:.2f}"


def describe(args, model, parameters):
    if model == "gpt":
        return (f"nn.GPT: {args.layers} blocks, width {args.width}, vocabulary {args.vocab}, "
                f"tied embedding ({parameters:,} parameters, {mib(4 * parameters)} MiB); "
                f"per-rank batch {args.batch} x {args.seq} tokens")
    return (f"user MLP: {args.mlp_layers} x Linear {args.mlp_width}x{args.mlp_width} + head "
            f"of 10 ({parameters:,} parameters, {mib(4 * parameters)} MiB); per-rank batch "
            f"{args.mlp_batch}")


def memory_table(rows):
    by = {(r["ranks"], r["model"], r["run"]): r for r in rows}
    lines = ["| model | ranks | run | whole-process peak MiB | / DP | construction peak MiB | "
             "model state MiB |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        dp = by[(r["ranks"], r["model"], "dp")]
        lines.append(f"| {r['model']} | {r['ranks']} | {r['run']} | {mib(r['peak'])} | "
                     f"{r['peak'] / dp['peak']:.3f} | {mib(r['construction'])} | "
                     f"{mib(r['state'])} |")
    return "\n".join(lines)


def time_table(times):
    lines = ["| model | ranks | run | step ms | / DP | / DP, least - greatest round | "
             "loss - DP loss |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for ranks, measured in times.items():
        for (model, run), t in measured.items():
            lines.append(f"| {model} | {ranks} | {run} | {t['step_ms']:.0f} | "
                         f"{t['ratio']:.2f} | {t['low']:.2f} - {t['high']:.2f} | "
                         f"{t['loss']:+.1e} |")
    return "\n".join(lines)


def target_lines(rows, times, models):
    by = {(r["ranks"], r["model"], r["run"]): r for r in rows}
    lines = []
    for model in models:
        if rows and (TARGET_RANKS, model, "dp") in by:
            dp = by[(TARGET_RANKS, model, "dp")]
            for run, target in TARGETS.items():
                ratio = by[(TARGET_RANKS, model, run)]["peak"] / dp["peak"]
                lines.append(f"target {model}, {run}: whole-process peak <= {target:.2f}x of "
                             f"data parallel's at {TARGET_RANKS} ranks: {ratio:.3f}x, "
                             f"{'met' if ratio <= target else 'MISSED'}")
        for run, target in TIME_TARGETS.items():
            if TARGET_RANKS not in times:
                continue
            t = times[TARGET_RANKS][model, run]
            lines.append(f"target {model}, {run}: step time <= {target:.2f}x of data "
                         f"parallel's at {TARGET_RANKS} ranks: {t['ratio']:.2f}x (rounds "
                         f"{t['low']:.2f} - {t['high']:.2f}), "
                         f"{'met' if t['ratio'] <= target else 'MISSED'}")
    if not lines:
        lines.append(f"targets: not measured (no {TARGET_RANKS}-rank run)")
    return lines


def outcome_lines(run, outcomes, note):
    """One line per rank that trained; ranks that failed alike share a line."""
    lines, failed = [], {}
    for o in outcomes:
        if o["ok"]:
            losses = ", ".join(f"{v:.4f}" for v in o["losses"])
            lines.append(f"  {run}, rank {o['rank']}: built and trained {len(o['losses'])} "
                         f"steps, losses {losses}; data segment {o['data_MB']:.1f} MiB above "
                         f"the start at the end")
        else:
            failed.setdefault((o["error"], o["phase"]), []).append(str(o["rank"]))
    for (error, phase), ranks in failed.items():
        lines.append(f"  {run}, rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}: "
                     f"{error}, while {phase}")
    if not outcomes:
        lines.append(f"  {run}: no rank reported an outcome")
    if note:
        lines.append(f"  {run}: the job ended with {note[-300:]}")
    return lines


def cap_report(rows, args):
    ranks = max(args.ranks)
    by = {r["run"]: r for r in rows if r["ranks"] == ranks and r["model"] == "gpt"}
    need, dp_build = by["stage 3, LazyGuard"]["peak"], by["dp"]["construction"]
    if args.cap_MB <= 0:
        args.cap_MB = dp_build / MIB
    lines = [f"A model that data parallel cannot build: the GPT at {ranks} ranks, each capped "
             f"at {args.cap_MB:.1f} MiB of data segment above what it holds after fleet.init() "
             f"(RLIMIT_DATA). Measured above: stage 3 under LazyGuard peaks at {mib(need)} MiB "
             f"over building and training, data parallel needs {mib(dp_build)} MiB to build."]
    if need >= args.cap_MB * MIB:
        lines.append("  The cap is below what stage 3 needs: its step (activations grow with "
                     "--batch) takes more than data parallel's construction.")
    for run in CAPPED:
        outcomes, note = capped(ranks, run, args)
        lines += outcome_lines(run, outcomes, note)
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2, help="GPT sequences per rank")
    parser.add_argument("--mlp_layers", type=int, default=12)
    parser.add_argument("--mlp_width", type=int, default=1024)
    parser.add_argument("--mlp_batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5,
                        help="timed steps of each run in each round, and the steps trained "
                             "under the cap")
    parser.add_argument("--repeats", type=int, default=7,
                        help="rounds of the time job, each training every run in turn")
    parser.add_argument("--parts", nargs="+", choices=["memory", "time"],
                        default=["memory", "time"],
                        help="what to measure (the cap run comes with memory)")
    parser.add_argument("--cap_MB", type=float, default=0.0,
                        help="per-rank cap above the data segment after fleet.init(); 0: "
                             "data parallel's construction peak")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per mpiexec job")
    parser.add_argument("--worker", choices=["memory", "time", "capped"], help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--run", choices=list(RUNS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return {"memory": memory_worker, "time": time_worker,
                "capped": capped_worker}[args.worker](args)

    rows = [measure_memory(ranks, model, run, args) for ranks in args.ranks
            for model in args.models for run in RUNS] if "memory" in args.parts else []
    times = {ranks: measure_time(ranks, args) for ranks in args.ranks} \
        if "time" in args.parts else {}
    parameters = {r["model"]: r["parameters"] for r in rows}
    parameters.update({model: t["parameters"] for measured in times.values()
                       for (model, _), t in measured.items()})
    for model in args.models:
        print(describe(args, model, parameters[model]))
    print("Adam, float32, default fusion")
    if rows:
        print("Memory: tracemalloc from after fleet.init(), largest over the ranks\n")
        print(memory_table(rows))
        print()
    if times:
        print(f"Time: slowest rank's step; {args.repeats} rounds of {args.steps} steps of "
              f"every run in turn; step ms: median of all; / DP: median over the rounds of "
              f"the ratio of the round's medians\n")
        print(time_table(times))
        print()
    print("\n".join(target_lines(rows, times, args.models)))
    if rows and "gpt" in args.models:
        print()
        print("\n".join(cap_report(rows, args)))


if __name__ == "__main__":
    main()

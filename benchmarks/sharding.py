"""Memory per rank and step time of sharding stages 1, 2 and 3 next to plain data parallel, and
a model that does not fit a rank's memory cap under data parallelism, trained under stage 3.

    python benchmarks/sharding.py [--ranks 1 2 4] [--layers 4] [--width 256] [--vocab 1024]
                                  [--seq 32] [--batch 8] [--steps 5] [--cap_MB MB]
                                  [--fuse_grad_MB MB] [--sites]

Memory and time: for each rank count one ``mpiexec`` job builds ``nn.GPT`` (float32, Adam) four
times from the same seed (data parallel, ``sharding`` stage 1, 2 and 3) and trains each on the
same per-rank batch of token ids. For each configuration ``tracemalloc`` (NumPy reports its
allocations to it) is started just before the model is built and stopped after two steps, so
it counts what this configuration allocates and nothing else:

- model state: the bytes alive after building the model and the distributed optimizer and
  after each step (between steps), the largest of these. This is parameters, gradients and
  optimizer state (and whatever else the configuration keeps between steps).
- step transient: the peak during the second step minus what was alive before it: the
  activations the graph keeps, the temporaries of forward, backward and update, gathered
  parameters (stage 3) and gradient buckets (stages 2 and 3).
- construction peak: the peak while the model and the optimizer were being built.

Every figure is the largest over the ranks. The ratio is to data parallel at the same rank
count. Then the four models keep training, alternating step by step (a barrier before each
step, so that all see the same load on the machine), and the median step time of the slowest
rank over ``--steps`` steps after one warm-up step is reported next to data parallel's, with
the difference of the last step's loss (the mean over the ranks) from data parallel's.

The cap: two more jobs at the largest rank count, each rank limiting its data segment
(``RLIMIT_DATA``: heap and private mappings, where NumPy's arrays live) to what it uses after
``fleet.init()`` and a first matrix product (OpenBLAS maps its work buffer then) plus
``--cap_MB``. A NumPy allocation beyond it raises ``MemoryError``, which each rank reports with
the phase it failed in. Data parallel and stage 3 each try to build the model and train
``--steps`` steps under it. The default cap lies midway between what stage 3 needs and what
data parallel needs, both from the memory job. Stage 3 needs its construction peak: the model
is built whole on every rank and sharded afterwards (Adam's state is made at the shard's size),
so its construction holds data parallel's whole parameters and gradients plus the shards for a
moment (``benchmarks/lazy_memory.py`` measures building under ``LazyGuard``). Data parallel needs its
model state plus one step's transient. The cap therefore separates the two only when a step's
transient exceeds the shards built at construction (1/N of the model state), which is why the
default batch is 8 sequences: data parallel builds under the cap and fails in its first step.

Every job runs under a timeout (``--timeout``), so the benchmark ends even when a rank that
failed leaves the others waiting in a collective.
"""
import argparse
import gc
import json
import os
import re
import resource
import subprocess
import sys
import time
import tracemalloc

import numpy as np

CONFIGS = ("dp", "stage 1", "stage 2", "stage 3")
STAGE = {"dp": 0, "stage 1": 1, "stage 2": 2, "stage 3": 3}
# Peak model-state bytes per rank relative to data parallel, at 4 ranks (the targets).
TARGETS = {"stage 2": 0.45, "stage 3": 0.35}
TARGET_RANKS = 4
MEMORY_STEPS = 2
TRACE_FRAMES = 12
SITES = 6
MIB = 2 ** 20


# -- one rank ---------------------------------------------------------------------------------

def _gpt(args):
    from fleetmpi import nn

    return nn.GPT(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers,
                  n_head=args.heads, n_embd=args.width, dtype="float32")


def _data(args, rank):
    tokens = np.random.default_rng(rank).integers(0, args.vocab, (args.batch, args.seq + 1))
    return tokens[:, :-1], tokens[:, 1:]


def _build(args, stage):
    """``(model, optimizer)``: the GPT from seed 0 with Adam, data parallel (stage 0) or
    sharded at ``stage``."""
    import fleetmpi as fleet
    from fleetmpi import backend, optimizer

    backend.manual_seed(0)
    model = fleet.distributed_model(_gpt(args))
    strategy = fleet.DistributedStrategy()
    if args.fuse_grad_MB:
        strategy.fuse_grad_size_in_MB = args.fuse_grad_MB
    if stage:
        strategy.sharding = True
        strategy.sharding_configs = {"stage": stage}
    opt = optimizer.Adam(learning_rate=1e-4, parameters=model.parameters())
    return model, fleet.distributed_optimizer(opt, strategy)


def _step(model, opt, loss_fn, x, y):
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    opt.clear_grad()
    return float(loss)


def _sites(snapshot, count):
    """The ``count`` allocation sites holding the most bytes in ``snapshot``, grouped by
    traceback: ``(bytes, blocks, "file:line <- file:line ...")`` with the frames in this
    repository, innermost first."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = []
    for stat in snapshot.statistics("traceback")[:count]:
        frames = [f"{os.path.relpath(f.filename, root)}:{f.lineno}"
                  for f in reversed(stat.traceback) if f.filename.startswith(root)]
        rows.append((stat.size, stat.count, " <- ".join(frames[:5]) or
                     f"{stat.traceback[-1].filename}:{stat.traceback[-1].lineno}"))
    return rows


def _measure(args, stage, loss_fn, x, y, sites):
    """Build one configuration under ``tracemalloc`` and take two steps (module docstring)."""
    gc.collect()
    tracemalloc.start(TRACE_FRAMES)
    try:
        model, opt = _build(args, stage)
        gc.collect()
        alive, construction = tracemalloc.get_traced_memory()
        resident = [alive]
        transient, losses = 0, []
        for _ in range(MEMORY_STEPS):
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            losses.append(_step(model, opt, loss_fn, x, y))
            transient = tracemalloc.get_traced_memory()[1] - before
            gc.collect()
            resident.append(tracemalloc.get_traced_memory()[0])
        held = _sites(tracemalloc.take_snapshot(), SITES) if sites else []
    finally:
        tracemalloc.stop()
    return model, opt, {"state": max(resident), "resident": resident,
                        "transient": transient, "construction": construction,
                        "sites": held}, losses


def memory_worker(args):
    import fleetmpi as fleet
    from fleetmpi import backend, nn
    from mpi4py import MPI

    fleet.init(is_collective=True)
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    x, y = (backend.asarray(a) for a in _data(args, rank))
    loss_fn = nn.CrossEntropyLoss()
    runs, memory, losses = {}, {}, {}
    for name in CONFIGS:
        model, opt, memory[name], losses[name] = _measure(args, STAGE[name], loss_fn, x, y,
                                                          rank == 0)
        runs[name] = (model, opt)
    parameters = sum(int(p.size) for p in runs["dp"][0].parameters())
    times = {name: [] for name in CONFIGS}
    for _ in range(1 + args.steps):
        # Alternate the configurations step by step, so that all see the same load.
        for name, (model, opt) in runs.items():
            world.Barrier()
            start = time.perf_counter()
            losses[name].append(_step(model, opt, loss_fn, x, y))
            backend.synchronize()
            times[name].append(time.perf_counter() - start)
    rows = []
    for name in CONFIGS:
        largest = {key: world.allreduce(memory[name][key], op=MPI.MAX)
                   for key in ("state", "transient", "construction")}
        slowest = np.empty(len(times[name]))
        world.Allreduce(np.array(times[name]), slowest, op=MPI.MAX)
        loss = world.allreduce(losses[name][-1], op=MPI.SUM) / size
        rows.append(dict(largest, config=name, ranks=size, parameters=parameters,
                         step_ms=float(np.median(slowest[1:])) * 1e3, loss=loss,
                         sites=memory[name]["sites"]))
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)


def _vm_data_bytes():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


def capped_worker(args):
    """Build and train one configuration with this rank's data segment limited to what it
    holds now plus ``--cap_MB``; print this rank's outcome as soon as it is known."""
    import fleetmpi as fleet
    from fleetmpi import backend, nn
    from mpi4py import MPI

    fleet.init(is_collective=True)
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    x, y = (backend.asarray(a) for a in _data(args, rank))
    loss_fn = nn.CrossEntropyLoss()
    stage = STAGE[args.config]
    # OpenBLAS maps its work buffer at the first product: map it before the cap is measured.
    np.ones((64, 64), np.float32) @ np.ones((64, 64), np.float32)
    gc.collect()
    base = _vm_data_bytes()
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = base + int(args.cap_MB * MIB)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    phase, losses = "build", []
    try:
        model, opt = _build(args, stage)
        for step in range(args.steps):
            phase = f"step {step + 1}"
            losses.append(_step(model, opt, loss_fn, x, y))
        outcome = {"ok": True, "losses": losses}
    except MemoryError as error:
        outcome = {"ok": False, "phase": phase, "error": f"MemoryError: {error}"[:160]}
    outcome.update(rank=rank, data_MB=(_vm_data_bytes() - base) / MIB)
    print("OUTCOME " + json.dumps(outcome), flush=True)
    world.Barrier()


# -- the driver -------------------------------------------------------------------------------

def _job(ranks, args, *worker):
    from fleetmpi.launch.mpi_command import local_command

    options = []
    for name in ("layers", "width", "heads", "vocab", "seq", "batch", "steps", "cap_MB",
                 "fuse_grad_MB"):
        options += [f"--{name}", str(getattr(args, name))]
    command = local_command(ranks, [sys.executable, os.path.abspath(__file__), *worker,
                                    *options])
    env = dict(os.environ, FLEETMPI_DEVICE="cpu", OMP_NUM_THREADS="1",
               FLEETMPI_NUM_THREADS="1")
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env,
                              timeout=args.timeout)
        return done.returncode, done.stdout, done.stderr, False
    except subprocess.TimeoutExpired as expired:
        def text(value):
            return value.decode(errors="replace") if isinstance(value, bytes) else value or ""
        return None, text(expired.stdout), text(expired.stderr), True


def measure(ranks, args):
    code, out, err, timed_out = _job(ranks, args, "--worker", "memory")
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    why = f"timed out after {args.timeout} s" if timed_out else f"exit status {code}"
    raise RuntimeError(f"mpiexec -n {ranks} (memory job) {why}:\n{out}\n{err[-4000:]}")


def capped(ranks, config, args):
    code, out, err, timed_out = _job(ranks, args, "--worker", "capped", "--config", config)
    # The ranks print at once, and their lines may interleave.
    outcomes = [json.loads(m) for m in re.findall(r"OUTCOME (\{[^{}]*\})", out)]
    outcomes.sort(key=lambda o: o["rank"])
    note = ""
    if timed_out:
        note = f"; the job timed out after {args.timeout} s"
    elif code:
        note = f"; the job exited with status {code}: {err.strip()[-300:]}"
    return outcomes, note


def mib(nbytes):
    return f"{nbytes / MIB:.2f}"


def memory_table(rows):
    by = {(r["ranks"], r["config"]): r for r in rows}
    lines = ["| ranks | run | model state MiB/rank | / DP | step transient MiB | "
             "construction peak MiB | step ms | / DP | loss - DP loss |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        dp = by[(r["ranks"], "dp")]
        lines.append(f"| {r['ranks']} | {r['config']} | {mib(r['state'])} | "
                     f"{r['state'] / dp['state']:.3f} | {mib(r['transient'])} | "
                     f"{mib(r['construction'])} | {r['step_ms']:.0f} | "
                     f"{r['step_ms'] / dp['step_ms']:.2f} | {r['loss'] - dp['loss']:+.1e} |")
    return "\n".join(lines)


def target_lines(rows):
    by = {(r["ranks"], r["config"]): r for r in rows}
    lines, missed = [], []
    for config, target in TARGETS.items():
        if (TARGET_RANKS, config) not in by:
            lines.append(f"target {config} <= {target}x of data parallel at {TARGET_RANKS} "
                         f"ranks: not measured (no {TARGET_RANKS}-rank run)")
            continue
        row = by[(TARGET_RANKS, config)]
        ratio = row["state"] / by[(TARGET_RANKS, "dp")]["state"]
        met = ratio <= target
        lines.append(f"target {config} <= {target:.2f}x of data parallel at {TARGET_RANKS} "
                     f"ranks: {ratio:.3f}x, {'met' if met else 'MISSED'}")
        if not met:
            missed.append(row)
    return lines, missed


def site_lines(row):
    lines = [f"largest allocation sites alive after the steps, {row['config']}, "
             f"{row['ranks']} ranks, rank 0:"]
    for size, blocks, where in row["sites"]:
        lines.append(f"  {size:>12,} B in {blocks:>5} blocks  {where}")
    return lines


def default_cap(rows, ranks):
    """Midway between what stage 3 needs at ``ranks`` (its construction peak, or its model
    state plus a step's transient if that is more) and what data parallel needs for a step."""
    by = {r["config"]: r for r in rows if r["ranks"] == ranks}
    stage3, dp = by["stage 3"], by["dp"]
    low = max(stage3["construction"], stage3["state"] + stage3["transient"])
    high = dp["state"] + dp["transient"]
    return low, high, (low + high) / 2 / MIB


def outcome_lines(config, outcomes, note):
    """One line per rank that trained; ranks that failed alike share a line."""
    lines, failed = [], {}
    for o in outcomes:
        if o["ok"]:
            losses = ", ".join(f"{v:.4f}" for v in o["losses"])
            lines.append(f"  {config}, rank {o['rank']}: trained {len(o['losses'])} steps, "
                         f"losses {losses}; data segment {o['data_MB']:.1f} MiB above the "
                         f"start at the end")
        else:
            failed.setdefault((o["error"], o["phase"]), []).append(str(o["rank"]))
    for (error, phase), ranks in failed.items():
        lines.append(f"  {config}, rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}: "
                     f"{error}, during {phase}")
    if not outcomes:
        lines.append(f"  {config}: no rank reported an outcome")
    if note:
        lines.append(f"  {config}{note}")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=5,
                        help="timed steps, and the steps trained under the cap")
    parser.add_argument("--cap_MB", type=float, default=0.0,
                        help="per-rank cap above the data segment after fleet.init(); "
                             "0: midway between stage 3's and data parallel's need")
    parser.add_argument("--fuse_grad_MB", type=int, default=0,
                        help="strategy.fuse_grad_size_in_MB of every run (the gradient "
                             "buckets); 0: the default")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per mpiexec job")
    parser.add_argument("--sites", action="store_true",
                        help="print the largest allocation sites of every run (without it, "
                             "of the runs that miss a target)")
    parser.add_argument("--worker", choices=["memory", "capped"], help=argparse.SUPPRESS)
    parser.add_argument("--config", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "memory":
        return memory_worker(args)
    if args.worker == "capped":
        return capped_worker(args)

    rows = []
    for ranks in args.ranks:
        rows += measure(ranks, args)
    print(f"nn.GPT: {args.layers} blocks, width {args.width}, {args.heads} heads, vocabulary "
          f"{args.vocab}, float32 ({rows[0]['parameters']:,} parameters, "
          f"{mib(4 * rows[0]['parameters'])} MiB); Adam; per-rank batch {args.batch} x "
          f"{args.seq} tokens; tracemalloc, largest over the ranks; step time: median of "
          f"{args.steps} steps, slowest rank\n")
    print(memory_table(rows))
    print()
    lines, missed = target_lines(rows)
    print("\n".join(lines))
    for row in rows if args.sites else missed:
        print("\n".join(site_lines(row)))

    ranks = max(args.ranks)
    low, high, cap = default_cap(rows, ranks)
    if args.cap_MB <= 0:
        args.cap_MB = cap
    print(f"\nA model that does not fit: {ranks} ranks, each capped at {args.cap_MB:.1f} MiB "
          f"of data segment above what it holds after fleet.init() (RLIMIT_DATA). Measured "
          f"above: stage 3 needs {mib(low)} MiB (construction, or state + step), data "
          f"parallel {mib(high)} MiB (state + step).")
    if low >= high:
        print("  No cap lies between the two: stage 3 builds the whole model and Adam's state "
              "before sharding them, and a step of data parallel adds less than that; a "
              "larger --batch makes the step's transient larger.")
    for config in ("dp", "stage 3"):
        outcomes, note = capped(ranks, config, args)
        print("\n".join(outcome_lines(config, outcomes, note)))


if __name__ == "__main__":
    main()

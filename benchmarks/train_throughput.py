"""Training throughput of fleetmpi's trainer next to PyTorch DistributedDataParallel on the same
models, per precision, with each step's FLOP utilisation, peak memory, kernel count and host
time; on the CPU also where a ResNet-20 step's time goes, and the Python cost of fleetmpi's tape.

    python benchmarks/train_throughput.py [--steps 30] [--ranks 1 2]
                                          [--models mlp resnet20 gpt gpt2 resnet50]
                                          [--precisions fp32 amp-fp16 amp-bf16]
                                          [--device cpu|gpu] [--budget-s SECONDS]
                                          [--no-breakdown] [--no-tape] [--json PATH]

Models (``throughput_run/models.py``): an MLP, ResNet-20, GPT-tiny (4 blocks, 128 wide),
GPT-2 small (124M parameters, sequence 1024, one rank only) and ResNet-50 at 224x224 (one rank
only); on the CPU GPT-2 runs scaled down and ResNet-50 at batch 8, as the printed description
says. Each trainer runs ``mpiexec`` jobs (``throughput_run/training.py``), on a GPU one per
model and rank count, on the CPU one per precision too, which train the precisions asked for
(``fp32``; ``amp-fp16`` and ``amp-bf16``: fleetmpi's ``strategy.amp``, PyTorch's autocast
with a GradScaler for float16) on the same synthetic data, per-rank batch
and optimizer (AdamW for the GPTs, Momentum for the others), one BLAS/intra-op thread per rank,
and reports samples/s over all ranks (a GPT's sample is a sequence). The MLP and the ResNets
train with ``opt.minimize(model, loss_fn, x, y)``, the GPTs with ``loss.backward(); opt.step();
opt.clear_grad()``. ``--precisions`` defaults to fp32 on the CPU and, on a GPU, to each model's
own list. ``--device gpu`` runs both on one GPU per rank (fleetmpi on CuPy, PyTorch on CUDA
with cuDNN's autotuner and DDP over NCCL), timed with the device synchronized.

Printed: the throughput table with ours/PyTorch ratios and weak-scaling efficiency (samples/s
at N ranks over N times samples/s at the fewest), then per step: the GPTs' model FLOP
utilisation (``throughput_run/flops.py``), peak memory of both (``throughput_run/memory.py``),
fleetmpi's kernel count (``throughput_run/kernels.py``; "n/a on the CPU") and host time.
A figure that is missing says why: a precision fleetmpi lacks (bfloat16 amp, asked for in one
place, ``throughput_run/precision.py``), a job that failed or ran out of its time, PyTorch not
installed. ``--budget-s`` shares that many seconds between the jobs, in order; each job times
as many steps as fit in its share and is stopped at its end, so a slow model loses only its own
figures. ``--json`` writes the rows (``throughput_run/rows.py``) after each model.

Then, on CPU: one ResNet-20 job at the largest rank count timing what each step spends in
matrix products, im2col/col2im, the gradient allreduce it waits for, the optimizer update,
elementwise operations (batch norm, ReLU, pooling, loss) and the rest, and apart from those
the reductions that ran on the communicator's thread beside backward. Last, in one process:
the tape's cost per recorded operation (a chain of small elementwise operations recorded and
backpropagated, against the same NumPy arithmetic without a tape, forward and backward), the
operations one training step of the digits example's MLP records, and the share of that step
the tape costs (operations x cost per operation / step time).
"""
import argparse
import importlib
import importlib.util
import json
import os
import sys
import tempfile
import threading
import time

import numpy as np

from fleetmpi.launch.mpi_command import local_command
from gpu_run.process import RESULT, Budget, run_bounded
from throughput_run import timing
from throughput_run.models import MODELS, our_model, spec
from throughput_run.precision import PRECISIONS, fleetmpi_reason
from throughput_run.rows import assemble_row, not_measured, write_json
from throughput_run.table import print_tables
from throughput_run.training import batches, run_ours, run_torch

DIGITS_SIZES = (64, 256, 256, 10)
DIGITS_BATCH = 32


# -- the tape's Python cost -----------------------------------------------------------------

TAPE_CHAIN = 2000
TAPE_REPEATS = 7


def _chain_seconds():
    """``(taped forward, taped backward, raw forward, raw backward)`` seconds of a chain of
    ``TAPE_CHAIN`` elementwise operations on 8-element arrays (multiply and add alternating),
    best of ``TAPE_REPEATS``: recorded and backpropagated by the engine, and the same NumPy
    arithmetic (forward, and the gradient products of backward) without a tape."""
    from fleetmpi import Tensor

    w, b, ones = np.full(8, 1.0001), np.full(8, 1e-4), np.ones(8)
    best = [float("inf")] * 4
    for _ in range(TAPE_REPEATS):
        x = Tensor(ones.copy(), stop_gradient=False)
        start = time.perf_counter()
        y = x
        for _ in range(TAPE_CHAIN // 2):
            y = y * w
            y = y + b
        middle = time.perf_counter()
        y.backward(ones)
        end = time.perf_counter()
        raw = ones.copy()
        raw_start = time.perf_counter()
        for _ in range(TAPE_CHAIN // 2):
            raw = raw * w
            raw = raw + b
        raw_middle = time.perf_counter()
        grad = ones
        for _ in range(TAPE_CHAIN // 2):
            grad = grad * w
        raw_end = time.perf_counter()
        times = (middle - start, end - middle, raw_middle - raw_start, raw_end - raw_middle)
        best = [min(a, t) for a, t in zip(best, times)]
    return best


def recorded_operations(tensor):
    """How many operation calls the graph of ``tensor`` recorded, walked through the graph's
    links (``Tensor._node``, the call that made a tensor; the call's ``_inputs``)."""
    seen, stack = set(), [tensor._node]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        stack.extend(link._node for _, link in node._inputs)
    return len(seen)


def _digits_step():
    """``(recorded operations, seconds)`` of one training step of the digits example's model
    (Linear-ReLU-Linear-ReLU-Linear, ``DIGITS_SIZES``) on a batch of ``DIGITS_BATCH``, trained
    as the example does (Nesterov Momentum, fused optimizer update, dygraph idiom)."""
    import fleetmpi as fleet
    import fleetmpi.nn.functional as F
    from fleetmpi import nn, optimizer

    fleet.init(is_collective=True)
    model = fleet.distributed_model(nn.MLP(DIGITS_SIZES))
    strategy = fleet.DistributedStrategy()
    strategy.fuse_all_optimizer_ops = True
    opt = fleet.distributed_optimizer(optimizer.Momentum(
        learning_rate=0.05, momentum=0.9, parameters=model.parameters(), use_nesterov=True,
        weight_decay=1e-4), strategy)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((DIGITS_BATCH, DIGITS_SIZES[0]), dtype=np.float32)
    y = rng.integers(0, DIGITS_SIZES[-1], DIGITS_BATCH)
    operations = None
    steps, best = 200, float("inf")
    for repeat in range(6):
        start = time.perf_counter()
        for _ in range(steps):
            loss = F.cross_entropy(model(x), y)
            if operations is None:
                operations = recorded_operations(loss)
            loss.backward()
            opt.step()
            opt.clear_grad()
        if repeat:
            best = min(best, (time.perf_counter() - start) / steps)
    return operations, best


def tape_worker():
    fwd, bwd, raw_fwd, raw_bwd = _chain_seconds()
    operations, step = _digits_step()
    print(RESULT + json.dumps({
        "forward_us": (fwd - raw_fwd) / TAPE_CHAIN * 1e6,
        "backward_us": (bwd - raw_bwd) / TAPE_CHAIN * 1e6,
        "operations": operations, "step_us": step * 1e6}))


def print_tape_cost(result):
    per_op = result["forward_us"] + result["backward_us"]
    tape = result["operations"] * per_op
    print(f"tape: {per_op:.2f} us per recorded operation (recording {result['forward_us']:.2f}"
          f" + backward {result['backward_us']:.2f}) over the same NumPy arithmetic, on "
          f"8-element arrays")
    print(f"digits MLP step ({'-'.join(map(str, DIGITS_SIZES))}, batch {DIGITS_BATCH}, "
          f"Nesterov Momentum): {result['operations']} recorded operations, "
          f"{result['step_us']:.0f} us per step; tape {tape:.0f} us = "
          f"{100 * tape / result['step_us']:.1f}% of the step")


# -- where a ResNet-20 step's time goes ------------------------------------------------------

BREAKDOWN_STEPS = 6


OVERLAPPED = "communication on the comm thread, beside backward"


def _timed_calls(totals, category):
    """Wrap a function so that its wall time adds to ``totals[category]``, or to
    ``totals[OVERLAPPED]`` when it runs on another thread than the main one (a communicator's
    own thread, while the main thread goes on with backward)."""
    def wrap(function):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                on_main = threading.current_thread() is threading.main_thread()
                totals[category if on_main else OVERLAPPED] += time.perf_counter() - start
        return timed
    return wrap


def breakdown_worker(steps):
    """Train ResNet-20 as ``run_ours`` does and time, per step, its matrix products, im2col and
    col2im, the gradient allreduce the step waits for, optimizer update, batch norm,
    activations, pooling and loss (elementwise), and the rest (residual additions, the tape,
    the hooks, Python); rank 0 prints the means in ms. The reductions that run on the
    communicator's thread beside backward are timed apart (``OVERLAPPED``): the step's parts
    are the main thread's, and only the wait for those reductions is part of them."""
    import fleetmpi as fleet
    from fleetmpi import nn, optimizer
    from fleetmpi.comm import Communicator
    from fleetmpi.nn.functional import common, conv, loss, norm

    # the package's name "activation" is its function; the module is the one defining ReLU
    activation = importlib.import_module("fleetmpi.nn.functional.activation")

    from fleetmpi.strategies.gradient_allreduce import BucketSchedule

    totals = {name: 0.0 for name in ("products", "im2col", "communication", "update",
                                      "elementwise", OVERLAPPED)}
    for module in (conv, common):
        module.matmul_arrays = _timed_calls(totals, "products")(module.matmul_arrays)
    conv.im2col = _timed_calls(totals, "im2col")(conv.im2col)
    conv.col2im = _timed_calls(totals, "im2col")(conv.col2im)
    Communicator.allreduce_many = _timed_calls(totals, "communication")(
        Communicator.allreduce_many)
    BucketSchedule.wait = _timed_calls(totals, "communication")(BucketSchedule.wait)
    optimizer.Momentum._fused_update = _timed_calls(totals, "update")(
        optimizer.Momentum._fused_update)
    for cls in (norm.BatchNorm, activation.Activation, conv.GlobalAvgPool,
                loss.SoftmaxCrossEntropy):
        for stage in ("forward", "backward"):
            setattr(cls, stage, _timed_calls(totals, "elementwise")(getattr(cls, stage)))
    fleet.init(is_collective=True)
    model = fleet.distributed_model(our_model("resnet20", "cpu"))
    strategy = fleet.DistributedStrategy()
    strategy.fuse_all_optimizer_ops = True
    strategy.fuse_bn_act_ops = True
    opt = fleet.distributed_optimizer(optimizer.Momentum(
        learning_rate=0.01, momentum=0.9, parameters=model.parameters()), strategy)
    loss_fn = nn.CrossEntropyLoss()
    x, y = batches("resnet20", "cpu", 2 + steps)
    for i in range(2):
        opt.minimize(model, loss_fn, x[i], y[i])
    for name in totals:
        totals[name] = 0.0
    elapsed = timing.timed(lambda i: opt.minimize(model, loss_fn, x[i + 2], y[i + 2]), 0,
                           steps, lambda: None)
    result = {name: seconds / steps * 1e3 for name, seconds in totals.items()}
    result["step"] = elapsed / steps * 1e3
    step, overlapped = result.pop("step"), result.pop(OVERLAPPED)
    result["rest (residual adds, tape, hooks, Python)"] = step - sum(result.values())
    result.update({"step": step, OVERLAPPED: overlapped})
    if timing.world().Get_rank() == 0:
        print(RESULT + json.dumps(result))


def print_breakdown(ranks, result):
    step, overlapped = result.pop("step"), result.pop(OVERLAPPED)
    parts = ", ".join(f"{name} {ms:.0f} ms ({100 * ms / step:.0f}%)"
                      for name, ms in result.items())
    print(f"ResNet-20 step at {ranks} rank(s), batch {spec('resnet20', 'cpu').batch} per rank: "
          f"{step:.0f} ms = {parts}; besides, {OVERLAPPED}: {overlapped:.0f} ms")


# -- jobs -------------------------------------------------------------------------------------

def worker(args):
    if args.worker == "tape":
        return tape_worker()
    if args.worker == "breakdown":
        return breakdown_worker(args.measured)
    return (run_ours if args.worker == "ours" else run_torch)(args)


ONE_THREAD = {"FLEETMPI_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
# A run without --budget-s: no job is stopped, and each times all its steps.
UNBOUNDED_S = 24 * 3600.0
# The part of a job's share kept back from its measurements for its exit (timing.measure
# keeps room for the steps after its timed ones itself).
MEASURE_MARGIN_S = 5.0
# How --budget-s is shared: fleetmpi's jobs, the slower and the subject, get twice PyTorch's
# share; what a job leaves goes to the next.
JOB_WEIGHTS = {"ours": 2.0, "torch": 1.0}
# The last lines of a job's output that say why it failed.
REASON_LINES = 6


def run_job(cmd, device, timeout_s):
    """``(reports, how it ended, its last lines)`` of job ``cmd``: the JSON of each of its
    ``RESULT`` lines (as many as it printed before it ended or was stopped), and
    ``gpu_run.process.Finished``."""
    env = dict(os.environ, FLEETMPI_DEVICE=device, **ONE_THREAD)
    with tempfile.TemporaryDirectory(prefix="train-throughput-") as folder:
        done = run_bounded(cmd, env, os.getcwd(), timeout_s, os.path.join(folder, "job.log"))
        with open(done.log, errors="replace") as f:
            lines = f.read().splitlines()
    reports = [json.loads(line[len(RESULT):]) for line in lines if line.startswith(RESULT)]
    return reports, done, lines[-REASON_LINES:]


def _result(cmd):
    """The one report of a tape or breakdown job."""
    reports, done, tail = run_job(cmd, "cpu", UNBOUNDED_S)
    if not reports:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n" + "\n".join(tail))
    return reports[-1]


def launch(trainer, model, ranks, precisions, args, port, seconds):
    """``{precision: report}`` of one trainer's job on ``model`` at ``ranks`` ranks, given
    ``seconds``: what it reported, and for each precision it did not report, why."""
    measured = max(2, int(round(args.steps * spec(model, args.device).steps_scale)))
    deadline = time.time() + seconds - min(MEASURE_MARGIN_S, seconds / 5)
    cmd = local_command(ranks, [sys.executable, os.path.abspath(__file__), "--worker", trainer,
                                "--model", model, "--precisions", *precisions,
                                "--measured", str(measured), "--port", str(port),
                                "--device", args.device, "--deadline", f"{deadline:.3f}"])
    reports, done, tail = run_job(cmd, args.device, seconds)
    found = {report.pop("precision"): report for report in reports}
    if done.timed_out:
        missing = f"stopped at the end of its {seconds:.0f} s"
    else:
        missing = f"the job exited {done.returncode}: " + " | ".join(tail)[-300:]
    return {precision: found.get(precision) or not_measured(missing)
            for precision in precisions}


def torch_available():
    """Whether PyTorch is installed (looked up, not imported: the jobs import it)."""
    return importlib.util.find_spec("torch") is not None


def _precisions(args, model):
    if args.precisions:
        return list(args.precisions)
    return list(spec(model, args.device).precisions) if args.device == "gpu" else ["fp32"]


def _rank_counts(args, model):
    return [1] if spec(model, args.device).one_rank else list(args.ranks)


def _jobs(args, model, have_torch):
    """``[(ranks, trainer, precisions)]`` of ``model`` in the order they run: fleetmpi's jobs
    lack the precisions its strategy does not take, PyTorch's are left out without torch. On
    a GPU one job trains every precision; on the CPU each precision has a job of its own, as
    the memory a process once held stays in its resident size."""
    wanted = _precisions(args, model)
    ours = [p for p in wanted if fleetmpi_reason(p) is None]
    jobs = []
    for ranks in _rank_counts(args, model):
        for trainer, precisions in (("ours", ours), ("torch", wanted if have_torch else [])):
            groups = [precisions] if args.device == "gpu" else [[p] for p in precisions]
            jobs += [(ranks, trainer, group) for group in groups if group]
    return jobs


def _model_rows(args, model, reports):
    """The rows of ``model`` from ``{(ranks, trainer): {precision: report}}``; a trainer
    without a job says why."""
    rows = []
    for ranks in _rank_counts(args, model):
        for precision in _precisions(args, model):
            ours = reports.get((ranks, "ours"), {}).get(precision) \
                or not_measured(fleetmpi_reason(precision))
            theirs = reports.get((ranks, "torch"), {}).get(precision) \
                or not_measured("torch not installed")
            rows.append(assemble_row(model, ranks, precision, args.device, args.steps, ours,
                                     theirs))
    return rows


def measure(args, have_torch):
    """The rows (``throughput_run/rows.py``) of every model, rank count and precision of
    ``args``, each job within its share of ``--budget-s``; written to ``--json`` after each
    model."""
    jobs = {model: _jobs(args, model, have_torch) for model in args.models}
    budget = Budget(args.budget_s or UNBOUNDED_S,
                    {(model, index): JOB_WEIGHTS[job[1]]
                     for model in jobs for index, job in enumerate(jobs[model])})
    rows, port = [], args.port
    for model, planned in jobs.items():
        reports = {}
        for index, (ranks, trainer, precisions) in enumerate(planned):
            seconds = budget.take((model, index))
            reports.setdefault((ranks, trainer), {}).update(
                launch(trainer, model, ranks, precisions, args, port, seconds))
            port += 1
        rows += _model_rows(args, model, reports)
        if args.json:
            write_json(args.json, rows)
    return rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="measured MLP steps (the other "
                        "models a share of them, throughput_run/models.py)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS,
                        help="default: fp32 on the CPU, each model's own list on a GPU")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                        help="gpu: both trainers on one GPU per rank")
    parser.add_argument("--budget-s", type=float, help="seconds for all the jobs, shared "
                        "between them (JOB_WEIGHTS); a job stopped at the end of its share "
                        "reports why")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the rows to PATH as JSON (throughput_run/rows.py)")
    parser.add_argument("--no-tape", action="store_true", help="skip the tape's cost")
    parser.add_argument("--no-breakdown", action="store_true",
                        help="skip the ResNet-20 step's time breakdown")
    parser.add_argument("--worker", choices=["ours", "torch", "tape", "breakdown"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=list(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--measured", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=time.time() + UNBOUNDED_S,
                        help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29611, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main():
    args = parse_args()
    if args.worker:
        return worker(args)
    rows = measure(args, torch_available())
    print_tables(rows, args.device)
    if not args.no_breakdown and args.device == "cpu":
        ranks = max(args.ranks)
        print_breakdown(ranks, _result(local_command(ranks, [
            sys.executable, os.path.abspath(__file__), "--worker", "breakdown", "--measured",
            str(BREAKDOWN_STEPS)])))
    if not args.no_tape:
        print_tape_cost(_result([sys.executable, os.path.abspath(__file__), "--worker", "tape"]))


if __name__ == "__main__":
    main()

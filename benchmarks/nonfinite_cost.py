"""The cost of the non-finite check (``FLEETMPI_NONFINITE``) on train_throughput's models: one
model of ``benchmarks/throughput_run/models.py`` built twice from one seed, one distributed
optimizer with the check and one built with ``FLEETMPI_NONFINITE=off``, their steps alternating
(which goes first alternating too) so that the machine's drift falls on both; prints the median
step of each and the difference, in wall-clock time and in this process's CPU time (which
other jobs on a shared machine disturb less; under MPI it includes the polling of a wait),
then the same for the fastest step of each (what a step costs when nothing else ran). Last, more
steps with the check, its read of the gradients timed (``check_local`` where the check reads the
flat gradients itself, ``check_bucket`` where the gradient reduction hands it each bucket, on
the communicator's thread): its median per step, the part of the cost that is that read.

On a GPU (``FLEETMPI_DEVICE=gpu``: the models of train_throughput's ``--device gpu``) each step
and each read is timed with the device synchronized, and the check is a kernel launch per dtype.
``--json PATH`` writes the figures as one object.

    [FLEETMPI_DEVICE=gpu] [mpiexec -n 2] python benchmarks/nonfinite_cost.py mlp|gpt STEPS
                                                                            [--json PATH]
"""
import argparse
import itertools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fleetmpi as fleet  # noqa: E402
from fleetmpi import nn, optimizer  # noqa: E402
from fleetmpi.core import backend  # noqa: E402
from throughput_run.models import our_model, spec  # noqa: E402
from throughput_run.training import batches  # noqa: E402
WARMUP = 3


def build(name, device):
    """``{mode: (model, distributed optimizer)}`` with the check (``stop``) and without."""
    built = {}
    for mode in ("off", "stop"):
        os.environ["FLEETMPI_NONFINITE"] = mode
        fleet.seed(0)
        model = fleet.distributed_model(our_model(name, device))
        params = model.parameters()
        opt = (optimizer.AdamW(1e-4, parameters=params) if spec(name, device).gpt
               else optimizer.Momentum(0.01, parameters=params))
        strategy = fleet.DistributedStrategy()
        strategy.build_strategy.fuse_all_optimizer_ops = True
        built[mode] = (model, fleet.distributed_optimizer(opt, strategy))
    return built


def timed_step(name, device, model, opt, x, y):
    """``(wall-clock, CPU)`` seconds of one step in the idiom train_throughput uses for
    ``name``, the device synchronized before and after."""
    loss_fn = nn.CrossEntropyLoss()
    backend.synchronize()
    start, cpu = time.perf_counter(), time.process_time()
    if spec(name, device).gpt:
        logits = model(x)
        loss_fn(logits.reshape([-1, logits.shape[-1]]), y.reshape([-1])).backward()
        opt.step()
        opt.clear_grad()
    else:
        opt.minimize(model, loss_fn, x, y)
    backend.synchronize()
    return time.perf_counter() - start, time.process_time() - cpu


def timed_read(name, device, model, opt, batches_xy, steps):
    """Median seconds per step of the check's read of the gradients over ``steps`` steps with
    the check (module docstring), its two entry points wrapped on this optimizer alone."""
    check = opt.strategies["nonfinite_check"]
    spent = []

    def timed(function):
        def call(*args):
            backend.synchronize()
            start = time.perf_counter()
            function(*args)
            backend.synchronize()
            spent[-1] += time.perf_counter() - start
        return call
    check.check_local = timed(check.check_local)
    for hook in opt.hooks:
        if getattr(hook, "check_bucket", None) is not None:
            hook.check_bucket = timed(hook.check_bucket)
    for i in range(steps):
        spent.append(0.0)
        timed_step(name, device, model, opt, *batches_xy(i))
    return statistics.median(spent)


def main(name, steps, json_path=None):
    fleet.init(is_collective=True)
    device = "gpu" if backend.on_gpu() else "cpu"
    xs, ys = (backend.asarray(a) for a in batches(name, device))

    def batch(i):
        return fleet.to_tensor(xs[i % len(xs)]), fleet.to_tensor(ys[i % len(ys)])
    built = build(name, device)
    times = {(mode, clock): [] for mode in ("off", "stop") for clock in ("wall", "CPU")}
    for i in range(steps + WARMUP):
        x, y = batch(i)
        for mode in (("off", "stop") if i % 2 else ("stop", "off")):
            wall, cpu = timed_step(name, device, *built[mode], x, y)
            if i >= WARMUP:
                times[mode, "wall"].append(wall)
                times[mode, "CPU"].append(cpu)
    read = timed_read(name, device, *built["stop"], batch, steps)
    if fleet.worker_index() != 0:
        return
    where = f"{name} at {fleet.worker_num()} rank(s) on the {device.upper()}"
    for statistic, clock in itertools.product((statistics.median, min), ("wall", "CPU")):
        off, on = (statistic(times[mode, clock]) for mode in ("off", "stop"))
        print(f"{where}, {clock}: {statistic.__name__} step {off * 1e3:.2f} ms without the "
              f"check, {on * 1e3:.2f} ms with it: {100 * (on / off - 1):+.2f}% ({steps} steps "
              f"each)")
    off, on = (statistics.median(times[mode, "wall"]) for mode in ("off", "stop"))
    print(f"{where}: the check's read of the gradients, median {read * 1e3:.2f} ms a step = "
          f"{100 * read / off:.2f}% of the median step without the check ({steps} more steps)")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"model": name, "device": device, "ranks": fleet.worker_num(),
                       "steps": steps, "median_step_s_without": off, "median_step_s_with": on,
                       "cost_percent": 100 * (on / off - 1), "median_read_s": read}, f)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", choices=("mlp", "gpt"))
    parser.add_argument("steps", type=int, help="steps timed with and without the check each")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"steps must be at least 1, got {args.steps}")
    return args


if __name__ == "__main__":
    args = parse_args()
    main(args.model, args.steps, args.json)

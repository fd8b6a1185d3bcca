"""What the timeline costs per training step: the digits MLP of examples/train_digits.py with
``fleetmpi.core.timeline`` off and on.

    mpiexec -n 2 python benchmarks/timeline_overhead.py [--steps 300] [--rounds 5]

Each round trains ``--steps`` steps with the timeline off, then the same number with it on
(recording into a temporary file, written by ``flush()`` at the end of the round), alternating
so that a slow spell of the machine hits both. Rank 0 prints the median and the fastest round's
per-step time of each (wall clock, and rank 0's CPU time, which a machine shared with other
jobs disturbs less; at several ranks it includes MPI's busy waiting), their difference and
ratio, the events recorded per step, the time
``flush()`` took, and what one recording site costs in a tight loop, off and on (the latter
includes writing the event to the part file): on a busy machine, events per step times that
cost is the steadier estimate of the overhead.
"""
import argparse
import os
import tempfile
import time
import timeit

import numpy as np

import fleetmpi as fleet
from fleetmpi.core import backend, timeline
from fleetmpi.training import data
from fleetmpi import nn, optimizer


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    return parser.parse_args()


def per_step_seconds(opt, model, loss_fn, batches, steps):
    """(wall-clock, this process's CPU) seconds per step."""
    fleet.barrier_worker()
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(steps):
        opt.minimize(model, loss_fn, *batches[i % len(batches)])
    cpu = time.process_time() - cpu
    fleet.barrier_worker()
    return (time.perf_counter() - start) / steps, cpu / steps


def site_cost(number):
    """Seconds one ``with timeline.span(...)`` takes (fastest of 5 repeats)."""
    def site():
        with timeline.span("forward", step=1):
            pass
    return min(timeit.repeat(site, number=number, repeat=5)) / number


def events_in(path):
    import json

    return sum(e["ph"] == "X" for e in json.load(open(path))["traceEvents"])


def main():
    args = parse_args()
    fleet.init(is_collective=True)
    timeline.stop()
    backend.manual_seed(0)
    train, _ = data.load_digits()
    model = fleet.distributed_model(nn.MLP([64, 256, 256, 10]))
    opt = fleet.distributed_optimizer(
        optimizer.Momentum(learning_rate=0.01, momentum=0.9, parameters=model.parameters()),
        fleet.DistributedStrategy())
    loss_fn = nn.CrossEntropyLoss()
    sampler = data.DistributedSampler(len(train), args.batch_size)
    batches = list(train.batches(sampler))
    per_step_seconds(opt, model, loss_fn, batches, 20)

    first = fleet.is_first_worker()
    directory = tempfile.mkdtemp(prefix="fleetmpi-timeline-") if first else tempfile.mkdtemp()
    path = os.path.join(directory, "timeline.json")
    off, on, flush_seconds, events = [], [], [], []
    for _ in range(args.rounds):
        off.append(per_step_seconds(opt, model, loss_fn, batches, args.steps))
        timeline.start(path)
        on.append(per_step_seconds(opt, model, loss_fn, batches, args.steps))
        start = time.perf_counter()
        timeline.flush()
        flush_seconds.append(time.perf_counter() - start)
        if first:
            events.append(events_in(path))
    off_cost = site_cost(100_000)
    timeline.start(path)
    on_cost = site_cost(20_000)
    timeline.stop()
    if first:
        print(f"digits MLP 64-256-256-10, batch {args.batch_size} per rank, "
              f"{fleet.worker_num()} rank(s), {args.rounds} rounds of {args.steps} steps")
        for clock, column in (("wall", 0), ("cpu", 1)):
            for label, pick in (("median round", np.median), ("fastest round", np.min)):
                t_off = pick([t[column] for t in off]) * 1e6
                t_on = pick([t[column] for t in on]) * 1e6
                print(f"  {clock:4s} {label:13s}: per step {t_off:9.1f} us off, {t_on:9.1f} us "
                      f"on, overhead {t_on - t_off:8.1f} us ({(t_on / t_off - 1) * 100:+.1f} %)")
        per_step = np.median(events) / args.steps / fleet.worker_num()
        print(f"  events per step and rank : {per_step:7.1f}")
        print(f"  one recording site       : {off_cost * 1e9:7.0f} ns off, "
              f"{on_cost * 1e9:7.0f} ns on; x events = {per_step * on_cost * 1e6:.1f} us "
              f"per step on, {per_step * off_cost * 1e6:.2f} us off")
        print(f"  flush() at round end     : {np.median(flush_seconds) * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()

"""The host cost of a training step: fleetmpi's GPT next to PyTorch's at GPT-2's depth with
almost no arithmetic, so that what is timed is each trainer's own per-step Python and
dispatch (on a GPU that cost decides whether a step is host-bound).

Both trainers train ``nn.GPT`` (``throughput_run/torch_models.py``'s ``torch_gpt`` for
PyTorch: the same layers, sizes and initial weights' law) on one sequence of ``--tokens``
tokens, with AdamW (``throughput_run/models.py``'s settings), on one thread each
(``FLEETMPI_NUM_THREADS=1``, ``torch.set_num_threads(1)``), a whole step each: forward,
cross-entropy loss, backward, the optimizer's step, zeroing the gradients. fleetmpi's model
and optimizer go through ``fleet.distributed_model`` and ``fleet.distributed_optimizer`` with
a default ``DistributedStrategy`` in a world of one rank, as a user's script would.

Each round times ``--steps`` steps of one trainer, then as many of the other (which goes
first alternates from round to round), so that the machine's drift falls on both; a round's
figure is its median step, in wall-clock time and in this process's CPU time (which other jobs
on a shared machine disturb less). Printed: each round's medians and their ratios, the median
of the rounds' figures, then where a step's CPU time goes for each trainer (forward with the
loss, backward, step, zeroing the gradients: medians over every timed step). Without PyTorch
it says so and prints fleetmpi's figures alone.

    python benchmarks/host_cost.py [--layers 12] [--width 24] [--heads 12] [--tokens 8]
                                   [--vocab 96] [--rounds 7] [--steps 40] [--warmup 10]
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from throughput_run.torch_models import torch_gpt  # noqa: E402
from throughput_run.training import our_optimizer, torch_optimizer  # noqa: E402

PARTS = ("forward", "backward", "step", "clear_grad")
CLOCKS = ("", "CPU ")


def load_torch():
    """PyTorch on one thread, or None where it is not installed."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)
    return torch


def sizes(args):
    """``nn.GPT``'s keyword arguments from the command line."""
    return {"vocab_size": args.vocab, "block_size": args.tokens, "n_layer": args.layers,
            "n_head": args.heads, "n_embd": args.width}


def our_step(gpt, tokens, targets):
    """fleetmpi's step, as a user's script trains: ``step()`` returns the CPU seconds of each
    of ``PARTS``."""
    import fleetmpi as fleet
    import fleetmpi.nn.functional as F
    from fleetmpi import nn

    model = fleet.distributed_model(nn.GPT(**gpt))
    opt = fleet.distributed_optimizer(our_optimizer("adamw", model.parameters()),
                                      fleet.DistributedStrategy())
    x, y = fleet.to_tensor(tokens), fleet.to_tensor(targets.reshape(-1))
    vocab = gpt["vocab_size"]
    return _timed(lambda: F.cross_entropy(model(x).reshape([-1, vocab]), y), opt.step,
                  opt.clear_grad)


def torch_step(torch, gpt, tokens, targets):
    """PyTorch's step, timed as ``our_step``'s."""
    model = torch_gpt(**gpt)
    opt = torch_optimizer("adamw", model.parameters())
    x, y = torch.from_numpy(tokens), torch.from_numpy(targets.reshape(-1))
    return _timed(lambda: torch.nn.functional.cross_entropy(model(x), y), opt.step,
                  opt.zero_grad)


def _timed(loss_of_forward, update, clear):
    """A step (``loss_of_forward()``, its backward, ``update()``, ``clear()``) that returns
    the CPU seconds of each of ``PARTS``."""
    def step():
        start = time.process_time()
        loss = loss_of_forward()
        forward = time.process_time()
        loss.backward()
        backward = time.process_time()
        update()
        stepped = time.process_time()
        clear()
        return forward - start, backward - forward, stepped - backward, \
            time.process_time() - stepped
    return step


def wall_timed(step):
    """``(CPU seconds of each of PARTS, wall-clock seconds)`` of one call of ``step``."""
    start = time.perf_counter()
    parts = step()
    return parts, time.perf_counter() - start


def measure(steps, args):
    """``{trainer: [rounds of [wall_timed(step)]]}``: ``args.warmup`` steps each, then
    ``args.rounds`` rounds of ``args.steps`` steps, the trainers alternating within each
    round, the one going first alternating between rounds."""
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    rounds = {name: [] for name in steps}
    for index in range(args.rounds):
        order = list(steps) if index % 2 == 0 else list(reversed(steps))
        for name in order:
            rounds[name].append([wall_timed(steps[name]) for _ in range(args.steps)])
    return rounds


def round_medians(rounds):
    """Each round's ``(median wall-clock step, median CPU step)``, in seconds."""
    return [(statistics.median(wall for _, wall in timed),
             statistics.median(sum(parts) for parts, _ in timed)) for timed in rounds]


def print_rounds(medians):
    """The rounds' medians of each trainer on each clock (``CLOCKS``), their ratios where
    there are two trainers, and the median of the rounds."""
    names = list(medians)
    header = ""
    for clock in CLOCKS:
        header += "".join(f"{name + ' ' + clock + 'ms':>17}" for name in names)
        header += f"{clock + 'ratio':>11}" if len(names) == 2 else ""
    print(f"{'round':>6}{header}")

    def row(label, figures):
        """``figures``: per trainer, ``(wall, CPU)`` seconds."""
        cells = ""
        for clock in range(len(CLOCKS)):
            cells += "".join(f"{pair[clock] * 1e3:>17.2f}" for pair in figures)
            if len(figures) == 2:
                cells += f"{figures[0][clock] / figures[1][clock]:>11.2f}"
        print(f"{label:>6}{cells}")
    for index, figures in enumerate(zip(*medians.values())):
        row(str(index + 1), figures)
    row("median", [[statistics.median(pair[clock] for pair in medians[name])
                    for clock in range(len(CLOCKS))] for name in names])


def print_parts(rounds):
    """Where each trainer's step goes: the median CPU time of each of ``PARTS`` over its
    timed steps."""
    for name, timed in rounds.items():
        every = [parts for round_ in timed for parts, _ in round_]
        medians = [statistics.median(parts[i] for parts in every) for i in range(len(PARTS))]
        cells = ", ".join(f"{part} {seconds * 1e3:.2f}" for part, seconds in zip(PARTS, medians))
        print(f"{name} step, median CPU ms: {cells}")


def describe(args, torch):
    gpt = sizes(args)
    print(f"host cost of a training step: GPT of {gpt['n_layer']} layers, {gpt['n_embd']} "
          f"wide, {gpt['n_head']} heads, vocabulary {gpt['vocab_size']}, batch 1 of "
          f"{gpt['block_size']} tokens, AdamW, one thread; {args.rounds} rounds of "
          f"{args.steps} steps each after {args.warmup} warm-up steps")
    if torch is None:
        print("PyTorch is not installed: fleetmpi's figures alone")


def main(argv=None):
    args = parse_args(argv)
    os.environ["FLEETMPI_NUM_THREADS"] = "1"
    import fleetmpi as fleet

    fleet.init(is_collective=True)
    torch = load_torch()
    describe(args, torch)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, (1, args.tokens + 1))
    x, y = np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])
    steps = {"fleetmpi": our_step(sizes(args), x, y)}
    if torch is not None:
        steps["PyTorch"] = torch_step(torch, sizes(args), x, y)
    rounds = measure(steps, args)
    print_rounds({name: round_medians(timed) for name, timed in rounds.items()})
    print_parts(rounds)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default, what in (("--layers", 12, "transformer blocks"),
                                ("--width", 24, "embedding width"),
                                ("--heads", 12, "attention heads"),
                                ("--tokens", 8, "tokens of the one sequence"),
                                ("--vocab", 96, "vocabulary"),
                                ("--rounds", 7, "rounds timed"),
                                ("--steps", 40, "steps of each trainer a round"),
                                ("--warmup", 10, "steps of each trainer before the rounds")):
        parser.add_argument(flag, type=int, default=default, help=f"{what} (default {default})")
    args = parser.parse_args(argv)
    for name in ("layers", "width", "heads", "tokens", "vocab", "rounds", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    if args.width % args.heads:
        parser.error(f"--width {args.width} must be a multiple of --heads {args.heads}")
    return args


if __name__ == "__main__":
    main()

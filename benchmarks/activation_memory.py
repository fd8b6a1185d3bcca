"""Activation memory of one training step without and with recompute: a 16-layer MLP and the
GPT-style ``nn.GPT``.

    python benchmarks/activation_memory.py [--width 1024] [--batch 256] [--every 4]
                                           [--gpt_layers 4] [--gpt_width 128] [--gpt_batch 16]

MLP: three runs of the same model, data and seed: no recompute; recompute with a checkpoint
after every ``--every`` Linear+ReLU layers (``act3, act7, act11`` by default); the same with
``enable_offload``. GPT: no recompute, and every transformer block recomputed in backward
(``checkpoints: ["blocks.0", "blocks.1", ...]``). For each run it prints:

- measured peak: the most bytes allocated at once during one step (forward, backward and
  update) above what was live before it, after a warm-up step (so optimizer state and offload
  host buffers already exist; the warm-up's recorded graph was freed by its backward). On CPU
  this is ``tracemalloc`` (NumPy reports its allocations to it); on a GPU a CuPy memory hook
  counting the bytes taken from and returned to the device memory pool. It includes
  temporaries such as the gradients flowing backward.
- held activations: the most bytes held at once by the recorded graph (the arrays its nodes
  keep for backward) and the kept inputs of recomputed segments (the strategy's
  ``peak_activation_bytes``; without recompute, what the graph of one forward holds when
  backward begins, ``held_activation_bytes``).
- host checkpoints: bytes of the offloaded checkpoints in host memory (page-locked on a GPU).
  On CPU host and device memory are the same, so offload lowers the measured peak only because
  its host buffers were allocated in the warm-up step.

The losses of each model's runs are checked to be identical (recompute changes no arithmetic).
"""
import argparse
import gc
import tracemalloc

import numpy as np

import fleetmpi as fleet
from fleetmpi.core import backend
from fleetmpi import nn, optimizer
from fleetmpi.strategies.recompute import held_activation_bytes

LAYERS = 16
CLASSES = 10


class _DevicePoolPeak:
    """The most bytes CuPy's memory pool handed out at once while active, above the start."""

    def __init__(self):
        import cupy

        class Hook(cupy.cuda.MemoryHook):
            name = "fleetmpi_activation_peak"

            def __init__(self):
                self.current = 0
                self.peak = 0

            def malloc_postprocess(self, **kwargs):
                self.current += kwargs["mem_size"]
                self.peak = max(self.peak, self.current)

            def free_postprocess(self, **kwargs):
                self.current -= kwargs["mem_size"]

        self._cupy = cupy
        self._hook = Hook()

    def measure(self, run):
        self._cupy.cuda.Device().synchronize()
        with self._hook:
            run()
            self._cupy.cuda.Device().synchronize()
        return self._hook.peak


def _host_peak(run):
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def measured_peak(run):
    """Peak bytes allocated during ``run()`` above what was live before it."""
    gc.collect()
    if backend.on_gpu():
        return _DevicePoolPeak().measure(run)
    return _host_peak(run)


def mlp(width, dtype):
    return nn.MLP([width] * LAYERS + [CLASSES], dtype=dtype)


def gpt(args):
    return nn.GPT(vocab_size=args.gpt_vocab, block_size=args.gpt_seq, n_layer=args.gpt_layers,
                  n_head=args.gpt_heads, n_embd=args.gpt_width, dtype=args.dtype)


def strategy_for(checkpoints, offload, shape):
    strategy = fleet.DistributedStrategy()
    if checkpoints:
        strategy.recompute = True
        strategy.recompute_configs = {"checkpoints": checkpoints, "enable_offload": offload,
                                      "checkpoint_shape": list(shape) if offload else []}
    return strategy


def measure(model, x, y, strategy):
    """One warm-up step, then the measured one: (measured peak, held activations, host
    checkpoint bytes, loss)."""
    opt = fleet.distributed_optimizer(
        optimizer.Momentum(learning_rate=0.01, momentum=0.9, parameters=model.parameters()),
        strategy, local=True)
    loss_fn = nn.CrossEntropyLoss()
    opt.minimize(model, loss_fn, x, y)
    losses = []
    peak = measured_peak(lambda: losses.append(float(opt.minimize(model, loss_fn, x, y))))
    if strategy.recompute:
        hook = opt.strategies["recompute"]
        held, host = hook.peak_activation_bytes, hook.offloaded_bytes
    else:
        held, host = held_activation_bytes(model, model(x)), 0
    return peak, held, host, losses[0]


def mib(nbytes):
    return f"{nbytes / 2 ** 20:.2f} MiB"


def print_table(title, runs):
    """Measure each ``(label, build, strategy)`` run (``build()`` gives model, inputs, labels,
    from one seed) and print the table; the runs' losses must be identical."""
    print(title)
    header = ("run", "measured peak", "ratio", "held activations", "ratio", "host checkpoints")
    rows, losses, base = [], set(), None
    for label, build, strategy in runs:
        backend.manual_seed(0)
        peak, held, host, loss = measure(*build(), strategy)
        losses.add(loss)
        base = base or (peak, held)
        rows.append((label, f"{peak:,} B ({mib(peak)})", f"{peak / base[0]:.2f}",
                     f"{held:,} B ({mib(held)})", f"{held / base[1]:.2f}", mib(host)))
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths)] + rows:
        print("| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |")
    if len(losses) != 1:
        raise SystemExit(f"the runs' losses differ: {sorted(losses)}")
    print(f"identical loss in every run: {losses.pop()!r}\n")


def mlp_runs(args):
    rng = np.random.default_rng(0)
    x = backend.asarray(rng.standard_normal((args.batch, args.width)).astype(args.dtype))
    y = backend.asarray(rng.integers(0, CLASSES, args.batch))

    def build():
        return mlp(args.width, args.dtype), x, y

    checkpoints = [f"act{i}" for i in range(args.every - 1, LAYERS - 1, args.every)]
    shape = (args.batch, args.width)
    return [("no recompute", build, strategy_for([], False, shape)),
            (f"recompute {', '.join(checkpoints)}", build,
             strategy_for(checkpoints, False, shape)),
            ("recompute + offload", build, strategy_for(checkpoints, True, shape))]


def gpt_runs(args):
    tokens = np.random.default_rng(0).integers(0, args.gpt_vocab,
                                               (args.gpt_batch, args.gpt_seq + 1))
    x, y = backend.asarray(tokens[:, :-1]), backend.asarray(tokens[:, 1:])

    def build():
        return gpt(args), x, y

    blocks = [f"blocks.{i}" for i in range(args.gpt_layers)]
    return [("no recompute", build, strategy_for([], False, ())),
            ("recompute every block", build, strategy_for(blocks, False, ()))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--every", type=int, default=4,
                        help="a checkpoint after every this many Linear+ReLU layers")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--gpt_layers", type=int, default=4)
    parser.add_argument("--gpt_width", type=int, default=128)
    parser.add_argument("--gpt_heads", type=int, default=4)
    parser.add_argument("--gpt_seq", type=int, default=64)
    parser.add_argument("--gpt_batch", type=int, default=16)
    parser.add_argument("--gpt_vocab", type=int, default=96)
    args = parser.parse_args()
    fleet.init(is_collective=True)

    device = "GPU (CuPy memory pool)" if backend.on_gpu() else "CPU (tracemalloc)"
    activation = args.batch * args.width * np.dtype(args.dtype).itemsize
    print_table(f"{LAYERS}-layer MLP, width {args.width}, batch {args.batch}, {args.dtype}; one "
                f"activation = {mib(activation)}; measured on {device}", mlp_runs(args))
    residual = args.gpt_batch * args.gpt_seq * args.gpt_width * np.dtype(args.dtype).itemsize
    print_table(f"nn.GPT, {args.gpt_layers} blocks, width {args.gpt_width}, {args.gpt_heads} "
                f"heads, batch {args.gpt_batch} x {args.gpt_seq} tokens, {args.dtype}; one "
                f"residual stream = {mib(residual)}; measured on {device}", gpt_runs(args))


if __name__ == "__main__":
    main()

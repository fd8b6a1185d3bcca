"""Activation memory of one training step of a 16-layer MLP without and with recompute.

    python benchmarks/activation_memory.py [--width 1024] [--batch 256] [--every 4]

Three runs of the same model, data and seed: no recompute; recompute with a checkpoint after
every ``--every`` Linear+ReLU layers (``act3, act7, act11`` by default); the same with
``enable_offload``. For each it prints:

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

The losses of the three runs are checked to be identical (recompute changes no arithmetic).
"""
import argparse
import gc
import tracemalloc

import numpy as np

import fleetmpi as fleet
from fleetmpi import backend, nn, optimizer
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


def strategy_for(checkpoints, offload, shape):
    strategy = fleet.DistributedStrategy()
    if checkpoints:
        strategy.recompute = True
        strategy.recompute_configs = {"checkpoints": checkpoints, "enable_offload": offload,
                                      "checkpoint_shape": list(shape) if offload else []}
    return strategy


def measure(args, checkpoints, offload):
    backend.manual_seed(0)
    model = mlp(args.width, args.dtype)
    opt = fleet.distributed_optimizer(
        optimizer.Momentum(learning_rate=0.01, momentum=0.9, parameters=model.parameters()),
        strategy_for(checkpoints, offload, (args.batch, args.width)), local=True)
    rng = np.random.default_rng(0)
    x = backend.asarray(rng.standard_normal((args.batch, args.width)).astype(args.dtype))
    y = backend.asarray(rng.integers(0, CLASSES, args.batch))
    loss_fn = nn.CrossEntropyLoss()
    opt.minimize(model, loss_fn, x, y)
    losses = []
    peak = measured_peak(lambda: losses.append(float(opt.minimize(model, loss_fn, x, y))))
    if checkpoints:
        hook = opt.strategies["recompute"]
        held, host = hook.peak_activation_bytes, hook.offloaded_bytes
    else:
        held, host = held_activation_bytes(model, model(x)), 0
    return peak, held, host, losses[0]


def mib(nbytes):
    return f"{nbytes / 2 ** 20:.2f} MiB"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--every", type=int, default=4,
                        help="a checkpoint after every this many Linear+ReLU layers")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    args = parser.parse_args()
    fleet.init(is_collective=True)

    checkpoints = [f"act{i}" for i in range(args.every - 1, LAYERS - 1, args.every)]
    runs = [("no recompute", [], False), (f"recompute {', '.join(checkpoints)}", checkpoints,
                                          False),
            ("recompute + offload", checkpoints, True)]
    activation = args.batch * args.width * np.dtype(args.dtype).itemsize
    device = "GPU (CuPy memory pool)" if backend.on_gpu() else "CPU (tracemalloc)"
    print(f"{LAYERS}-layer MLP, width {args.width}, batch {args.batch}, {args.dtype}; one "
          f"activation = {mib(activation)}; measured on {device}")
    header = ("run", "measured peak", "ratio", "held activations", "ratio", "host checkpoints")
    rows, losses, base = [], set(), None
    for label, names, offload in runs:
        peak, held, host, loss = measure(args, names, offload)
        losses.add(loss)
        base = base or (peak, held)
        rows.append((label, f"{peak:,} B ({mib(peak)})", f"{peak / base[0]:.2f}",
                     f"{held:,} B ({mib(held)})", f"{held / base[1]:.2f}", mib(host)))
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths)] + rows:
        print("| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |")
    if len(losses) != 1:
        raise SystemExit(f"the runs' losses differ: {sorted(losses)}")
    print(f"identical loss in every run: {losses.pop()!r}")


if __name__ == "__main__":
    main()

"""Training throughput of fleetmpi's trainer next to PyTorch DistributedDataParallel (gloo, CPU).

    python benchmarks/train_throughput.py [--steps 30] [--ranks 1 2]

For each model (an MLP and ResNet-20), each rank count and each trainer, one ``mpiexec`` job
trains on the same synthetic data with the same per-rank batch, model shape and optimizer
(Momentum), one BLAS/intra-op thread per rank, and reports samples/s over all ranks. Printed:
the table, ours/PyTorch ratios, and weak-scaling efficiency (samples/s at N ranks over N times
samples/s at 1 rank). PyTorch is optional; without it its columns read "torch not installed".
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

MODELS = {
    # name: (per-rank batch, input shape, classes, warm-up steps, measured steps scale)
    "mlp": (128, (784,), 10, 5, 1.0),
    "resnet20": (32, (3, 32, 32), 10, 2, 0.2),
}
MLP_SIZES = [784, 1024, 1024, 10]


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _data(model, steps):
    batch, shape, classes, _, _ = MODELS[model]
    rng = np.random.default_rng(_world().Get_rank())
    x = rng.standard_normal((steps, batch) + shape, dtype=np.float32)
    y = rng.integers(0, classes, (steps, batch))
    return x, y


def run_ours(model_name, steps):
    import fleetmpi as fleet
    from fleetmpi import nn, optimizer

    fleet.init(is_collective=True)
    model = nn.MLP(MLP_SIZES) if model_name == "mlp" else nn.resnet20()
    model = fleet.distributed_model(model)
    strategy = fleet.DistributedStrategy()
    strategy.fuse_all_optimizer_ops = True
    strategy.fuse_elewise_add_act_ops = True
    strategy.fuse_bn_act_ops = True
    opt = fleet.distributed_optimizer(optimizer.Momentum(
        learning_rate=0.01, momentum=0.9, parameters=model.parameters()), strategy)
    loss_fn = nn.CrossEntropyLoss()
    warmup = MODELS[model_name][3]
    x, y = _data(model_name, warmup + steps)

    def step(i):
        opt.minimize(model, loss_fn, x[i], y[i])

    return _timed(step, warmup, steps)


def _torch_model(model_name):
    import torch.nn as tnn

    if model_name == "mlp":
        layers = []
        for i, (a, b) in enumerate(zip(MLP_SIZES[:-1], MLP_SIZES[1:])):
            layers.append(tnn.Linear(a, b))
            if i < len(MLP_SIZES) - 2:
                layers.append(tnn.ReLU())
        return tnn.Sequential(*layers)

    class Block(tnn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.body = tnn.Sequential(
                tnn.Conv2d(cin, cout, 3, stride, 1, bias=False), tnn.BatchNorm2d(cout),
                tnn.ReLU(), tnn.Conv2d(cout, cout, 3, 1, 1, bias=False), tnn.BatchNorm2d(cout))
            self.shortcut = (tnn.Sequential(tnn.Conv2d(cin, cout, 1, stride, bias=False),
                                            tnn.BatchNorm2d(cout))
                             if stride != 1 or cin != cout else tnn.Identity())
            self.relu = tnn.ReLU()

        def forward(self, x):
            return self.relu(self.body(x) + self.shortcut(x))

    layers = [tnn.Conv2d(3, 16, 3, 1, 1, bias=False), tnn.BatchNorm2d(16), tnn.ReLU()]
    cin = 16
    for stage, width in enumerate((16, 32, 64)):
        for block in range(3):
            layers.append(Block(cin, width, 2 if stage > 0 and block == 0 else 1))
            cin = width
    layers += [tnn.AdaptiveAvgPool2d(1), tnn.Flatten(), tnn.Linear(64, 10)]
    return tnn.Sequential(*layers)


def run_torch(model_name, steps, port):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    world = _world()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=world.Get_rank(), world_size=world.Get_size())
    torch.manual_seed(0)
    model = DistributedDataParallel(_torch_model(model_name))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    warmup = MODELS[model_name][3]
    xs, ys = _data(model_name, warmup + steps)
    x, y = torch.from_numpy(xs), torch.from_numpy(ys)

    def step(i):
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x[i]), y[i]).backward()
        opt.step()

    result = _timed(step, warmup, steps)
    dist.destroy_process_group()
    return result


def _timed(step, warmup, steps):
    """Seconds for ``steps`` steps after ``warmup`` unmeasured ones, all ranks lined up."""
    world = _world()
    for i in range(warmup):
        step(i)
    world.Barrier()
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    world.Barrier()
    elapsed = time.perf_counter() - start
    return elapsed


def worker(args):
    if args.worker == "ours":
        seconds = run_ours(args.model, args.measured)
    else:
        seconds = run_torch(args.model, args.measured, args.port)
    world = _world()
    samples = args.measured * MODELS[args.model][0] * world.Get_size()
    if world.Get_rank() == 0:
        print("RESULT " + json.dumps({"samples_per_s": samples / seconds}))


def launch(trainer, model, ranks, steps, port):
    measured = max(2, int(round(steps * MODELS[model][4])))
    env = dict(os.environ, FLEETMPI_DEVICE="cpu", FLEETMPI_NUM_THREADS="1",
               OMP_NUM_THREADS="1")
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
    cmd = [mpiexec, "-n", str(ranks), sys.executable, os.path.abspath(__file__), "--worker",
           trainer, "--model", model, "--measured", str(measured), "--port", str(port)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])["samples_per_s"]
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")


def torch_available():
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="measured MLP steps "
                        "(ResNet-20 runs a fifth of them)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--worker", choices=["ours", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=list(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--measured", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29611, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    have_torch = torch_available()
    rows = []
    port = 29611
    for model in args.models:
        ours, theirs = {}, {}
        for ranks in args.ranks:
            ours[ranks] = launch("ours", model, ranks, args.steps, port)
            port += 1
            theirs[ranks] = launch("torch", model, ranks, args.steps, port) if have_torch \
                else None
            port += 1
        for ranks in args.ranks:
            rows.append((model, ranks, ours[ranks], theirs[ranks],
                         ours[ranks] / (ranks * ours[args.ranks[0]] / args.ranks[0]),
                         theirs[ranks] / (ranks * theirs[args.ranks[0]] / args.ranks[0])
                         if have_torch else None))
    print(f"samples/s over all ranks, per-rank batch MLP {MODELS['mlp'][0]} "
          f"({'-'.join(map(str, MLP_SIZES))}), ResNet-20 {MODELS['resnet20'][0]} (3x32x32); "
          "1 thread per rank, float32, Momentum")
    print("| model | ranks | fleetmpi samples/s | PyTorch DDP (gloo) samples/s | ratio | "
          "fleetmpi scaling eff. | PyTorch scaling eff. |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for model, ranks, mine, torch_rate, eff, torch_eff in rows:
        if torch_rate is None:
            print(f"| {model} | {ranks} | {mine:,.0f} | torch not installed | - | {eff:.2f} | - |")
        else:
            print(f"| {model} | {ranks} | {mine:,.0f} | {torch_rate:,.0f} | "
                  f"{mine / torch_rate:.2f}x | {eff:.2f} | {torch_eff:.2f} |")


if __name__ == "__main__":
    main()

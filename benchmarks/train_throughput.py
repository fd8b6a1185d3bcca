"""Training throughput of fleetmpi's trainer next to PyTorch DistributedDataParallel (gloo, CPU),
where a ResNet-20 step's time goes, and the Python cost of fleetmpi's tape.

    python benchmarks/train_throughput.py [--steps 30] [--ranks 1 2]
                                          [--models mlp resnet20 gpt resnet50]
                                          [--device cpu|gpu] [--no-breakdown] [--no-tape]
                                          [--json PATH]

For each model (an MLP, ResNet-20, a small GPT, and ResNet-50 at 224x224 on one rank only),
each rank count and each trainer, one ``mpiexec`` job trains on the same synthetic data with
the same per-rank batch, model shape and optimizer (Momentum), one BLAS/intra-op thread per
rank, and reports samples/s over all ranks (for the GPT a sample is a sequence of
``block_size`` tokens). The MLP and the ResNets train with ``opt.minimize(model, loss_fn, x,
y)``, the GPT with ``loss.backward(); opt.step(); opt.clear_grad()``; PyTorch's models are the
same ones written with ``torch.nn`` (the GPT with a tied embedding,
``scaled_dot_product_attention`` and tanh GELU). Printed: the table, ours/PyTorch ratios, and
weak-scaling efficiency (samples/s at N ranks over N times samples/s at 1 rank). PyTorch is
optional; without it its columns read "torch not installed". ``--device gpu`` runs both on one
GPU per rank instead (fleetmpi on CuPy, PyTorch on CUDA with DDP over NCCL), timed with the
device synchronized.

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
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

from fleetmpi.launch.mpi_command import local_command

MODELS = {
    # name: (per-rank batch, input shape, classes, warm-up steps, measured steps scale)
    "mlp": (128, (784,), 10, 5, 1.0),
    "resnet20": (32, (3, 32, 32), 10, 2, 0.2),
    "gpt": (16, (64,), 96, 3, 0.5),
    "resnet50": (8, (3, 224, 224), 1000, 1, 0.1),
}
# Models timed at one rank only (a few steps of a large model).
ONE_RANK = {"resnet50"}
MLP_SIZES = [784, 1024, 1024, 10]
GPT_SIZES = {"vocab_size": 96, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128}
DIGITS_SIZES = (64, 256, 256, 10)
DIGITS_BATCH = 32


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _data(model, steps):
    """Per-step inputs and labels; the GPT's are token ids and the next token of each."""
    batch, shape, classes, _, _ = MODELS[model]
    rng = np.random.default_rng(_world().Get_rank())
    if model == "gpt":
        tokens = rng.integers(0, classes, (steps, batch, shape[0] + 1))
        return tokens[:, :, :-1], tokens[:, :, 1:]
    x = rng.standard_normal((steps, batch) + shape, dtype=np.float32)
    y = rng.integers(0, classes, (steps, batch))
    return x, y


def _our_model(model_name):
    from fleetmpi import nn

    if model_name == "mlp":
        return nn.MLP(MLP_SIZES)
    if model_name == "resnet20":
        return nn.resnet20()
    if model_name == "resnet50":
        return nn.resnet50()
    return nn.GPT(**GPT_SIZES)


def run_ours(model_name, steps):
    import fleetmpi as fleet
    from fleetmpi import backend, nn, optimizer

    fleet.init(is_collective=True)
    model = fleet.distributed_model(_our_model(model_name))
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

    def dygraph_step(i):
        loss = loss_fn(model(x[i]), y[i])
        loss.backward()
        opt.step()
        opt.clear_grad()

    return _timed(dygraph_step if model_name == "gpt" else step, warmup, steps,
                  backend.synchronize)


def _torch_gpt(vocab_size, block_size, n_layer, n_head, n_embd):
    """``nn.GPT`` written with ``torch.nn``: the same layers, sizes and tied embedding."""
    import torch
    import torch.nn as tnn
    import torch.nn.functional as TF

    class TorchGPTBlock(tnn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = tnn.LayerNorm(n_embd), tnn.LayerNorm(n_embd)
            self.qkv, self.proj = tnn.Linear(n_embd, 3 * n_embd), tnn.Linear(n_embd, n_embd)
            self.fc, self.fc_proj = tnn.Linear(n_embd, 4 * n_embd), tnn.Linear(4 * n_embd, n_embd)

        def forward(self, x):
            batch, seq, width = x.shape
            q, k, v = (t.reshape(batch, seq, n_head, width // n_head).transpose(1, 2)
                       for t in self.qkv(self.ln1(x)).split(width, dim=-1))
            y = TF.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(batch, seq, width))
            return x + self.fc_proj(TF.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class TorchGPT(tnn.Module):
        def __init__(self):
            super().__init__()
            self.wte = tnn.Embedding(vocab_size, n_embd)
            self.wpe = tnn.Embedding(block_size, n_embd)
            self.blocks = tnn.ModuleList(TorchGPTBlock() for _ in range(n_layer))
            self.ln_f = tnn.LayerNorm(n_embd)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            return (self.ln_f(x) @ self.wte.weight.T).reshape(-1, vocab_size)

    return TorchGPT()


def _torch_model(model_name):
    import torch.nn as tnn

    if model_name == "gpt":
        return _torch_gpt(**GPT_SIZES)
    if model_name == "resnet50":
        return _torch_resnet50()
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


def _torch_resnet50():
    """``nn.resnet50`` written with ``torch.nn``: the stride in each block's 3x3 convolution,
    a 1x1 convolution and batch norm on the shortcut where the shape changes."""
    import torch.nn as tnn

    def conv_bn(cin, cout, kernel, stride, relu):
        layers = [tnn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False),
                  tnn.BatchNorm2d(cout)]
        return layers + [tnn.ReLU()] if relu else layers

    class Bottleneck(tnn.Module):
        def __init__(self, cin, width, stride):
            super().__init__()
            cout = 4 * width
            self.body = tnn.Sequential(*conv_bn(cin, width, 1, 1, True),
                                       *conv_bn(width, width, 3, stride, True),
                                       *conv_bn(width, cout, 1, 1, False))
            self.shortcut = (tnn.Sequential(*conv_bn(cin, cout, 1, stride, False))
                             if stride != 1 or cin != cout else tnn.Identity())
            self.relu = tnn.ReLU()

        def forward(self, x):
            return self.relu(self.body(x) + self.shortcut(x))

    layers = conv_bn(3, 64, 7, 2, True) + [tnn.MaxPool2d(3, 2, 1)]
    channels = 64
    for stage, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3))):
        for block in range(blocks):
            layers.append(Bottleneck(channels, width, 2 if stage > 0 and block == 0 else 1))
            channels = 4 * width
    layers += [tnn.AdaptiveAvgPool2d(1), tnn.Flatten(), tnn.Linear(channels, 1000)]
    return tnn.Sequential(*layers)


def run_torch(model_name, steps, port, device):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    world = _world()
    gpu = device == "gpu"
    if gpu:
        torch.cuda.set_device(world.Get_rank() % torch.cuda.device_count())
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=world.Get_rank(), world_size=world.Get_size())
    torch.manual_seed(0)
    target = torch.device("cuda" if gpu else "cpu")
    model = DistributedDataParallel(_torch_model(model_name).to(target))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    warmup = MODELS[model_name][3]
    xs, ys = _data(model_name, warmup + steps)
    x, y = torch.from_numpy(xs).to(target), torch.from_numpy(ys).to(target)

    if model_name == "gpt":
        y = y.reshape(len(y), -1)

    def step(i):
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x[i]), y[i]).backward()
        opt.step()

    result = _timed(step, warmup, steps, torch.cuda.synchronize if gpu else lambda: None)
    dist.destroy_process_group()
    return result


def _timed(step, warmup, steps, synchronize):
    """Seconds for ``steps`` steps after ``warmup`` unmeasured ones, all ranks lined up, the
    device's queued work finished (``synchronize``) before each clock reading."""
    world = _world()
    for i in range(warmup):
        step(i)
    synchronize()
    world.Barrier()
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    synchronize()
    world.Barrier()
    elapsed = time.perf_counter() - start
    return elapsed


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
    print("RESULT " + json.dumps({
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
    model = fleet.distributed_model(_our_model("resnet20"))
    strategy = fleet.DistributedStrategy()
    strategy.fuse_all_optimizer_ops = True
    strategy.fuse_bn_act_ops = True
    opt = fleet.distributed_optimizer(optimizer.Momentum(
        learning_rate=0.01, momentum=0.9, parameters=model.parameters()), strategy)
    loss_fn = nn.CrossEntropyLoss()
    x, y = _data("resnet20", 2 + steps)
    for i in range(2):
        opt.minimize(model, loss_fn, x[i], y[i])
    for name in totals:
        totals[name] = 0.0
    elapsed = _timed(lambda i: opt.minimize(model, loss_fn, x[i + 2], y[i + 2]), 0, steps,
                     lambda: None)
    result = {name: seconds / steps * 1e3 for name, seconds in totals.items()}
    result["step"] = elapsed / steps * 1e3
    step, overlapped = result.pop("step"), result.pop(OVERLAPPED)
    result["rest (residual adds, tape, hooks, Python)"] = step - sum(result.values())
    result.update({"step": step, OVERLAPPED: overlapped})
    if _world().Get_rank() == 0:
        print("RESULT " + json.dumps(result))


def print_breakdown(ranks, result):
    step, overlapped = result.pop("step"), result.pop(OVERLAPPED)
    parts = ", ".join(f"{name} {ms:.0f} ms ({100 * ms / step:.0f}%)"
                      for name, ms in result.items())
    print(f"ResNet-20 step at {ranks} rank(s), batch {MODELS['resnet20'][0]} per rank: "
          f"{step:.0f} ms = {parts}; besides, {OVERLAPPED}: {overlapped:.0f} ms")


# -- jobs -------------------------------------------------------------------------------------

def worker(args):
    if args.worker == "tape":
        return tape_worker()
    if args.worker == "breakdown":
        return breakdown_worker(args.measured)
    if args.worker == "ours":
        seconds = run_ours(args.model, args.measured)
    else:
        seconds = run_torch(args.model, args.measured, args.port, args.device)
    world = _world()
    samples = args.measured * MODELS[args.model][0] * world.Get_size()
    if world.Get_rank() == 0:
        print("RESULT " + json.dumps({"samples_per_s": samples / seconds}))


ONE_THREAD = {"FLEETMPI_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def _result(cmd, device="cpu"):
    done = subprocess.run(cmd, capture_output=True, text=True,
                          env=dict(os.environ, FLEETMPI_DEVICE=device, **ONE_THREAD))
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")


def launch(trainer, model, ranks, steps, port, device):
    measured = max(2, int(round(steps * MODELS[model][4])))
    cmd = local_command(ranks, [sys.executable, os.path.abspath(__file__), "--worker", trainer,
                                "--model", model, "--measured", str(measured), "--port",
                                str(port), "--device", device])
    return _result(cmd, device)["samples_per_s"]


def torch_available():
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _rate(samples_per_s):
    return f"{samples_per_s:,.2f}" if samples_per_s < 10 else f"{samples_per_s:,.0f}"


def measure(args, have_torch):
    """``(model, ranks, fleetmpi samples/s, PyTorch samples/s or None, fleetmpi scaling
    efficiency, PyTorch's or None)`` for each model and rank count of ``args``."""
    rows = []
    port = 29611
    for model in args.models:
        ours, theirs = {}, {}
        rank_counts = [1] if model in ONE_RANK else args.ranks
        for ranks in rank_counts:
            ours[ranks] = launch("ours", model, ranks, args.steps, port, args.device)
            port += 1
            theirs[ranks] = launch("torch", model, ranks, args.steps, port, args.device) \
                if have_torch else None
            port += 1
        first = rank_counts[0]
        for ranks in rank_counts:
            rows.append((model, ranks, ours[ranks], theirs[ranks],
                         ours[ranks] / (ranks * ours[first] / first),
                         theirs[ranks] / (ranks * theirs[first] / first)
                         if have_torch else None))
    return rows


def print_table(rows, device):
    gpt = GPT_SIZES
    print(f"samples/s over all ranks, per-rank batch MLP {MODELS['mlp'][0]} "
          f"({'-'.join(map(str, MLP_SIZES))}), ResNet-20 {MODELS['resnet20'][0]} (3x32x32), "
          f"ResNet-50 {MODELS['resnet50'][0]} (3x224x224, one rank), "
          f"GPT {MODELS['gpt'][0]} sequences of {gpt['block_size']} tokens (vocab "
          f"{gpt['vocab_size']}, {gpt['n_layer']} layers, {gpt['n_head']} heads, "
          f"{gpt['n_embd']} wide); float32, Momentum; "
          + ("one GPU per rank" if device == "gpu" else "1 thread per rank"))
    peer = "PyTorch DDP (NCCL)" if device == "gpu" else "PyTorch DDP (gloo)"
    print(f"| model | ranks | fleetmpi samples/s | {peer} samples/s | ratio | "
          "fleetmpi scaling eff. | PyTorch scaling eff. |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for model, ranks, mine, torch_rate, eff, torch_eff in rows:
        if torch_rate is None:
            print(f"| {model} | {ranks} | {_rate(mine)} | torch not installed | - | {eff:.2f} "
                  "| - |")
        else:
            print(f"| {model} | {ranks} | {_rate(mine)} | {_rate(torch_rate)} | "
                  f"{mine / torch_rate:.2f}x | {eff:.2f} | {torch_eff:.2f} |")


# What a sample is, per model (the rates count samples over all ranks).
UNITS = {"mlp": "samples/s", "resnet20": "samples/s", "resnet50": "samples/s",
         "gpt": f"sequences/s ({GPT_SIZES['block_size']} tokens)"}


def write_json(path, rows, device, steps):
    """``rows`` as JSON objects, one per model and rank count: ``model``, ``ranks``,
    per-rank ``batch``, ``precision`` (every model trains in float32), ``graphs`` (no CUDA
    graph capture), ``fleetmpi`` and ``pytorch`` rates (``pytorch`` null without torch),
    their ``ratio``, ``unit``, ``device`` and the MLP's measured ``steps``."""
    found = [{"model": model, "ranks": ranks, "batch": MODELS[model][0], "precision": "fp32",
              "graphs": False, "fleetmpi": mine, "pytorch": theirs,
              "ratio": mine / theirs if theirs else None, "unit": UNITS[model],
              "device": device, "steps": steps}
             for model, ranks, mine, theirs, _, _ in rows]
    with open(path, "w") as f:
        json.dump(found, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="measured MLP steps "
                        "(ResNet-20 runs a fifth of them, the GPT half, ResNet-50 a tenth)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                        help="gpu: both trainers on one GPU per rank")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the table's rows to PATH as JSON (write_json)")
    parser.add_argument("--no-tape", action="store_true", help="skip the tape's cost")
    parser.add_argument("--no-breakdown", action="store_true",
                        help="skip the ResNet-20 step's time breakdown")
    parser.add_argument("--worker", choices=["ours", "torch", "tape", "breakdown"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=list(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--measured", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29611, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    rows = measure(args, torch_available())
    print_table(rows, args.device)
    if args.json:
        write_json(args.json, rows, args.device, args.steps)
    if not args.no_breakdown and args.device == "cpu":
        ranks = max(args.ranks)
        print_breakdown(ranks, _result(local_command(ranks, [
            sys.executable, os.path.abspath(__file__), "--worker", "breakdown", "--measured",
            str(BREAKDOWN_STEPS)])))
    if not args.no_tape:
        print_tape_cost(_result([sys.executable, os.path.abspath(__file__), "--worker", "tape"]))


if __name__ == "__main__":
    main()

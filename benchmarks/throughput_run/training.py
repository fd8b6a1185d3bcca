"""One trainer's job: every precision asked for of one model, each trained on the same
synthetic data, measured (``timing.measure``) and reported on a ``RESULT`` line as it ends.

fleetmpi (``run_ours``): ``fleet.init``, the fuse_* build strategy switches on, the precision
through ``precision.request_amp``, the MLP and the ResNets trained with ``opt.minimize(model,
loss_fn, x, y)``, the GPTs with ``loss.backward(); opt.step(); opt.clear_grad()``; on a GPU
also the step's kernel count. PyTorch (``run_torch``): the same model written with
``torch.nn`` in DistributedDataParallel (gloo on the CPU, NCCL on a GPU with cuDNN's
autotuner), autocast and a GradScaler for float16.
"""
import gc
import json
import os
import time
import traceback

import numpy as np

from gpu_run.probe_versions import cpu_model
from gpu_run.process import RESULT

from . import kernels, memory, timing
from .models import OPTIMIZERS, our_model, spec
from .precision import Unsupported, check_amp_dtype, request_amp, torch_autocast, torch_scaler
from .rows import not_measured
from .torch_models import torch_model

# Distinct batches of synthetic data each job keeps on its device; step i trains on i % this.
DATA_BATCHES = 4


def batches(model, device, count=DATA_BATCHES):
    """``count`` batches of inputs and labels; a GPT's are token ids and the next token of
    each."""
    found = spec(model, device)
    rng = np.random.default_rng(timing.world().Get_rank())
    if found.gpt is not None:
        tokens = rng.integers(0, found.classes, (count, found.batch, found.sample[0] + 1))
        return np.ascontiguousarray(tokens[:, :, :-1]), np.ascontiguousarray(tokens[:, :, 1:])
    x = rng.standard_normal((count, found.batch) + found.sample, dtype=np.float32)
    y = rng.integers(0, found.classes, (count, found.batch))
    return x, y


def _report(precision, found):
    if timing.world().Get_rank() == 0:
        print(RESULT + json.dumps(dict(found, precision=precision)), flush=True)


def failure(exc):
    """The reason a failed run gives: the exception, the line that raised it and the last line
    of fleetmpi's own code it came through (a GPU run's log may not come back; its JSON does)."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/fleetmpi/" in f.filename or "/strategies/" in f.filename]
    places = dict.fromkeys(f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"
                           for f in frames[-1:] + ours[-1:])
    where = f" (raised at {', from '.join(places)})" if places else ""
    return f"failed: {type(exc).__name__}: {str(exc)[:200]}{where}"[:400]


def _each_precision(args, train_one, release):
    """Train each precision of ``args`` in turn, ``train_one(precision, deadline)`` with an
    equal share of the time left, reporting each as it ends; a precision that the trainer
    lacks or that fails reports why, ``release()`` frees what it left, and the next one runs."""
    for index, precision in enumerate(args.precisions):
        now = time.time()
        deadline = now + (args.deadline - now) / (len(args.precisions) - index)
        try:
            found = train_one(precision, deadline)
        except Unsupported as exc:
            found = not_measured(str(exc))
        except Exception as exc:  # noqa: BLE001 - the benchmark reports a failure, never dies
            traceback.print_exc()
            found = not_measured(failure(exc))
        gc.collect()
        release()
        _report(precision, found)


def _rates(found, model, device):
    """A trainer's report from ``timing.measure``'s result."""
    samples = found["steps"] * spec(model, device).batch * timing.world().Get_size()
    return {"samples_per_s": samples / found["seconds"], "steps": found["steps"],
            "host_ms": found["host_ms"], "peak_bytes": found["peak_bytes"]}


def our_optimizer(kind, parameters):
    from fleetmpi import optimizer

    settings = OPTIMIZERS[kind]
    if kind == "adamw":
        return optimizer.AdamW(parameters=parameters, **settings)
    return optimizer.Momentum(parameters=parameters, **settings)


def _our_step(model, opt, loss_fn, x, y, dygraph):
    """One training step on batch ``i % len(x)``: ``opt.minimize``, or the dygraph idiom."""
    def step(i):
        i %= len(x)
        if not dygraph:
            opt.minimize(model, loss_fn, x[i], y[i])
            return
        loss = loss_fn(model(x[i]), y[i])
        loss.backward()
        opt.step()
        opt.clear_grad()
    return step


def _gpu_name():
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()


def _train_ours(args, precision, deadline):
    import fleetmpi as fleet
    from fleetmpi.core import backend
    from fleetmpi import nn

    found = spec(args.model, args.device)
    baseline = memory.resident_bytes()
    strategy = fleet.DistributedStrategy()
    strategy.fuse_all_optimizer_ops = True
    strategy.fuse_elewise_add_act_ops = True
    strategy.fuse_bn_act_ops = True
    request_amp(strategy, precision)
    model = fleet.distributed_model(our_model(args.model, args.device))
    opt = fleet.distributed_optimizer(our_optimizer(found.optimizer, model.parameters()),
                                      strategy)
    check_amp_dtype(opt, precision)
    x, y = (backend.asarray(a) for a in batches(args.model, args.device))
    step = _our_step(model, opt, nn.CrossEntropyLoss(), x, y, dygraph=found.gpt is not None)
    gpu = backend.on_gpu()
    window = memory.cupy_peak() if gpu else memory.ResidentPeak(baseline)
    measured = timing.measure(step, backend.synchronize, window, deadline, found.warmup,
                              args.measured)
    count, why = kernels.count_kernels(lambda: step(0)) if gpu else (None, "n/a on the CPU")
    return dict(_rates(measured, args.model, args.device), kernels=count, kernels_reason=why,
                device_name=_gpu_name() if gpu else cpu_model())


def run_ours(args):
    import fleetmpi as fleet
    from fleetmpi.core import backend

    fleet.init(is_collective=True)

    def release():
        if backend.on_gpu():
            backend.array_module().get_default_memory_pool().free_all_blocks()

    _each_precision(args, lambda precision, deadline: _train_ours(args, precision, deadline),
                    release)


def torch_optimizer(kind, parameters):
    import torch

    settings = dict(OPTIMIZERS[kind])
    settings["lr"] = settings.pop("learning_rate")
    if kind == "adamw":
        return torch.optim.AdamW(parameters, **settings)
    return torch.optim.SGD(parameters, **settings)


def _train_torch(args, precision, deadline):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    found = spec(args.model, args.device)
    baseline = memory.resident_bytes()
    gpu = args.device == "gpu"
    torch.manual_seed(0)
    target = torch.device("cuda" if gpu else "cpu")
    model = DistributedDataParallel(torch_model(args.model, args.device).to(target))
    opt = torch_optimizer(found.optimizer, model.parameters())
    loss_fn = torch.nn.CrossEntropyLoss()
    autocast = torch_autocast(precision, target.type)
    scaler = torch_scaler(precision, target.type)
    xs, ys = batches(args.model, args.device)
    x, y = torch.from_numpy(xs).to(target), torch.from_numpy(ys).to(target)
    if found.gpt is not None:
        y = y.reshape(len(y), -1)

    def step(i):
        i %= len(x)
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = loss_fn(model(x[i]), y[i])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    window = memory.TorchPeak() if gpu else memory.ResidentPeak(baseline)
    measured = timing.measure(step, torch.cuda.synchronize if gpu else lambda: None, window,
                              deadline, found.warmup, args.measured)
    return dict(_rates(measured, args.model, args.device),
                device_name=torch.cuda.get_device_name() if gpu else cpu_model())


def run_torch(args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    world = timing.world()
    gpu = args.device == "gpu"
    if gpu:
        torch.cuda.set_device(world.Get_rank() % torch.cuda.device_count())
        torch.backends.cudnn.benchmark = True
    dist.init_process_group("nccl" if gpu else "gloo",
                            init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=world.Get_rank(), world_size=world.Get_size())
    _each_precision(args, lambda precision, deadline: _train_torch(args, precision, deadline),
                    torch.cuda.empty_cache if gpu else lambda: None)
    dist.destroy_process_group()

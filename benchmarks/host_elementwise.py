"""The elementwise parts of a CPU training step, ours next to PyTorch: fused optimizer updates
and batch norm + ReLU.

    python benchmarks/host_elementwise.py [--parameters 1863690] [--repeats 30]

One process, one thread (``OMP_NUM_THREADS=1``; PyTorch's ``set_num_threads(1)``), float32.
Printed, best of ``--repeats`` runs of each, in ms:

* Momentum and Adam over ``--parameters`` values (the MLP of ``train_throughput.py`` has
  1,863,690): ``fleetmpi.kernels`` (the fused update, over cache-sized blocks), the same
  NumPy reference over the whole arrays at once (what the blocks replaced), and
  ``torch.optim`` (``foreach``) on one flat parameter;
* batch norm + ReLU (``fuse_bn_act_ops``) on 32x16x32x32, forward and backward through each
  trainer's autograd: ``nn.BatchNorm2D`` + ``nn.ReLU`` fused, and ``torch.nn`` likewise.

Every pair is checked to agree before it is timed.
"""
import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from fleetmpi.core import backend  # noqa: E402
from fleetmpi import kernels, nn, to_tensor  # noqa: E402
from fleetmpi.kernels import reference  # noqa: E402


def best_ms(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def updates(n, repeats, torch):
    rng = np.random.default_rng(0)
    grad = rng.standard_normal(n, dtype=np.float32)
    rows = []
    for name, states, args, make in (
            ("Momentum", 1, (0.01, 0.9, 0.0, False),
             lambda p: torch.optim.SGD([p], lr=0.01, momentum=0.9, foreach=True)),
            ("Adam", 2, (0.001, 0.9, 0.999, 1e-8, 1, 0.0, False),
             lambda p: torch.optim.Adam([p], lr=0.001, foreach=True))):
        arrays = [rng.standard_normal(n, dtype=np.float32) for _ in range(states + 1)]
        if name == "Adam":
            arrays[2] = np.abs(arrays[2])
        extra = (np,) if name == "Adam" else ()
        multi = getattr(kernels, f"multi_tensor_{name.lower()}_update")

        def fused(param, grad, *rest, multi=multi, states=states):
            """The multi-tensor update over this one flat array."""
            multi([param], [grad], *([a] for a in rest[:states]), *rest[states:])
        whole = getattr(reference, name.lower() + "_update")
        check = [a.copy() for a in arrays]
        fused(arrays[0], grad, *arrays[1:], *args)
        whole(check[0], grad, *check[1:], *args, *extra)
        assert all(np.array_equal(a, b) for a, b in zip(arrays, check)), name
        row = [name, best_ms(lambda: fused(arrays[0], grad, *arrays[1:], *args), repeats),
               best_ms(lambda: whole(check[0], grad, *check[1:], *args, *extra), repeats)]
        if torch is not None:
            p = torch.nn.Parameter(torch.from_numpy(arrays[0].copy()))
            p.grad = torch.from_numpy(grad)
            opt = make(p)
            row.append(best_ms(opt.step, repeats))
        rows.append(row)
    return rows


def batch_norm_relu(repeats, torch):
    shape = (32, 16, 32, 32)
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape, dtype=np.float32)
    dy = rng.standard_normal(shape, dtype=np.float32)
    model = nn.Sequential(nn.BatchNorm2D(16), nn.ReLU())
    model.configure_fusion(fuse_bn_act_ops=True)

    def ours():
        xt = to_tensor(x, stop_gradient=False)
        y = model(xt)
        (y * to_tensor(dy)).sum().backward()
        return y.numpy(), np.asarray(xt.grad)
    row = ["batch norm + ReLU, forward and backward", best_ms(ours, repeats), None]
    if torch is not None:
        tmodel = torch.nn.Sequential(torch.nn.BatchNorm2d(16, momentum=0.1),
                                     torch.nn.ReLU())
        tdy = torch.from_numpy(dy)

        def theirs():
            xt = torch.from_numpy(x).requires_grad_()
            y = tmodel(xt)
            y.backward(tdy)
            return y.detach().numpy(), xt.grad.numpy()
        for a, b in zip(ours(), theirs()):
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)
        row.append(best_ms(theirs, repeats))
    return [row]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parameters", type=int, default=1863690)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    backend.array_module()  # the host memory settings a training process runs with
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:
        torch = None
    print("| work | fleetmpi (ms) | whole-array reference (ms) | PyTorch (ms) | "
          "PyTorch / fleetmpi |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, ours, whole, *theirs in (updates(args.parameters, args.repeats, torch)
                                       + batch_norm_relu(args.repeats, torch)):
        peer = theirs[0] if theirs else None
        print(f"| {name} | {ours:.2f} | {'' if whole is None else f'{whole:.2f}'} | "
              f"{'torch not installed' if peer is None else f'{peer:.2f}'} | "
              f"{'' if peer is None else f'{peer / ours:.2f}x'} |")


if __name__ == "__main__":
    main()

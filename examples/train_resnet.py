"""Synthetic-data training throughput of ResNet-20 (32x32) or ResNet-50 (224x224).

    mpiexec -n 2 python examples/train_resnet.py --model resnet20 --batch-size 32 --steps 20

Data parallel with the collective guide's fusion switches on; rank 0 prints samples/s over all
ranks (with a progress bar while it runs on a terminal). On a GPU (CuPy) this is the ResNet-50 throughput job; on CPU ResNet-20 is the practical one.
"""
import argparse
import time

import fleetmpi as fleet
from fleetmpi import backend, data, nn, optimizer, progress

SHAPES = {"resnet20": ((3, 32, 32), 10), "resnet50": ((3, 224, 224), 1000)}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="resnet20")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    return parser.parse_args()


def main():
    args = parse_args()
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    nn.set_default_dtype(args.dtype)
    shape, classes = SHAPES[args.model]
    build = nn.resnet20 if args.model == "resnet20" else nn.resnet50
    model = fleet.distributed_model(build(num_classes=classes))
    strategy = fleet.DistributedStrategy()
    strategy.fuse_all_optimizer_ops = True
    strategy.fuse_bn_act_ops = True  # ResNet's BatchNorm + ReLU pairs (it has no Linear + act)
    opt = fleet.distributed_optimizer(optimizer.Momentum(
        learning_rate=0.1, momentum=0.9, parameters=model.parameters(), weight_decay=1e-4),
        strategy)
    loss_fn = nn.CrossEntropyLoss()
    images = data.synthetic_images(args.batch_size * 4, shape, classes, dtype=args.dtype,
                                   seed=fleet.worker_index())
    sampler = data.DistributedSampler(len(images), args.batch_size, num_replicas=1, rank=0)
    batches = list(images.batches(sampler))

    for i in range(args.warmup):
        opt.minimize(model, loss_fn, *batches[i % len(batches)])
    fleet.barrier_worker()
    start = time.perf_counter()
    bar = progress.ProgressBar(args.steps)
    for i in range(args.steps):
        loss = opt.minimize(model, loss_fn, *batches[i % len(batches)])
        bar.step(args.batch_size * fleet.worker_num(), loss=loss)
    float(loss)  # waits for the device before the clock stops
    bar.close()
    fleet.barrier_worker()
    elapsed = time.perf_counter() - start
    if fleet.is_first_worker():
        rate = args.steps * args.batch_size * fleet.worker_num() / elapsed
        print(f"{args.model}: {rate:,.1f} samples/s on {fleet.worker_num()} rank(s) "
              f"({backend.array_module().__name__}, batch {args.batch_size} per rank, "
              f"{args.dtype}, loss {float(loss):.3f})")


if __name__ == "__main__":
    main()

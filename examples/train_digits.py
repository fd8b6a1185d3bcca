"""Train an MLP on scikit-learn's bundled 8x8 digits with data parallelism, and test it.

    mpiexec -n 2 python examples/train_digits.py

Every rank trains on its own shard of each epoch (the distributed sampler), gradients are
averaged over the ranks after every step, and rank 0 shows a progress line with the loss and the
training throughput, then the test accuracy. Needs scikit-learn (``pip install
'fleetmpi[examples]'``); nothing is downloaded.
"""
import argparse
import sys
import time

import numpy as np

import fleetmpi as fleet
from fleetmpi import backend, data, nn, optimizer
from fleetmpi.optimizer import lr


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--learning-rate", type=float, default=0.05)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-accuracy", type=float, default=None,
                        help="exit with status 1 when the test accuracy is below this")
    return parser.parse_args()


def evaluate(model, dataset):
    model.eval()
    logits = model.forward(backend.asarray(dataset.features))
    model.train()
    predicted = backend.to_numpy(logits.argmax(axis=1))
    return float((predicted == dataset.labels).mean())


def progress(epoch, epochs, loss, samples_per_second):
    width = 30
    filled = int(width * epoch / epochs)
    bar = "#" * filled + "-" * (width - filled)
    sys.stdout.write(f"\repoch {epoch:3d}/{epochs} [{bar}] loss {loss:.4f} "
                     f"{samples_per_second:,.0f} samples/s")
    sys.stdout.flush()


def main():
    args = parse_args()
    fleet.init(is_collective=True)
    backend.manual_seed(args.seed)
    train, test = data.load_digits()

    model = fleet.distributed_model(nn.MLP([64, args.hidden, args.hidden, 10]))
    schedule = lr.LinearWarmup(lr.CosineAnnealingDecay(args.learning_rate, T_max=args.epochs),
                               warmup_steps=2, start_lr=0.0, end_lr=args.learning_rate)
    strategy = fleet.DistributedStrategy()
    strategy.fuse_all_optimizer_ops = True
    strategy.fuse_elewise_add_act_ops = True
    opt = fleet.distributed_optimizer(
        optimizer.Momentum(learning_rate=schedule, momentum=0.9, parameters=model.parameters(),
                           use_nesterov=True, weight_decay=1e-4), strategy)
    loss_fn = nn.SoftmaxCrossEntropy()
    sampler = data.DistributedSampler(len(train), args.batch_size)

    first = fleet.is_first_worker()
    start = time.perf_counter()
    seen = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        losses = [opt.minimize(model, loss_fn, x, y) for x, y in train.batches(sampler)]
        schedule.step()
        seen += len(sampler.indices()) * fleet.worker_num()
        if first:
            mean_loss = float(np.mean([float(loss) for loss in losses]))
            progress(epoch + 1, args.epochs, mean_loss, seen / (time.perf_counter() - start))
    accuracy = evaluate(model, test)
    if first:
        print(f"\ntest accuracy {accuracy:.4f} on {len(test)} images after "
              f"{time.perf_counter() - start:.1f} s on {fleet.worker_num()} rank(s)")
    if args.min_accuracy is not None and accuracy < args.min_accuracy:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

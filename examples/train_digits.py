"""Train an MLP on scikit-learn's bundled 8x8 digits with data parallelism, and test it.

    mpiexec -n 2 python examples/train_digits.py

The model is a user-defined ``nn.Layer`` with a ``forward``, trained in Paddle dygraph's idiom
(``loss.backward(); opt.step(); opt.clear_grad()``). Every rank trains on its own shard of each epoch (the distributed sampler), gradients are
averaged over the ranks after every step, and rank 0 shows a progress bar with the loss, the
training throughput and the time left (one line per epoch when the output is not a terminal),
then the test accuracy. Needs scikit-learn (``pip install
'fleetmpi[examples]'``); nothing is downloaded.
"""
import argparse
import time

import numpy as np

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from fleetmpi import backend, data, nn, optimizer, progress
from fleetmpi.optimizer import lr


class DigitsNet(nn.Layer):
    """Two hidden ReLU layers of ``hidden`` units over the 64 pixels, 10 class logits."""

    def __init__(self, hidden):
        super().__init__()
        self.fc1 = nn.Linear(64, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 10)

    def forward(self, x):
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))


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
    with fleet.no_grad():
        logits = model(backend.asarray(dataset.features))
    model.train()
    predicted = logits.numpy().argmax(axis=1)
    return float((predicted == dataset.labels).mean())


def main():
    args = parse_args()
    fleet.init(is_collective=True)
    backend.manual_seed(args.seed)
    train, test = data.load_digits()

    model = fleet.distributed_model(DigitsNet(args.hidden))
    sampler = data.DistributedSampler(len(train), args.batch_size)
    # stepped every iteration: a warm-up of at most 2 epochs and a tenth of the run, so that
    # short runs train too
    steps = args.epochs * len(sampler)
    warmup = max(1, min(2 * len(sampler), steps // 10))
    schedule = lr.LinearWarmup(lr.CosineAnnealingDecay(args.learning_rate, T_max=steps),
                               warmup_steps=warmup, start_lr=0.0, end_lr=args.learning_rate)
    strategy = fleet.DistributedStrategy()
    strategy.fuse_all_optimizer_ops = True
    opt = fleet.distributed_optimizer(
        optimizer.Momentum(learning_rate=schedule, momentum=0.9, parameters=model.parameters(),
                           use_nesterov=True, weight_decay=1e-4), strategy)

    start = time.perf_counter()
    bar = progress.ProgressBar(args.epochs * len(sampler), epochs=args.epochs)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        losses = []
        for x, y in train.batches(sampler):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.clear_grad()
            losses.append(loss.item())
            bar.step(len(x) * fleet.worker_num(), loss=losses[-1])
            schedule.step()
        bar.end_epoch(loss=float(np.mean(losses)))
    bar.close()
    accuracy = evaluate(model, test)
    if fleet.is_first_worker():
        print(f"test accuracy {accuracy:.4f} on {len(test)} images after "
              f"{time.perf_counter() - start:.1f} s on {fleet.worker_num()} rank(s)")
    if args.min_accuracy is not None and accuracy < args.min_accuracy:
        raise SystemExit(f"test accuracy {accuracy:.4f} is below --min-accuracy "
                         f"{args.min_accuracy}")


if __name__ == "__main__":
    main()

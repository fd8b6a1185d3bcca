"""Train an MLP on scikit-learn's bundled 8x8 digits with parameter servers, and test it.

    fleetmpirun --server_num 2 --worker_num 2 examples/train_pserver.py --mode async

The servers hold the parameters, cut into blocks spread over them; each worker trains on its
shard of the digits (``fleet.util.get_file_shard`` over a list of parts, as Paddle scripts
shard their files) and exchanges with the servers as ``--mode`` says: ``sync`` pushes the
gradients of every step and waits for the updated parameters, ``async`` does the same without
waiting for the other workers, ``geo`` trains locally and pushes the change of its parameters
every ``--k-steps`` steps. Roles come from the variables ``fleetmpirun`` exports, as Paddle's
launcher exports them (``PaddleCloudRoleMaker``). At the end the workers' test accuracies are
averaged with ``fleet.util.all_reduce`` and printed by worker 0, which shows a progress bar on
a terminal and a line per epoch. Needs scikit-learn
(``pip install 'fleetmpi[examples]'``); nothing is downloaded.
"""
import argparse
import sys

import numpy as np

import fleetmpi as fleet
from fleetmpi import backend, data, nn, optimizer, progress

PARTS = 8


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["sync", "async", "geo"], default="async")
    parser.add_argument("--k-steps", type=int, default=4, help="GEO's push interval")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=0.05)
    parser.add_argument("--min-accuracy", type=float, default=None,
                        help="exit with status 1 when the mean test accuracy is below this")
    return parser.parse_args()


def strategy_for(mode, k_steps):
    strategy = fleet.DistributedStrategy()
    strategy.a_sync = mode != "sync"
    strategy.a_sync_configs = {"k_steps": {"sync": -1, "async": 0, "geo": k_steps}[mode]}
    return strategy


def my_rows(train_size):
    """This worker's rows of the training set: its parts of ``PARTS`` equal ones."""
    parts = np.array_split(np.arange(train_size), PARTS)
    mine = fleet.util.get_file_shard([f"part-{i}" for i in range(PARTS)])
    return np.concatenate([parts[int(name.split("-")[1])] for name in mine])


def main():
    args = parse_args()
    fleet.init(fleet.PaddleCloudRoleMaker(is_collective=False))
    backend.manual_seed(0)
    model = fleet.distributed_model(nn.MLP([64, 128, 10]))
    opt = fleet.distributed_optimizer(
        optimizer.Momentum(learning_rate=args.learning_rate, momentum=0.9,
                           parameters=model.parameters()),
        strategy_for(args.mode, args.k_steps))
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()
        return
    fleet.init_worker()
    train, test = data.load_digits()
    rows = my_rows(len(train))
    features, labels = train.features[rows], train.labels[rows]
    rng = np.random.default_rng(fleet.worker_index())
    loss_fn = nn.CrossEntropyLoss()
    steps = -(-len(rows) // args.batch_size)
    bar = progress.ProgressBar(args.epochs * steps, epochs=args.epochs)  # worker 0's
    for epoch in range(args.epochs):
        order = rng.permutation(len(rows))
        losses = []
        for start in range(0, len(order), args.batch_size):
            batch = order[start:start + args.batch_size]
            loss = opt.minimize(model, loss_fn, backend.asarray(features[batch]), labels[batch])
            losses.append(float(loss))
            bar.step(len(batch), loss=losses[-1])
        bar.end_epoch(summary=f"epoch {epoch + 1}/{args.epochs}: worker 0's mean loss "
                              f"{np.mean(losses):.4f}", file=sys.stdout)
    bar.close()
    fleet.stop_worker()
    model.eval()
    with fleet.no_grad():
        predicted = model(backend.asarray(test.features)).numpy().argmax(axis=1)
    accuracy = float((predicted == test.labels).mean())
    mean = float(fleet.util.all_reduce(accuracy)) / fleet.worker_num()
    fleet.util.print_on_rank(f"{args.mode}: mean test accuracy {mean:.4f} over "
                             f"{fleet.worker_num()} worker(s) and {fleet.server_num()} "
                             f"server(s) ({', '.join(fleet.server_endpoints())})", 0)
    if args.min_accuracy is not None and mean < args.min_accuracy:
        raise SystemExit(f"mean test accuracy {mean:.4f} is below --min-accuracy "
                         f"{args.min_accuracy}")


if __name__ == "__main__":
    main()

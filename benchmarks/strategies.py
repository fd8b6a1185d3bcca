"""Convergence report: the digits MLP trained at 2 ranks with each strategy alone and with each
combination of the seeds' table, next to plain data parallel.

    python benchmarks/strategies.py [--ranks 2] [--epochs 20]

One ``mpiexec`` job trains every configuration for the same number of steps from the same
initial weights and data order (a fresh model per configuration), and rank 0 prints test
accuracy, samples/s over all ranks and the bytes a rank handed to collectives per step. The
model has batch norm, so sync_batch_norm has work to do. Strategies that start with a warm-up
(dgc's rampup, localsgd's begin_step) get one epoch of it. Per-strategy hyperparameters are the
ones a user would pick for that strategy: lars a 20 times larger base rate (its trust ratio,
lars_coeff 0.001 by default, scales every step down), lamb Adam at a 20 times smaller one,
gradient_merge the rate scaled by k_steps (the linear scaling rule for a k times larger batch).
"""
import argparse
import os
import subprocess
import sys
import time

PER_RANK_BATCH = 32
HIDDEN = 256


def configurations(steps_per_epoch):
    epoch = steps_per_epoch
    alone = {
        "amp": {"amp": True},
        "recompute": {"recompute": True,
                      "recompute_configs": {"checkpoints": ["act0", "act1"]}},
        "gradient_merge": {"gradient_merge": True,
                           "gradient_merge_configs": {"k_steps": 4, "avg": True},
                           "lr_scale": 4.0},
        "lars": {"lars": True, "lr_scale": 20.0},
        "lamb": {"lamb": True, "optimizer": "adam"},
        "localsgd": {"localsgd": True,
                     "localsgd_configs": {"k_steps": 4, "begin_step": epoch}},
        "adaptive_localsgd": {"adaptive_localsgd": True,
                              "adaptive_localsgd_configs": {"init_k_steps": 2,
                                                            "begin_step": epoch}},
        "dgc": {"dgc": True, "dgc_configs": {
            "rampup_begin_step": epoch, "rampup_step": epoch,
            "sparsity": [0.75, 0.9375, 0.984375, 0.996, 0.999]}},
        "fp16_allreduce": {"fp16_allreduce": True},
        "sync_batch_norm": {"sync_batch_norm": True},
    }
    combos = [("amp", "recompute"), ("dgc", "recompute"), ("lars", "recompute"),
              ("lamb", "recompute"), ("amp", "localsgd"), ("amp", "adaptive_localsgd"),
              ("amp", "lars"), ("amp", "lamb"), ("amp", "recompute", "lars"),
              ("amp", "recompute", "lamb")]
    result = {"data parallel": {}}
    result.update(alone)
    for combo in combos:
        merged = {}
        for name in combo:
            merged.update(alone[name])
        result["+".join(combo)] = merged
    return result


def build(settings, base_lr):
    import fleetmpi as fleet
    from fleetmpi import nn, optimizer

    model = nn.Sequential(("fc0", nn.Linear(64, HIDDEN)), ("bn0", nn.BatchNorm1D(HIDDEN)),
                          ("act0", nn.ReLU()), ("fc1", nn.Linear(HIDDEN, HIDDEN)),
                          ("bn1", nn.BatchNorm1D(HIDDEN)), ("act1", nn.ReLU()),
                          ("fc2", nn.Linear(HIDDEN, 10)))
    model = fleet.distributed_model(model)
    settings = dict(settings)
    lr = base_lr * settings.pop("lr_scale", 1.0)
    if settings.pop("optimizer", "momentum") == "adam":
        opt = optimizer.Adam(learning_rate=lr / 20, parameters=model.parameters())
    else:
        opt = optimizer.Momentum(learning_rate=lr, momentum=0.9, parameters=model.parameters())
    strategy = fleet.DistributedStrategy()
    strategy.fuse_all_optimizer_ops = True
    for key, value in settings.items():
        setattr(strategy, key, value)
    return model, fleet.distributed_optimizer(opt, strategy)


def accuracy(model, dataset):
    from fleetmpi.core import backend

    model.eval()
    logits = model.forward(backend.asarray(dataset.features))
    model.train()
    return float((backend.to_numpy(logits.argmax(axis=1)) == dataset.labels).mean())


def worker(args):
    import fleetmpi as fleet
    from fleetmpi.core import backend
    from fleetmpi.training import data
    from fleetmpi import nn

    fleet.init(is_collective=True)
    train, test = data.load_digits()
    sampler = data.DistributedSampler(len(train), PER_RANK_BATCH)
    batches_per_epoch = len(sampler)
    rows = []
    for label, settings in configurations(batches_per_epoch).items():
        backend.manual_seed(args.seed)
        model, opt = build(settings, args.learning_rate)
        loss_fn = nn.CrossEntropyLoss()
        fleet.barrier_worker()
        start = time.perf_counter()
        steps = 0
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for x, y in train.batches(sampler):
                opt.minimize(model, loss_fn, x, y)
                steps += 1
        fleet.barrier_worker()
        seconds = time.perf_counter() - start
        sent = opt.communicator.payload_bytes / steps
        rows.append((label, accuracy(model, test), steps * PER_RANK_BATCH * fleet.worker_num()
                     / seconds, sent, settings))
    if fleet.is_first_worker():
        print_table(rows, args)


def print_table(rows, args):
    plain_accuracy, plain_speed, plain_bytes = rows[0][1:4]
    print(f"digits MLP (64-{HIDDEN}-{HIDDEN}-10 with batch norm), {args.ranks} ranks, "
          f"{args.epochs} epochs, batch {PER_RANK_BATCH} per rank, Momentum lr "
          f"{args.learning_rate} unless noted")
    print()
    print("| strategy | test accuracy | vs data parallel (points) | samples/s | vs data parallel "
          "| bytes sent per step | vs data parallel |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, acc, speed, sent, _ in rows:
        print(f"| {label} | {100 * acc:.2f}% | {100 * (acc - plain_accuracy):+.2f} | "
              f"{speed:,.0f} | {speed / plain_speed:.2f}x | {sent:,.0f} | "
              f"{sent / plain_bytes:.3f}x |")
    print()
    worst = min(rows[1:], key=lambda row: row[1])
    print(f"largest accuracy drop: {worst[0]} {100 * (worst[1] - plain_accuracy):+.2f} points")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--learning-rate", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    env = dict(os.environ, FLEETMPI_DEVICE="cpu", OMP_NUM_THREADS="1")
    from fleetmpi.launch.mpi_command import local_command

    command = local_command(args.ranks, [
        sys.executable, os.path.abspath(__file__), "--worker", "--epochs", str(args.epochs),
        "--learning-rate", str(args.learning_rate), "--seed", str(args.seed),
        "--ranks", str(args.ranks)])
    sys.exit(subprocess.run(command, env=env).returncode)


if __name__ == "__main__":
    main()

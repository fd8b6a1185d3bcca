"""Train a small GPT as a character-level language model on the Python standard library's own
source code, data parallel.

    mpiexec -n 2 python examples/train_gpt.py [--amp] [--recompute] [--gradient-merge K]

The text is every top-level module (``*.py``) of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``), so nothing is downloaded; the files are split into
training and validation by file (every ``--val-every``-th file in name order is held out). The
vocabulary is the bytes that occur at least ``--min-count`` times in the training files, plus
one symbol for every other byte (the few non-ASCII ones).

The model is ``nn.GPT`` (token and position embeddings, pre-norm blocks of causal
self-attention and MLP, tied output embedding), trained with AdamW in Paddle dygraph's idiom
(``loss.backward(); opt.step(); opt.clear_grad()``). Each rank trains on its own random windows
of the training text and gradients are averaged over the ranks every step. An epoch is
``--steps-per-epoch`` steps; after each one rank 0 prints the validation loss next to the
unigram baseline: the cross entropy of the validation text under the training text's byte
frequencies (add-one smoothed), which is what a model that ignores context reaches at best;
on a terminal a progress bar shows the steps in between.
``--amp`` trains in mixed precision, ``--recompute`` recomputes every block in backward,
``--gradient-merge K`` updates once every K steps with the averaged gradients of K batches.
"""
import argparse
import glob
import os
import sys
import sysconfig
import time

import numpy as np

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from fleetmpi import backend, nn, optimizer, progress
from fleetmpi.optimizer import lr


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps-per-epoch", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per rank")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--amp", action="store_true", help="mixed precision (float16 matmuls, "
                        "float32 master weights, dynamic loss scaling)")
    parser.add_argument("--recompute", action="store_true",
                        help="recompute every block in backward instead of keeping its "
                             "activations")
    parser.add_argument("--gradient-merge", type=int, default=1, metavar="K",
                        help="update once every K steps (gradients averaged over them)")
    parser.add_argument("--val-every", type=int, default=10,
                        help="hold out every N-th file for validation")
    parser.add_argument("--min-count", type=int, default=100,
                        help="bytes rarer than this in the training files share one symbol")
    parser.add_argument("--eval-windows", type=int, default=256,
                        help="validation sequences, evenly spread over the validation text")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-val-fraction", type=float, default=None,
                        help="exit with status 1 when the final validation loss is above this "
                             "fraction of the unigram baseline")
    return parser.parse_args(argv)


# -- the text ---------------------------------------------------------------------------------

def source_files():
    """The standard library's top-level modules, in name order."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    if not files:
        raise SystemExit(f"no *.py files in {sysconfig.get_paths()['stdlib']}")
    return files


def read_bytes(paths):
    """The files' bytes one after the other, each ending with a newline, as uint8."""
    chunks = []
    for path in paths:
        with open(path, "rb") as f:
            chunks.append(f.read().rstrip(b"\n") + b"\n")
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


class Corpus:
    """Training and validation token ids (every ``val_every``-th file held out), the
    vocabulary (bytes with at least ``min_count`` training occurrences, then one symbol for
    the rest) and the unigram baseline."""

    def __init__(self, val_every, min_count):
        files = source_files()
        val_files = files[::val_every]
        held_out = set(val_files)
        train_files = [f for f in files if f not in held_out]
        train_bytes, val_bytes = read_bytes(train_files), read_bytes(val_files)
        counts = np.bincount(train_bytes, minlength=256)
        kept = np.flatnonzero(counts >= min_count)
        other = len(kept)
        self.ids_of_byte = np.full(256, other, dtype=np.int64)
        self.ids_of_byte[kept] = np.arange(other)
        self.vocab_size = other + 1
        self.train = self.ids_of_byte[train_bytes]
        self.val = self.ids_of_byte[val_bytes]
        self.files = (len(train_files), len(val_files))
        frequencies = np.bincount(self.train, minlength=self.vocab_size) + 1.0
        log_probs = np.log(frequencies / frequencies.sum())
        self.unigram_loss = float(-log_probs[self.val].mean())


def random_windows(tokens, count, length, rng):
    """``count`` windows of ``length + 1`` consecutive tokens at random places: inputs and
    next-token targets."""
    starts = rng.integers(0, len(tokens) - length - 1, count)
    windows = tokens[starts[:, None] + np.arange(length + 1)]
    return windows[:, :-1], windows[:, 1:]


def spread_windows(tokens, count, length):
    """``count`` windows evenly spread over ``tokens`` (the same on every run)."""
    starts = np.linspace(0, len(tokens) - length - 1, count).astype(np.int64)
    windows = tokens[starts[:, None] + np.arange(length + 1)]
    return windows[:, :-1], windows[:, 1:]


# -- training ---------------------------------------------------------------------------------

def make_strategy(args):
    strategy = fleet.DistributedStrategy()
    strategy.fuse_all_optimizer_ops = True
    if args.amp:
        strategy.amp = True
    if args.recompute:
        strategy.recompute = True
        strategy.recompute_configs = {"checkpoints": [f"blocks.{i}"
                                                      for i in range(args.n_layer)]}
    if args.gradient_merge > 1:
        strategy.gradient_merge = True
        strategy.gradient_merge_configs = {"k_steps": args.gradient_merge, "avg": True}
    return strategy


def evaluate(model, inputs, targets, batch_size):
    """Mean next-token cross entropy over the windows, dropout off."""
    model.eval()
    total = 0.0
    with fleet.no_grad():
        for start in range(0, len(inputs), batch_size):
            x, y = inputs[start:start + batch_size], targets[start:start + batch_size]
            total += F.cross_entropy(model(x), y, reduction="sum").item()
    model.train()
    return total / targets.size


def report(text):
    if fleet.is_first_worker():
        print(text, flush=True)


def main(argv=None):
    args = parse_args(argv)
    fleet.init(is_collective=True)
    backend.manual_seed(args.seed)
    corpus = Corpus(args.val_every, args.min_count)
    report(f"{corpus.files[0]} training files ({len(corpus.train):,} bytes), "
           f"{corpus.files[1]} validation files ({len(corpus.val):,} bytes), vocabulary "
           f"{corpus.vocab_size}; unigram baseline {corpus.unigram_loss:.3f} nats")

    model = fleet.distributed_model(nn.GPT(corpus.vocab_size, args.block_size, args.n_layer,
                                           args.n_head, args.n_embd, args.dropout))
    updates = args.epochs * args.steps_per_epoch // args.gradient_merge
    warmup = min(args.warmup_steps, max(1, updates // 10))
    schedule = lr.LinearWarmup(lr.CosineAnnealingDecay(args.learning_rate,
                                                       T_max=max(1, updates - warmup)),
                               warmup_steps=warmup, start_lr=0.0, end_lr=args.learning_rate)
    opt = fleet.distributed_optimizer(
        optimizer.AdamW(learning_rate=schedule, beta2=0.99, parameters=model.parameters()),
        make_strategy(args))
    rng = np.random.default_rng([args.seed, fleet.worker_index()])
    val_x, val_y = spread_windows(corpus.val, args.eval_windows, args.block_size)

    start = time.perf_counter()
    val_loss = None
    bar = progress.ProgressBar(args.epochs * args.steps_per_epoch, epochs=args.epochs)
    for epoch in range(args.epochs):
        losses = []
        for step in range(args.steps_per_epoch):
            x, y = random_windows(corpus.train, args.batch_size, args.block_size, rng)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.clear_grad()
            losses.append(loss.item())
            bar.step(args.batch_size * fleet.worker_num(), loss=losses[-1])
            if (epoch * args.steps_per_epoch + step + 1) % args.gradient_merge == 0:
                schedule.step()
        val_loss = evaluate(model, val_x, val_y, args.batch_size)
        elapsed = time.perf_counter() - start
        tokens = (epoch + 1) * args.steps_per_epoch * args.batch_size * args.block_size \
            * fleet.worker_num()
        bar.end_epoch(summary=f"epoch {epoch + 1}/{args.epochs}: train loss "
                              f"{np.mean(losses):.3f}, validation loss {val_loss:.3f} (unigram "
                              f"baseline {corpus.unigram_loss:.3f}), {tokens / elapsed:,.0f} "
                              f"tokens/s, {elapsed:.0f} s", file=sys.stdout)
    bar.close()
    report(f"validation loss {val_loss:.3f} nats per byte, "
           f"{100 * (1 - val_loss / corpus.unigram_loss):.0f}% below the unigram baseline, "
           f"after {time.perf_counter() - start:.0f} s on {fleet.worker_num()} rank(s)")
    if args.max_val_fraction is not None and val_loss > args.max_val_fraction \
            * corpus.unigram_loss:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

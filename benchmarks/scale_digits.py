"""Many ranks on one machine: ``examples/train_digits.py`` at 32 ranks (oversubscribed), timed.

    python benchmarks/scale_digits.py [--ranks 32] [--epochs 3] [--record results.md]

Starts one ``mpiexec`` job per rank count with the example's own arguments (per-rank batch
``--batch-size``), and prints, per job, the wall time from start to exit, the time per epoch
and the test accuracy the example reports; ``--record`` appends the same line to a file. On a
machine with fewer cores than ranks every rank gets a share of a core: the numbers say that
the job runs to its end at that scale (agreement, stall inspection, buckets, the sampler), not
how fast 32 cores would be.
"""
import argparse
import os
import re
import socket
import subprocess
import sys
import time

from fleetmpi.launch.mpi_command import local_command

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "train_digits.py")


def run(ranks, epochs, batch_size, timeout):
    cmd = local_command(ranks, [sys.executable, EXAMPLE, "--epochs", str(epochs),
                                "--batch-size", str(batch_size)])
    env = dict(os.environ, FLEETMPI_DEVICE="cpu", FLEETMPI_NUM_THREADS="1")
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - start
    text = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{text[-3000:]}")
    accuracy = re.findall(r"test accuracy[^0-9]*([0-9.]+)", text)
    return seconds, accuracy[-1] if accuracy else "not printed"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[32])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--record", help="file to append each result line to")
    args = parser.parse_args()
    cores = os.cpu_count()
    for ranks in args.ranks:
        seconds, accuracy = run(ranks, args.epochs, args.batch_size, args.timeout)
        line = (f"{time.strftime('%Y-%m-%d %H:%M')} {socket.gethostname()} ({cores} cores): "
                f"train_digits.py at {ranks} ranks, {args.epochs} epochs, batch "
                f"{args.batch_size} per rank: {seconds:.1f} s from start to exit "
                f"({seconds / args.epochs:.1f} s per epoch, start-up included), test accuracy "
                f"{accuracy}")
        print(line, flush=True)
        if args.record:
            with open(args.record, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()

"""The digits example at 1 to 32 ranks on this machine, ranks oversubscribed on its cores.

    python benchmarks/scale.py [--ranks 1 2 8 32] [--epochs 30] [--timeout 600]

Each rank count is one ``mpiexec`` job of ``examples/train_digits.py`` (one BLAS thread per
rank, the same per-rank batch, so the global batch grows with the ranks). Printed per job: the
wall time of the whole job (start-up of every Python process included), the training time the
example reports, its test accuracy, and the job's exit status; a job past ``--timeout`` is
ended and reported as such. This proves the job runs, agrees and finishes at 32 ranks; on a
2-core machine it measures start-up and oversubscription, not scaling.
"""
import argparse
import os
import re
import subprocess
import sys
import time

from fleetmpi.launch.mpi_command import local_command

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                       "train_digits.py")
REPORT = re.compile(r"test accuracy ([0-9.]+) on \d+ images after ([0-9.]+) s on (\d+) rank")


def run_job(ranks, epochs, timeout):
    """``(wall seconds, training seconds, accuracy, status)`` of one job."""
    env = dict(os.environ, OMP_NUM_THREADS="1", FLEETMPI_NUM_THREADS="1")
    cmd = local_command(ranks) + [sys.executable, EXAMPLE, "--epochs", str(epochs)]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return time.perf_counter() - start, None, None, f"timed out after {timeout} s"
    wall = time.perf_counter() - start
    found = REPORT.search(done.stdout)
    if done.returncode != 0 or found is None or int(found.group(3)) != ranks:
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        return wall, None, None, f"exit {done.returncode}: {' | '.join(tail)}"
    return wall, float(found.group(2)), float(found.group(1)), "ok"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 8, 32])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    args = parser.parse_args()
    print(f"examples/train_digits.py, {args.epochs} epochs, batch 32 per rank, "
          f"{os.cpu_count()} cores")
    print("| ranks | job wall time (s) | training (s) | test accuracy | status |")
    print("| ---: | ---: | ---: | ---: | --- |")
    failed = False
    for ranks in args.ranks:
        wall, train, accuracy, status = run_job(ranks, args.epochs, args.timeout)
        failed |= status != "ok"
        shown = [f"{train:.1f}" if train is not None else "-",
                 f"{accuracy:.3f}" if accuracy is not None else "-"]
        print(f"| {ranks} | {wall:.1f} | {shown[0]} | {shown[1]} | {status} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

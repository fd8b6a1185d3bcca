"""The non-finite check's host probe (``fleetmpi.kernels.reference._finite_probe``) against the
other ways of reducing a gradient to one number, alone and beside a thread running matrix
products (as backward's run beside the communicator's thread, which checks the buckets).

    python benchmarks/finite_probe.py [--parameters 1861632] [--calls 200]

``--parameters`` float32 values (the MLP of ``train_throughput.py`` has about 1.86M), with the
BLAS's threads as the library sets them for one rank (``OPENBLAS_NUM_THREADS=1`` or
``FLEETMPI_NUM_THREADS=1`` for one). Printed, in ms over ``--calls`` calls of each: the median
alone (the array rewritten before each call, as backward leaves it), then beside a thread
multiplying 1024x1024 float32 matrices without pause: the median, the 99th percentile and the
worst. The row sums are what the probe computes on the main thread, the dot product what it
computes on any other; a threaded BLAS call beside another thread's is what the worst column
shows.
"""
import argparse
import statistics
import threading
import time

import numpy as np

import fleetmpi as fleet
from fleetmpi.kernels import reference


def ways(grad):
    """``{name: call}``: each way of reducing ``grad`` to a number that an inf or NaN reaches."""
    whole = grad.size - grad.size % reference._ROW
    rows = grad[:whole].reshape(-1, reference._ROW)
    ones = np.ones(reference._ROW, grad.dtype)
    return {"row sums (BLAS matrix-vector)": lambda: (rows @ ones).sum() + grad[whole:].sum(),
            "dot product with itself (BLAS)": lambda: np.dot(grad, grad),
            "sum (NumPy)": lambda: grad.sum(),
            "elementwise test (NumPy)": lambda: np.isfinite(grad).all()}


def timed(call, grad, calls):
    spent = []
    for _ in range(calls):
        np.multiply(grad, 1.0, out=grad)
        start = time.perf_counter()
        call()
        spent.append(time.perf_counter() - start)
    return sorted(spent)


def beside_products(call, grad, calls):
    """``timed`` while another thread multiplies matrices until it is done."""
    a = np.ones((1024, 1024), np.float32)
    done = threading.Event()

    def products():
        while not done.is_set():
            a @ a
    thread = threading.Thread(target=products)
    thread.start()
    time.sleep(0.05)
    try:
        return timed(call, grad, calls)
    finally:
        done.set()
        thread.join()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parameters", type=int, default=1861632)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    if args.parameters < 1 or args.calls < 100:
        parser.error(f"--parameters must be at least 1 and --calls at least 100, got "
                     f"{args.parameters} and {args.calls}")
    fleet.init(is_collective=True)  # the BLAS threads the library sets
    grad = np.random.default_rng(0).standard_normal(args.parameters).astype(np.float32)
    print(f"{args.parameters:,} float32 values, {args.calls} calls each, ms")
    print(f"{'':34s} {'alone':>8s} | beside products: {'median':>8s} {'p99':>8s} {'worst':>8s}")
    for name, call in ways(grad).items():
        alone = statistics.median(timed(call, grad, args.calls))
        beside = beside_products(call, grad, args.calls)
        p99 = beside[int(0.99 * (len(beside) - 1))]
        print(f"{name:34s} {alone * 1e3:8.3f} | {'':16s} {statistics.median(beside) * 1e3:8.3f} "
              f"{p99 * 1e3:8.3f} {beside[-1] * 1e3:8.3f}")


if __name__ == "__main__":
    main()

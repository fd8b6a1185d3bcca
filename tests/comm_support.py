"""Shared pieces of the communication-layer tests: the world communicators and global data.

Every rank builds its inputs from a seed that names the rank, so each rank can also build every
other rank's inputs and compute the single-process result itself.
"""
import contextlib

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.comm import Communicator, get_communicator

_small_chunks = None


def world():
    """The world communicator of ``fleetmpi.comm.get_communicator()``."""
    fleet.init()
    return get_communicator()


def small_chunks():
    """A world communicator moving 96-byte chunks, so rings and chains run several per step."""
    global _small_chunks
    if _small_chunks is None:
        fleet.init()
        _small_chunks = Communicator(fleet.world.topology(), chunk_bytes=96)
    return _small_chunks


def rank_data(rank, n, dtype, case=0, scale=10.0):
    """Rank ``rank``'s input for test case ``case``: ``n`` values of ``dtype``."""
    rng = np.random.default_rng([rank, n, case, np.dtype(dtype).num])
    values = rng.standard_normal(n) * scale
    if np.dtype(dtype).kind == "i":
        return np.round(values).astype(dtype)
    return values.astype(dtype)


def all_data(size, n, dtype, case=0, scale=10.0):
    """Every rank's input, stacked: shape ``(size, n)``."""
    return np.stack([rank_data(r, n, dtype, case, scale) for r in range(size)])


def single_process(stack, op):
    """What one process computes for ``op`` over the stacked inputs (floats in float64)."""
    wide = stack.astype(np.float64) if stack.dtype.kind == "f" else stack
    if op == "sum":
        return wide.sum(axis=0)
    if op == "mean":
        if stack.dtype.kind == "f":
            return wide.mean(axis=0)
        return wide.sum(axis=0) // len(stack)
    return wide.max(axis=0) if op == "max" else wide.min(axis=0)


def tolerance(dtype, size):
    """(rtol, atol) for comparing a reduction of ``size`` ranks' values of scale 10."""
    eps = {np.float16: 2.0 ** -11, np.float32: 2.0 ** -24, np.float64: 2.0 ** -53}
    u = eps.get(np.dtype(dtype).type, 0.0)
    return 4 * size * u, 40 * size * u


# Checks that fail on every rank at once. A check that failed on one rank only would send that
# rank to the next test while the others go on calling collectives, and the job would hang;
# these helpers share every verdict over MPI.COMM_WORLD so all ranks fail at the same line.

def _verdict(error):
    from mpi4py import MPI

    flags = np.empty(MPI.COMM_WORLD.Get_size(), dtype=np.int32)
    MPI.COMM_WORLD.Allgather(np.array([error is not None], dtype=np.int32), flags)
    if error is not None:
        raise error
    failed = np.flatnonzero(flags)
    if failed.size:
        raise AssertionError(f"rank(s) {', '.join(map(str, failed))} failed this check")


def _shared(check):
    def run(*args, **kwargs):
        error = None
        try:
            check(*args, **kwargs)
        except AssertionError as exc:
            error = exc
        _verdict(error)
    return run


def host(value):
    """``value`` on the host: a Tensor's or a CuPy array's data as a NumPy array; anything else
    (NumPy arrays, scalars, lists) as it is."""
    if hasattr(value, "numpy"):
        return value.numpy()
    if hasattr(value, "get") and not isinstance(value, (np.ndarray, dict)):
        return value.get()
    return value


def _on_host(check):
    def run(actual, desired, *args, **kwargs):
        check(host(actual), host(desired), *args, **kwargs)
    return run


equal = _shared(_on_host(np.testing.assert_array_equal))
close = _shared(_on_host(np.testing.assert_allclose))


@_shared
def ok(condition, message=""):
    assert condition, message


@contextlib.contextmanager
def raises(exception, match=None):
    """``pytest.raises`` whose outcome every rank learns."""
    error = None
    try:
        with pytest.raises(exception, match=match):
            yield
    except BaseException as exc:  # pytest's "DID NOT RAISE" is not an Exception
        error = exc
    _verdict(error)

"""Timing of training steps, every rank lined up: the timed loop, a probe of one step's host
and device time, and how many steps fit before a deadline (so that a slow model still gives
its row within its time)."""
import time


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def timed(step, warmup, steps, synchronize):
    """Seconds for ``steps`` steps after ``warmup`` unmeasured ones, all ranks lined up, the
    device's queued work finished (``synchronize``) before each clock reading."""
    comm = world()
    for i in range(warmup):
        step(i)
    synchronize()
    comm.Barrier()
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    synchronize()
    comm.Barrier()
    return time.perf_counter() - start


def probe(step, index, synchronize):
    """``(host seconds, step seconds)`` of ``step(index)`` started on an idle device: until the
    call returns (its work queued; on the CPU, all of it) and until the device is done."""
    synchronize()
    start = time.perf_counter()
    step(index)
    returned = time.perf_counter()
    synchronize()
    return returned - start, time.perf_counter() - start


def steps_that_fit(step_s, seconds_left, wanted):
    """How many of ``wanted`` steps of ``step_s`` seconds fit in ``seconds_left``: at least
    one."""
    if step_s <= 0:
        return wanted
    return max(1, min(wanted, int(seconds_left // step_s)))


def agreed_steps(step_s, seconds_left, wanted):
    """``steps_that_fit``, the fewest over the ranks, so that all of them time the same
    loop."""
    from mpi4py import MPI

    return world().allreduce(steps_that_fit(step_s, seconds_left, wanted), op=MPI.MIN)


def measure(step, synchronize, memory, deadline, warmup, wanted):
    """Train ``warmup`` steps, probe one, time as many of ``wanted`` steps as fit before
    ``deadline`` (``time.time()``), one step later inside the ``memory`` window; returns the
    timed seconds and steps, the probe's host time in ms and the window's peak bytes."""
    for i in range(warmup):
        step(i)
    host_s, step_s = probe(step, warmup, synchronize)
    # room for the memory window's step and one more (the caller's kernel count)
    steps = agreed_steps(step_s, deadline - time.time() - 2 * step_s, wanted)
    seconds = timed(lambda i: step(warmup + 1 + i), 0, steps, synchronize)
    with memory:
        step(warmup + 1 + steps)
        synchronize()
    return {"seconds": seconds, "steps": steps, "host_ms": host_s * 1e3,
            "peak_bytes": memory.peak}

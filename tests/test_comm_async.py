"""Asynchronous collectives: handles complete, in the order they were started, with the
results of the blocking calls; errors reach every rank's ``wait()``; on a device the operation
is ordered by events on its own stream, never by the host (checked with a stand-in CuPy)."""
import sys
import threading
import types

import numpy as np
import pytest

from comm_support import (all_data, close, equal, ok, rank_data, raises, single_process,
                          small_chunks, tolerance, world)
import fleetmpi as fleet
from fleetmpi.comm import CollectiveMismatchError, Communicator


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", [None, "ring", "native", "hierarchical"])
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_allreduce_async_equals_the_blocking_call(op, algorithm):
    comm = world()
    x = rank_data(comm.rank, 1001, np.float32, case=3)
    handles = [comm.allreduce_async(x, op=op, algorithm=algorithm) for _ in range(3)]
    blocking = comm.allreduce(x, op=op, algorithm=algorithm)
    for handle in handles:
        ok(handle.test(), "a blocking call returned before the operations started before it")
        equal(handle.wait(), blocking)
    rtol, atol = tolerance(np.float32, comm.size)
    close(blocking, single_process(all_data(comm.size, 1001, np.float32, case=3), op),
          rtol=rtol, atol=atol)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("chunked", [False, True])
def test_allreduce_many_async_reduces_in_place_like_the_blocking_call(chunked):
    comm = small_chunks() if chunked else world()
    shapes = [(7, 3), (0,), (129,), (2, 2, 2)]
    mine = [rank_data(comm.rank, int(np.prod(s)), np.float64, case=i).reshape(s)
            for i, s in enumerate(shapes)]
    started = [a.copy() for a in mine]
    blocking = [a.copy() for a in mine]
    handle = comm.allreduce_many_async(started, op="mean", fuse_grad_size_in_MB=1e-3)
    comm.allreduce_many(blocking, op="mean", fuse_grad_size_in_MB=1e-3)
    ok(handle.wait() is None)
    for a, b in zip(started, blocking):
        equal(a, b)


@pytest.mark.mpi(min_size=2)
def test_handles_complete_in_the_order_they_were_started():
    comm = world()
    xs = [np.full(1 << 14, comm.rank + i, np.float64) for i in range(6)]
    handles = [comm.allreduce_async(x, algorithm="ring") for x in xs]
    last = handles[-1].wait()
    ok(all(h.test() for h in handles), "a later operation finished before an earlier one")
    ok(comm.pending() == 0, f"{comm.pending()} operations still pending")
    total = sum(range(comm.size))
    for i, handle in enumerate(handles):
        equal(handle.wait(), np.full(1 << 14, total + comm.size * i, np.float64))
    equal(last, handles[-1].wait())


@pytest.mark.mpi(min_size=2)
def test_a_mismatch_raises_from_wait_on_every_rank_and_later_operations_still_run():
    fleet.init()
    comm = Communicator(fleet.world.topology())  # no call agreed before: each one is new
    bad = comm.allreduce_async(np.ones(3 + comm.rank))
    good = comm.allreduce_async(np.ones(5))
    with raises(CollectiveMismatchError, match=r"rank 0: float64 \(3,\), rank 1: float64 \(4,\)"):
        bad.wait()
    equal(good.wait(), np.full(5, float(comm.size)))
    rejected = comm.allreduce_async(np.ones(2), op="median" if comm.rank == 0 else "sum")
    with raises(ValueError, match="median|rejected their arguments"):
        rejected.wait()
    equal(comm.allreduce(np.ones(2)), np.full(2, float(comm.size)))


def test_a_world_of_one_runs_asynchronous_collectives():
    comm = world()
    if comm.size != 1:
        pytest.skip("single-process test")
    x = np.arange(6.0)
    equal(comm.allreduce_async(x, op="mean").wait(), x)
    arrays = [np.ones(3), np.arange(4.0)]
    comm.allreduce_many_async(arrays).wait()
    equal(arrays[1], np.arange(4.0))


class _Log(list):
    def add(self, *entry):
        self.append(entry)


def fake_cupy(log):
    """A stand-in for the parts of CuPy that ``Communicator.submit`` and ``Handle.wait`` use:
    streams and events that write what is asked of them to ``log``, current per thread."""
    local = threading.local()

    class Event:
        def __init__(self, stream):
            self.stream = stream

        def synchronize(self):
            log.add("host waits", self.stream.name)

    class Stream:
        count = 0

        def __init__(self, non_blocking=False, name=None):
            Stream.count += 1
            self.name = name or f"stream {Stream.count}"

        def record(self):
            log.add("record", self.name)
            return Event(self)

        def wait_event(self, event):
            log.add("wait", self.name, event.stream.name)

        def synchronize(self):
            log.add("host waits", self.name)

        def __enter__(self):
            self.outer = getattr(local, "stream", caller)
            local.stream = self

        def __exit__(self, *exc):
            local.stream = self.outer

    caller = Stream(name="caller")

    class Device:
        def __enter__(self):
            log.add("device", threading.current_thread().name)

        def __exit__(self, *exc):
            pass

    cuda = types.SimpleNamespace(Stream=Stream, Device=Device,
                                 get_current_stream=lambda: getattr(local, "stream", caller))
    module = types.ModuleType("cupy")
    module.cuda = cuda
    return module


@pytest.mark.parametrize("reads", ["a device array", "nothing, over a device transport"])
def test_a_device_operation_is_ordered_by_events_on_its_own_stream(reads, monkeypatch):
    """What the NCCL path does (it cannot run without a GPU): the operation's stream waits on
    an event of the caller's stream recorded at the start, the work runs with that stream
    current on the communicator's thread, and ``wait()`` makes the caller's stream wait on the
    event recorded after it; the host never waits for the device. An operation that reads no
    array (a barrier) takes that path when the transport moves device arrays."""
    log = _Log()
    cupy = fake_cupy(log)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    fleet.init()
    comm = Communicator(fleet.world.topology())  # its stream will be a stand-in's
    if reads == "a device array":
        arrays = [type("ndarray", (), {"__module__": "cupy._core.core"})()]
    else:
        arrays = []
        monkeypatch.setattr(comm.transports[0], "device", True)

    def call():
        log.add("work on", cupy.cuda.get_current_stream().name,
                threading.current_thread() is not threading.main_thread())
        return "done"
    handle = comm.submit("allreduce", call, *arrays)
    assert handle.wait() == "done"
    async_stream = [e[1] for e in log if e[0] == "work on"][0]
    assert async_stream != "caller"
    assert log == [("record", "caller"), ("device", log[1][1]), ("wait", async_stream, "caller"),
                   ("work on", async_stream, True), ("record", async_stream),
                   ("wait", "caller", async_stream)], log
    assert log[1][1] != threading.current_thread().name
    del log[:]
    comm.submit("allreduce", call, *arrays).wait()
    assert [e for e in log if e[0] == "work on"] == [("work on", async_stream, True)], \
        "the communicator's stream is made once and reused"
    comm.free()


@pytest.mark.mpi(min_size=2)
def test_every_collective_has_an_asynchronous_form_with_the_blocking_result():
    """Uneven first dimensions (an empty part on rank 1) and all six forms started before
    any is waited on: each result equals the blocking call's, on every rank."""
    comm = world()
    rows = [2, 0, 3, 1][comm.rank % 4]
    x = rank_data(comm.rank, rows * 3, np.float64, case=7).reshape(rows, 3)
    block = rank_data(comm.rank, comm.size * 2 + 1, np.float64, case=8)
    splits = [(comm.rank + r) % 2 for r in range(comm.size)]
    parts = np.arange(sum(splits) * 2.0).reshape(-1, 2) + comm.rank
    calls = {  # name: (arguments, keyword arguments)
        "broadcast": ((block,), {"root": comm.size - 1}),
        "allgather": ((x,), {}),
        "allgatherv": ((x.reshape(-1),), {"counts": [[2, 0, 3, 1][r % 4] * 3
                                                     for r in range(comm.size)]}),
        "reduce_scatter": ((block,), {"op": "max"}),
        "alltoall": ((parts,), {"splits": splits}),
        "barrier": ((), {}),
    }
    handles = {name: getattr(comm, f"{name}_async")(*args, **kwargs)
               for name, (args, kwargs) in calls.items()}
    blocking = {name: getattr(comm, name)(*args, **kwargs)
                for name, (args, kwargs) in calls.items()}
    for name, handle in handles.items():
        got, want = handle.wait(), blocking[name]
        if name == "alltoall":
            equal(got[0], want[0])
            ok(got[1] == want[1], f"alltoall splits {got[1]} != {want[1]}")
        elif name == "barrier":
            ok(got is None and want is None, "barrier returned a value")
        else:
            equal(got, want)
    everyone = [rank_data(r, [2, 0, 3, 1][r % 4] * 3, np.float64, case=7).reshape(-1, 3)
                for r in range(comm.size)]
    equal(handles["allgather"].wait(), np.concatenate(everyone))
    equal(handles["allgatherv"].wait(), np.concatenate(everyone).reshape(-1))

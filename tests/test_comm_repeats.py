"""A repeated ``allreduce`` (the same arguments right after the same call as before) skips the
argument checks and the exchange: it must still compute what the checked call computes, and
any argument the checks would refuse must still take the checked path and be refused."""
import gc
import weakref

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.comm import Communicator, registry, stall

from comm_support import all_data, close, ok, raises, single_process, tolerance

ALGORITHMS = [None, "ring", "native", "hierarchical", "shm"]


def fresh(**kwargs):
    fleet.init()
    return Communicator(fleet.world.topology(), **kwargs)


def arguments(form, data):
    """``(x, out)`` as a caller passes them: ``out`` none, ``x`` itself, a separate array,
    another part of the array ``x`` is a view of, or a view that overlaps ``x``."""
    if form in ("new", "in place", "separate"):
        x = data.copy()
        return x, {"new": None, "in place": x, "separate": np.empty_like(x)}[form]
    buf = np.empty(2 * data.size if form == "same base" else data.size + data.size // 2)
    buf[:data.size] = data.reshape(-1)
    return (buf[:data.size].reshape(data.shape),
            buf[buf.size - data.size:].reshape(data.shape))


FORMS = ("new", "in place", "separate", "same base", "overlapping")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
@pytest.mark.parametrize("check", [True, False])
def test_repeated_calls_equal_one_process_for_every_algorithm_op_and_output(algorithm, op,
                                                                            check):
    comm = fresh(check=check)
    if algorithm == "shm" and registry.lookup("allreduce", "shm").refusal(comm.context):
        pytest.skip("shm needs one node")  # the same on every rank
    everyone = all_data(comm.size, 24, np.float64, case=3)
    want = single_process(everyone, op)
    rtol, atol = tolerance(np.float64, comm.size)
    mine = everyone[comm.rank].reshape(4, 6)
    for form in FORMS:
        for _ in range(3):  # the first call is checked, the next two repeat it
            x, out = arguments(form, mine)
            got = comm.allreduce(x, op=op, algorithm=algorithm, out=out)
            ok(out is None or got is out, f"{form}: the result is not out")
            close(got, want.reshape(4, 6), rtol=rtol, atol=atol)
            if form in ("separate", "same base"):
                close(x, mine, rtol=0, atol=0)


@pytest.mark.mpi(min_size=2)
def test_repeated_calls_make_no_exchange_and_move_the_payload():
    comm = fresh()
    exchanges = stall.call_state(comm._control)
    x, out = np.ones(8), np.empty(8)
    for _ in range(2):  # the first call, then the first one to follow itself
        comm.allreduce(x, out=out)
    before, payload = exchanges.calls, comm.payload_bytes
    for _ in range(5):
        comm.allreduce(x, out=out)
    ok(exchanges.calls == before, f"{exchanges.calls - before} exchanges for repeated calls")
    ok(comm.payload_bytes - payload == 5 * x.nbytes, "payload_bytes missed repeated calls")


@pytest.mark.mpi(min_size=2)
def test_arguments_the_checks_refuse_are_refused_after_repeats():
    comm = fresh()
    x = np.ones(12)
    for _ in range(3):
        comm.allreduce(x, out=np.empty(12))
    read_only = np.empty(12)
    read_only.flags.writeable = False
    for bad, match in ((np.empty((3, 4)), "out must be a C-contiguous float64 array of shape"),
                       (np.empty(24)[::2], "strided"),
                       (np.empty(12, np.float32), "out must be a C-contiguous float64"),
                       (read_only, "out is read-only")):
        with raises(ValueError, match=match):
            comm.allreduce(x, out=bad)
    with raises(ValueError, match="op='prod' is not a reduction"):
        comm.allreduce(x, op="prod", out=np.empty(12))
    with raises(TypeError, match="must be a NumPy or CuPy array, not list"):
        comm.allreduce([1.0] * 12, out=np.empty(12))
    for _ in range(2):
        strided = np.ones(24)[::2]
        close(comm.allreduce(strided, out=np.empty(12)), np.full(12, float(comm.size)),
              rtol=0, atol=0)


@pytest.mark.mpi(min_size=2)
def test_repeats_of_one_ring_layout_share_its_scratch_buffers():
    """The same layout repeated after different calls is one ``RingAllreduce`` (its scratch
    buffers are up to a chunk each), not one per place in the loop."""
    comm = fresh()
    x, y = np.ones(4096), np.ones(3)
    for _ in range(3):
        for before in ("sum", "max"):
            comm.allreduce(y, op=before)
            close(comm.allreduce(x, algorithm="ring", out=np.empty(4096)),
                  np.full(4096, float(comm.size)), rtol=0, atol=0)
    rings = [key for key in comm.context._resources if key[0] == "ring"]
    ok(len(rings) == 1, f"{len(rings)} ring layouts for one")


def reuse(comm, x, out, calls=3):
    """``calls`` reductions of the same ``x`` into the same ``out``: after the first two, the
    repeat is found by the arrays themselves."""
    for _ in range(calls):
        comm.allreduce(x, out=out)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("in_place", [False, True], ids=["separate", "in place"])
def test_reused_arrays_changed_in_place_are_checked_again(in_place):
    """An array whose dtype or writability was set in place is a new call, however cheap the
    lookup by the arrays themselves is; its size cannot be set in place (NumPy refuses to
    resize an array with a weak reference, and the lookup holds one)."""
    comm = fresh()
    x = np.arange(12.0) + comm.rank
    out = x if in_place else np.empty(12)
    reuse(comm, x, out)
    x[:] = np.arange(12.0) + comm.rank
    x.dtype = np.int64  # the same bytes seen as integers, on every rank
    if not in_place:
        out.dtype = np.int64
    ints = [(np.arange(12.0) + r).view(np.int64) for r in range(comm.size)]
    got = comm.allreduce(x, out=out)
    close(got, np.sum(ints, axis=0), rtol=0, atol=0)
    x.dtype = np.float64
    if not in_place:
        out.dtype = np.float64
    x[:] = np.arange(12.0) + comm.rank
    reuse(comm, x, out)
    with raises(ValueError, match="cannot resize"):  # so a reused array keeps its size
        x.resize(16, refcheck=False)
    out.flags.writeable = False
    with raises(ValueError, match="is read-only"):
        comm.allreduce(x, out=out)


@pytest.mark.mpi(min_size=2)
def test_the_lookup_by_the_arrays_keeps_no_array_alive():
    """The arrays of the last repeat are held weakly: once the caller drops them, they are
    freed, however large they are."""
    comm = fresh()
    x, out = np.ones(1 << 16), np.empty(1 << 16)
    reuse(comm, x, out)
    probes = [weakref.ref(x), weakref.ref(out)]
    del x, out
    gc.collect()
    ok(all(probe() is None for probe in probes), "the repeated path keeps x or out alive")


@pytest.mark.mpi(min_size=2)
def test_arrays_in_the_place_of_freed_ones_are_not_taken_for_them():
    """New arrays (which may reuse the freed ones' memory and ids) of another dtype after
    repeats: checked, and reduced as what they are."""
    comm = fresh()
    for dtype in (np.float64, np.int32, np.float32, np.float64):
        x = np.full(6, comm.rank + 1, dtype)
        out = np.empty(6, dtype)
        for _ in range(3):
            got = comm.allreduce(x, out=out)
            ok(got.dtype == dtype, f"{got.dtype} for {np.dtype(dtype)}")
            close(got, np.full(6, comm.size * (comm.size + 1) // 2), rtol=0, atol=0)
        del x, out
    with raises(TypeError, match="must be a NumPy or CuPy array, not NoneType"):
        comm.allreduce(None, out=np.empty(6))


@pytest.mark.mpi(min_size=2)
def test_repeats_of_fresh_arrays_make_no_exchange():
    """The lookup by key (new arrays on every call) skips the exchange as the lookup by the
    arrays themselves does."""
    comm = fresh()
    exchanges = stall.call_state(comm._control)
    for _ in range(2):
        comm.allreduce(np.ones(8), out=np.empty(8))
    before = exchanges.calls
    for _ in range(5):
        close(comm.allreduce(np.ones(8), out=np.empty(8)), np.full(8, float(comm.size)),
              rtol=0, atol=0)
    ok(exchanges.calls == before, f"{exchanges.calls - before} exchanges for repeated calls")

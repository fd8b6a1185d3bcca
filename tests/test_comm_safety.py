"""Mismatched or bad arguments raise on every rank; odd inputs (empty, strided) work; NCCL's error path."""
import subprocess
import sys

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.comm import CollectiveMismatchError, Communicator, NCCLUnavailableError, stall
from fleetmpi.comm.communicator import check_mode
from fleetmpi.comm.transport_nccl import _probe

from comm_support import close, equal, ok, raises, rank_data, world


def unused():
    """A communicator that has agreed on no call yet: by default a call whose arguments have
    been agreed before makes no exchange, so a mismatch is raised on every rank at a call that
    is new to every rank (``test_per_signature_check`` covers the rest)."""
    fleet.init()
    return Communicator(fleet.world.topology())


def still_works(comm):
    """The communicator is usable after an error: a full allreduce gives the right answer."""
    got = comm.allreduce(np.full(3, comm.rank + 1.0), algorithm="ring")
    equal(got, np.full(3, comm.size * (comm.size + 1) / 2))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["ring", "native"])
def test_shape_and_dtype_mismatch_raise_on_every_rank(algorithm):
    comm = unused()
    n = 5 if comm.rank == 0 else 6
    with raises(CollectiveMismatchError, match=r"count differs \(rank 0: 5, rank 1: 6"):
        comm.allreduce(np.ones(n), algorithm=algorithm)
    dtype = np.float32 if comm.rank == 0 else np.float64
    with raises(CollectiveMismatchError, match="dtype differs.*rank 0: float32.*float64"):
        comm.allreduce(np.ones(4, dtype), algorithm=algorithm)
    shape = (2, 3) if comm.rank == 0 else (3, 2)
    with raises(CollectiveMismatchError, match=r"shapes differ \(rank 0: float64 \(2, 3\), "
                                               r"rank 1: float64 \(3, 2\)"):
        comm.allreduce(np.ones(shape), algorithm=algorithm)
    dtype = np.int32 if comm.rank == 0 else np.float32
    with raises(CollectiveMismatchError, match=r"dtype differs \(rank 0: int32, rank 1: "
                                               r"float32.*shapes differ \(rank 0: int32 \(4,\), "
                                               r"rank 1: float32 \(4,\)"):
        comm.allreduce(np.ones(4, dtype), algorithm=algorithm)
    still_works(comm)


@pytest.mark.mpi(min_size=2)
def test_op_root_algorithm_and_collective_mismatch_raise_on_every_rank():
    comm = unused()
    first = comm.rank == 0
    with raises(CollectiveMismatchError, match="op differs.*'sum'.*'max'"):
        comm.allreduce(np.ones(3), op="sum" if first else "max")
    with raises(CollectiveMismatchError, match="root differs"):
        comm.broadcast(np.ones(3), root=0 if first else 1)
    with raises(CollectiveMismatchError, match="algorithm differs"):
        comm.allreduce(np.ones(3), algorithm="ring" if first else "native")
    with raises(CollectiveMismatchError, match=r"the ranks reached different collectives: "
                                               r"rank 0: broadcast of float64 \(3,\), call #4 "
                                               r"\(at test_comm_safety.py:\d+ in test_op_.*; "
                                               r"rank 1: allreduce of float64 \(3,\), call #4 "
                                               r"\(at "):
        if first:
            comm.broadcast(np.ones(3))
        else:
            comm.allreduce(np.ones(3))
    with raises(CollectiveMismatchError, match="arrays differs"):
        comm.allreduce_many([np.ones(3)] * (1 if first else 2))
    still_works(comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("collective", ["allgather", "gather"])
def test_a_mismatch_after_repeated_calls_is_named_like_a_first_call_mismatch(collective):
    """Three calls, the last rank's third with another dtype (allgather) or another second
    dimension (gather): the repeats skip the agreement, so the other ranks meet the last
    rank's agreement in the call's exchange of first dimensions. Every rank raises, naming
    the collective, the call number, and each rank's arguments and line."""
    comm = unused()
    last = comm.rank == comm.size - 1
    for call in range(1, 4):
        x = np.ones((2, 3))
        if call == 3 and last:
            x = x.astype(np.float32) if collective == "allgather" else np.ones((2, 4))
        if call < 3:
            getattr(comm, collective)(x)
            continue
        error, line = None, sys._getframe().f_lineno + 2
        try:
            getattr(comm, collective)(x)
        except CollectiveMismatchError as exc:
            error = exc
    message = str(error)
    ok(message.startswith(f"{collective} call #3 called with different arguments across "
                          f"ranks: "), message)
    for r in range(comm.size):
        shape = ("float32 (2, 3)" if collective == "allgather" else "float64 (2, 4)") \
            if r == comm.size - 1 else "float64 (2, 3)"
        ok(f"rank {r}: {collective} of {shape}, call #3 (at test_comm_safety.py:{line} in "
           f"test_a_mismatch_after" in message, message)
    still_works(comm)


@pytest.mark.mpi(min_size=2)
def test_per_signature_check_exchanges_once_and_tells_of_diverged_ranks_at_the_next_new_call():
    comm = unused()
    exchanges = stall.call_state(comm._control)
    x = np.ones(3)
    ops = ["sum", "sum", "max", "max", "sum"]  # every pair of consecutive ops, ending in sum
    for op in ops:
        comm.allreduce(x, op=op)
    before = exchanges.calls
    for op in ops * 2:
        equal(comm.allreduce(x, op=op), np.full(3, float(comm.size if op == "sum" else 1)))
    ok(exchanges.calls == before, f"{exchanges.calls - before} exchanges for repeated calls")
    comm.allreduce(x, op="max" if comm.rank == 0 else "sum")  # both seen in this place
    ok(exchanges.calls == before, "a call seen before in this place was exchanged")
    with raises(CollectiveMismatchError, match="history differs.*called different collectives "
                                               "since the last call"):
        comm.allreduce(np.ones(4))
    comm.allreduce(np.ones(4))
    ok(exchanges.calls == before + 2, "the new call after the mismatch was not exchanged")
    still_works(comm)


@pytest.mark.mpi(min_size=2)
def test_check_always_exchanges_at_every_call(monkeypatch):
    monkeypatch.setenv("FLEETMPI_CHECK_COLLECTIVES", "always")
    comm = unused()
    ok(comm.check == "always")
    x = np.ones(3)
    comm.allreduce(x)
    comm.allreduce(x, op="max")
    with raises(CollectiveMismatchError, match="op differs.*'max'.*'sum'"):
        comm.allreduce(x, op="max" if comm.rank == 0 else "sum")
    still_works(comm)


@pytest.mark.parametrize("text, mode", [("", True), ("1", True), ("0", False),
                                        ("always", "always")])
def test_check_knob(text, mode):
    assert check_mode(None, {"FLEETMPI_CHECK_COLLECTIVES": text}) == mode
    assert check_mode(mode, {"FLEETMPI_CHECK_COLLECTIVES": "bogus"}) == mode


@pytest.mark.parametrize("text", ["2", "yes", "ALWAYS"])
def test_bad_check_knob_is_named(text):
    with pytest.raises(ValueError, match=f"FLEETMPI_CHECK_COLLECTIVES={text!r} must be 0"):
        check_mode(None, {"FLEETMPI_CHECK_COLLECTIVES": text})
    with pytest.raises(ValueError, match="check='sometimes' must be False, True or 'always'"):
        check_mode("sometimes")


@pytest.mark.mpi(min_size=2)
def test_bad_argument_on_one_rank_raises_everywhere():
    comm = unused()
    first = comm.rank == 0
    if first:
        with raises(ValueError, match="op='prod' is not a reduction.*sum, mean, max, min"):
            comm.allreduce(np.ones(3), op="prod")
        with raises(ValueError, match=r"root=99 must be a rank in 0\.\."):
            comm.broadcast_many([np.ones(3)], root=99)
        with raises(TypeError, match="dtype int8 cannot be reduced"):
            comm.allreduce_many([np.ones(3, np.int8)])
    else:
        for call in (lambda: comm.allreduce(np.ones(3)),
                     lambda: comm.broadcast_many([np.ones(3)]),
                     lambda: comm.allreduce_many([np.ones(3, np.int32)])):
            with raises(CollectiveMismatchError, match=r"rank\(s\) 0 rejected"):
                call()
    still_works(comm)


@pytest.mark.mpi(min_size=2)
def test_recv_of_a_different_dtype_or_shape_is_named_and_drained():
    comm = world()
    message, received = "", np.arange(4.0)
    if comm.rank == 0:
        comm.send(np.arange(3, dtype=np.float32), 1)
        comm.send(np.arange(4, dtype=np.float64), 1)
    elif comm.rank == 1:
        try:
            comm.recv(np.empty(3), 0)
        except ValueError as exc:
            message = str(exc)
        received = comm.recv(np.empty(4), 0)
    ok(comm.rank != 1 or message == "recv from rank 0: expected a float64 array of shape (3,), "
                                     "but rank 0 sent float32 of shape (3,)", message)
    equal(received, np.arange(4.0))
    still_works(comm)


@pytest.mark.mpi
def test_strided_and_empty_inputs():
    comm = world()
    base = rank_data(comm.rank, 60, np.float64).reshape(6, 10)
    everyone = [rank_data(r, 60, np.float64).reshape(6, 10) for r in range(comm.size)]
    for view, pick in ((base[:, ::3], lambda a: a[:, ::3]), (base.T, lambda a: a.T)):
        want = np.sum([pick(a) for a in everyone], axis=0)
        for algorithm in ("ring", "hierarchical", "native"):
            close(comm.allreduce(view, algorithm=algorithm), want,
                                       rtol=1e-13)
        equal(comm.broadcast(view, root=0), pick(everyone[0]))
    strided = [base[:, 1], base[2:4, ::2]]
    comm.allreduce_many(strided, op="max")
    equal(strided[0], np.max([a[:, 1] for a in everyone], axis=0))
    empty = np.empty((0, 3), np.float32)
    ok(comm.allreduce(empty).shape == (0, 3))
    ok(comm.allgather(empty, stack=True).shape == (comm.size, 0, 3))
    ok(comm.allgather(empty).shape == (0, 3))
    ok(comm.reduce_scatter(empty).shape == (0, 3))
    comm.allreduce_many([empty, np.empty(0)])


@pytest.mark.mpi
def test_nccl_transport_where_nccl_cannot_run_raises_a_clear_error_on_every_rank():
    """Without CuPy, or with CuPy (the ``gpu`` extra) but no device, or a CPU-forced run:
    each rank's reason is named; where NCCL can run here, the test has nothing to check."""
    fleet.init()
    if _probe() is None:
        pytest.skip("NCCL can run here")
    with raises(NCCLUnavailableError, match="rank 0: (CuPy with NCCL is not importable|no "
                                            "usable CUDA device|no CUDA device is visible|this "
                                            "CuPy build has no NCCL).*transport='mpi'"):
        Communicator(fleet.world.topology(), transport="nccl")
    still_works(world())


def test_importing_fleetmpi_needs_no_cupy():
    code = ("import sys, fleetmpi, fleetmpi.comm, fleetmpi.comm.transport_nccl; "
            "assert 'cupy' not in sys.modules, 'cupy was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bad_constructor_arguments_name_the_value():
    fleet.init()
    topology = fleet.world.topology()
    with raises(ValueError, match="transport='gloo' is not known; allowed: auto, mpi, nccl"):
        Communicator(topology, transport="gloo")
    with raises(ValueError, match="nccl_comm_num=0 must be a positive integer"):
        Communicator(topology, nccl_comm_num=0)
    with raises(ValueError, match="fuse_grad_size_in_MB=-1 must be a positive number"):
        Communicator(topology, fuse_grad_size_in_MB=-1)


def test_world_of_one_runs_every_collective():
    comm = world()
    ok(comm.size == 1 and comm.rank == 0)
    x = rank_data(0, 11, np.float32).reshape(1, 11)
    for algorithm in ("ring", "hierarchical", "native", "shm", None):
        equal(comm.allreduce(x, algorithm=algorithm), x)
        equal(comm.allreduce(x, op="mean", algorithm=algorithm), x)
    equal(comm.allreduce(x, compression="fp16"), x)
    for algorithm in (None, "tree", "chain", "native"):
        equal(comm.broadcast(x, algorithm=algorithm), x)
    equal(comm.allgather(x, stack=True), x[None])
    equal(comm.allgather(x), x)
    equal(comm.reduce_scatter(x, op="max"), x)
    ints = [np.arange(5), np.arange(6).reshape(2, 3)]
    comm.allreduce_many(ints, op="mean")
    equal(ints[1], np.arange(6).reshape(2, 3))
    comm.broadcast_many(ints)
    comm.barrier()


def test_bad_arguments_in_a_world_of_one():
    comm = world()
    with raises(TypeError, match="x must be a NumPy or CuPy array, not list"):
        comm.allreduce([1.0, 2.0])
    with raises(ValueError, match="algorithm='butterfly' is not an allreduce algorithm"):
        comm.allreduce(np.ones(2), algorithm="butterfly")
    with raises(ValueError, match="algorithm='ring' is not a broadcast algorithm"):
        comm.broadcast(np.ones(2), algorithm="ring")
    with raises(ValueError, match="arrays\\[0\\] is read-only"):
        ro = np.ones(2)
        ro.flags.writeable = False
        comm.allreduce_many([ro])
    with raises(TypeError, match="arrays must be a list or tuple of arrays, not ndarray"):
        comm.allreduce_many(np.ones(3))
    with raises(ValueError, match="needs an array with at least one dimension"):
        comm.reduce_scatter(np.array(1.0))
    with raises(ValueError, match="dest=0 must be another rank"):
        comm.send(np.ones(2), 0)


@pytest.mark.mpi(min_size=2)
def test_ranks_that_reach_different_collectives_are_told_which_and_where(tmp_path_factory):
    """Rank 0 at ``barrier_worker`` while the others save a checkpoint (a barrier a rank took
    inside a caught exception, say): every rank names each rank's call and its line, where the
    rows of different widths ended in MPI's truncation error, and the ranks are in step again
    afterwards."""
    import re

    from fleetmpi import nn, optimizer
    from fleetmpi.training import checkpoint

    fleet.init(is_collective=True)
    rank, size = fleet.worker_index(), fleet.worker_num()
    from mpi4py import MPI

    folder = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("skipped")) if rank == 0 else None)
    model = nn.Linear(2, 2)
    opt = optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    try:
        if rank == 0:
            fleet.barrier_worker()
        else:
            checkpoint.save(folder, model, opt, 1)
        said = "nothing was raised"
    except CollectiveMismatchError as error:
        said = str(error)
    ok(re.search(r"rank 0: barrier_worker, call #\d+ \(at test_comm_safety.py:\d+ in test_",
                 said), said)
    for other in range(1, size):
        ok(re.search(rf"rank {other}: checkpoint.save, call #\d+ \(at test_comm_safety.py:\d+ "
                     rf"in test_", said), said)
    fleet.barrier_worker()

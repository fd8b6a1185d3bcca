"""Transport ``auto``: NCCL where every rank's arrays live on a GPU of its own, MPI otherwise,
and MPI with one warning when NCCL cannot start. The GPU branches run with stand-ins for the
device (``device_identity``) and for CuPy, so they are checked on machines without a GPU."""
import sys
import types

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.comm import Communicator, NCCLUnavailableError, communicator
from fleetmpi.comm.transport_choice import pick_transport

from comm_support import equal, ok, raises


@pytest.mark.mpi(min_size=2)
def test_pick_transport_wants_a_device_of_its_own_on_every_rank():
    fleet.init()
    world = fleet.world.topology().world
    rank = world.Get_rank()
    ok(pick_transport(world, f"host/{rank}") == "nccl")
    ok(pick_transport(world, "host/0") == "mpi", "two ranks on one device must not get NCCL")
    ok(pick_transport(world, None if rank == 1 else f"host/{rank}") == "mpi",
       "a rank on the host must not get NCCL")
    ok(pick_transport(world, None) == "mpi")


@pytest.mark.mpi
def test_auto_on_host_arrays_is_mpi(monkeypatch):
    monkeypatch.delenv("FLEETMPI_TRANSPORT", raising=False)
    fleet.init()
    comm = Communicator(fleet.world.topology())
    ok(comm.requested_transport == "auto" and comm.transport_name == "mpi")
    comm.free()


# Each step of starting NCCL that ``fake_cupy`` can fail: what the rank's reason says, and
# the message of the error CUDA or NCCL raise there.
FAILURES = {
    "device": ("no usable CUDA device", "cudaErrorNoDevice: no CUDA-capable device is detected"),
    "stream": ("creating a CUDA stream failed", "cudaErrorMemoryAllocation: out of memory"),
    "unique id": ("ncclGetUniqueId failed", "NCCL_ERROR_SYSTEM_ERROR: unhandled system error"),
    "init": ("ncclCommInitRank failed", "NCCL_ERROR_UNHANDLED_CUDA_ERROR: unhandled cuda error"),
}


def fake_cupy(failing_step=None):
    """CuPy as the ``gpu`` extra installs it, as modules for ``sys.modules``, where one step of
    starting NCCL fails as CUDA or NCCL would (``failing_step``, a key of ``FAILURES``:
    ``"device"`` is a machine with no CUDA driver or device; None: every step works). The
    NCCL communicators it makes are listed in ``cupy.cuda.nccl.made``, each with
    ``destroyed`` set once freed."""
    class CUDARuntimeError(RuntimeError):
        pass

    class NcclError(RuntimeError):
        pass

    def step(name, error, value):
        def run(*args, **kwargs):
            if failing_step == name:
                raise error(FAILURES[name][1])
            return value(*args, **kwargs) if callable(value) else value
        return run

    class NcclCommunicator:
        def __init__(self, size, uid, rank):
            step("init", NcclError, None)()
            self.destroyed = False
            nccl.made.append(self)

        def destroy(self):
            self.destroyed = True
    device_count = step("device", CUDARuntimeError, 1)
    runtime = types.SimpleNamespace(getDeviceCount=device_count,
                                    CUDARuntimeError=CUDARuntimeError)
    nccl = types.SimpleNamespace(available=True, made=[], NcclCommunicator=NcclCommunicator,
                                 get_unique_id=step("unique id", NcclError, (7,) * 128))
    cuda = types.ModuleType("cupy.cuda")
    cuda.runtime, cuda.nccl = runtime, nccl
    cuda.Stream = step("stream", CUDARuntimeError, lambda non_blocking: object())
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda
    return {"cupy": cupy, "cupy.cuda": cuda}


def install(monkeypatch, modules):
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return modules["cupy"]


def auto_warnings(fleetmpi_warnings):
    """The warnings of transport ``auto`` this rank wrote (``fleetmpi_warnings``' fixture)."""
    return [m for m in fleetmpi_warnings() if "transport 'auto'" in m]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("cupy", ["absent", "installed without a device"])
def test_auto_fallback_to_mpi_warns_once_naming_every_rank(cupy, monkeypatch, fleetmpi_warnings):
    """Every rank reports a GPU of its own, but NCCL cannot start: auto runs on MPI and rank 0
    warns once, naming each rank's reason; an explicit ``nccl`` stays an error."""
    fleet.init()
    rank = fleet.worker_index()
    monkeypatch.setattr(communicator, "device_identity", lambda: f"host/{rank}")
    if cupy == "absent":
        monkeypatch.setitem(sys.modules, "cupy", None)
        reason = "CuPy with NCCL is not importable"
    else:
        install(monkeypatch, fake_cupy("device"))
        reason = "no usable CUDA device"
    comm = Communicator(fleet.world.topology(), nccl_comm_num=2)
    ok(comm.transport_name == "mpi" and len(comm.transports) == 2
       and all(t.name == "mpi" for t in comm.transports))
    warnings = auto_warnings(fleetmpi_warnings)
    if rank == 0:
        named = len(warnings) == 1 and all(f"rank {r}: {reason}" in warnings[0]
                                           for r in range(fleet.worker_num()))
        ok(named, f"rank 0 warned {warnings}")
    else:
        ok(warnings == [], f"rank {rank} warned {warnings}; only rank 0 warns")
    ok(comm.allreduce(np.ones(2))[0] == fleet.worker_num())
    comm.free()
    with raises(NCCLUnavailableError, match=f"rank 0: {reason}"):
        Communicator(fleet.world.topology(), transport="nccl")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("step, failing", [("device", "last"), ("stream", "last"),
                                           ("unique id", 0), ("init", "last")])
def test_auto_fallback_to_mpi_on_every_rank_when_nccl_fails_to_start_on_one(
        step, failing, monkeypatch, fleetmpi_warnings):
    """Every rank has a GPU of its own, and one step of starting NCCL fails on one rank only
    (the unique id is rank 0's to make): every rank runs on MPI, rank 0 warns once naming that
    rank and its error, the others do not warn, NCCL communicators made on the other ranks are
    destroyed, and an explicit ``nccl`` raises the same reason on every rank."""
    fleet.init()
    rank, size = fleet.worker_index(), fleet.worker_num()
    failing = size - 1 if failing == "last" else failing
    monkeypatch.setattr(communicator, "device_identity", lambda: f"host/{rank}")
    cupy = install(monkeypatch, fake_cupy(step if rank == failing else None))
    comm = Communicator(fleet.world.topology(), nccl_comm_num=2)
    ok(comm.transport_name == "mpi" and [t.name for t in comm.transports] == ["mpi", "mpi"])
    what, message = FAILURES[step]
    warnings = auto_warnings(fleetmpi_warnings)
    if rank == 0:
        named = (len(warnings) == 1 and f"rank {failing}: {what} (" in warnings[0]
                 and message in warnings[0]
                 and not any(f"rank {r}:" in warnings[0] for r in range(size) if r != failing))
        ok(named, f"rank 0 warned {warnings}")
    else:
        ok(warnings == [], f"rank {rank} warned {warnings}; only rank 0 warns")
    equal(comm.allreduce(np.arange(3.0) + rank), size * np.arange(3.0) + size * (size - 1) / 2)
    comm.free()
    with raises(NCCLUnavailableError, match=f"rank {failing}: {what}"):
        Communicator(fleet.world.topology(), transport="nccl")
    made = cupy.cuda.nccl.made
    ok(all(c.destroyed for c in made), "an NCCL communicator was left alive")
    ok(bool(made) == (step == "init" and rank != failing), f"{len(made)} NCCL communicators")


@pytest.mark.mpi
def test_auto_takes_nccl_when_it_starts(monkeypatch):
    """With a device of its own on every rank and a transport that starts, auto is NCCL."""
    fleet.init()
    rank = fleet.worker_index()
    monkeypatch.setattr(communicator, "device_identity", lambda: f"host/{rank}")
    started = []

    def make_transport(self, comm, stream=None):
        started.append(self.transport_name)
        return types.SimpleNamespace(name=self.transport_name, free=comm.Free)
    monkeypatch.setattr(Communicator, "_make_transport", make_transport)
    comm = Communicator(fleet.world.topology())
    ok(comm.transport_name == "nccl" and started == ["nccl"], str(started))
    for transport in comm.transports:
        transport.free()
    comm._control.Free()


@pytest.mark.parametrize("made", [bytes(range(100, 228)), tuple(range(-64, 64))],
                         ids=["cupy-14-bytes", "cupy-13-chars"])
def test_the_nccl_unique_id_travels_in_the_form_cupy_made_it(made):
    from fleetmpi.comm import transport_nccl

    packed = transport_nccl.unique_id_bytes(made)
    assert packed.dtype == np.uint8 and packed.size == transport_nccl.UNIQUE_ID_BYTES + 1
    received = packed.copy()  # what a Bcast of the bytes hands every rank
    assert transport_nccl.unique_id_from_bytes(received) == made
    with pytest.raises(ValueError, match="has 128 bytes, got 127"):
        transport_nccl.unique_id_bytes(made[:127])

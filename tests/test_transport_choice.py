"""Transport ``auto``: NCCL where every rank's arrays live on a GPU of its own, MPI otherwise,
and MPI with one warning when NCCL cannot start. The GPU branches run with stand-ins for the
device (``device_identity``) and for CuPy, so they are checked on machines without a GPU."""
import logging
import sys
import types

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.comm import Communicator, NCCLUnavailableError, communicator
from fleetmpi.comm.transport_choice import pick_transport

from comm_support import ok, raises


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


def fake_cupy_without_device():
    """CuPy as the ``gpu`` extra installs it on a machine with no CUDA driver or device."""
    class CUDARuntimeError(RuntimeError):
        pass

    def no_device():
        raise CUDARuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
    runtime = types.SimpleNamespace(getDeviceCount=no_device, CUDARuntimeError=CUDARuntimeError)
    cuda = types.ModuleType("cupy.cuda")
    cuda.runtime = runtime
    cuda.nccl = types.SimpleNamespace(available=True)
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda
    return {"cupy": cupy, "cupy.cuda": cuda}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("cupy", ["absent", "installed without a device"])
def test_auto_falls_back_to_mpi_with_one_warning_naming_every_rank(cupy, monkeypatch, caplog):
    """Every rank reports a GPU of its own, but NCCL cannot start: auto runs on MPI and rank 0
    warns once, naming each rank's reason; an explicit ``nccl`` stays an error."""
    fleet.init()
    rank = fleet.worker_index()
    monkeypatch.setattr(communicator, "device_identity", lambda: f"host/{rank}")
    if cupy == "absent":
        monkeypatch.setitem(sys.modules, "cupy", None)
        reason = "CuPy with NCCL is not importable"
    else:
        for name, module in fake_cupy_without_device().items():
            monkeypatch.setitem(sys.modules, name, module)
        reason = "no usable CUDA device"
    with caplog.at_level(logging.WARNING, logger="fleetmpi"):
        comm = Communicator(fleet.world.topology(), nccl_comm_num=2)
    ok(comm.transport_name == "mpi" and len(comm.transports) == 2
       and all(t.name == "mpi" for t in comm.transports))
    warnings = [r.getMessage() for r in caplog.records if "transport 'auto'" in r.getMessage()]
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

"""Which transport ``transport="auto"`` (the default) gives a communicator.

NCCL when the arrays live on a GPU on every rank and no two ranks drive the same device (NCCL
cannot run two ranks of one communicator on one GPU); MPI otherwise. Every rank takes part in
the choice (one ``allgather`` of each rank's device), so every rank chooses alike.
``fleetmpirun --gpus`` gives each local rank its own device (``CUDA_VISIBLE_DEVICES``).
"""
import socket

from fleetmpi.core import backend


def device_identity():
    """This rank's device as ``host/PCI bus id``, or None when the arrays live on the host."""
    if not backend.on_gpu():
        return None
    import cupy

    return f"{socket.gethostname()}/{cupy.cuda.Device().pci_bus_id}"


def pick_transport(comm, identity=None):
    """``"nccl"`` or ``"mpi"`` for the ranks of the MPI communicator ``comm`` (collective);
    ``identity``: this rank's ``device_identity()``."""
    identities = comm.allgather(identity)
    if any(i is None for i in identities) or len(set(identities)) < len(identities):
        return "mpi"
    return "nccl"

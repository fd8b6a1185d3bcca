"""The environment variables each launcher sets to describe a rank: the one table of their names.

Three readers use it: ``launch/rank_main.py`` takes a rank's place from one launcher's rank, size
and local rank together (before MPI starts), ``fleetmpi.core.backend`` counts the ranks on a node
before ``fleet.init`` (to share the node's cores between their BLAS threads) and takes the local
rank there (to drive the rank's own GPU when the backend is chosen before ``fleet.init``), and
``fleetmpi.launcher_check`` checks every family against what MPI says.

This module imports nothing of fleetmpi: ``launch/rank_main.py``, which must not import fleetmpi
before the rank's variables are in place, loads it by its file path, and
``fleetmpi.core.extras`` reads the local rank here where importing fleetmpi itself failed.
"""
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One launcher's variables. ``size`` lists alternatives, the first one set is used;
    ``local_size`` is the number of ranks on this node (checked against MPI's), where
    ``tasks_per_node`` is only what was asked for (Slurm's ``--ntasks-per-node``, not checked,
    a hint for the thread count); ``node`` numbers the node of this rank."""
    name: str
    size: tuple
    rank: str
    local_rank: str = None
    local_size: str = None
    num_nodes: str = None
    node: str = None
    tasks_per_node: str = None

    def size_variable(self, environ):
        """The first of ``size`` set (not empty) in ``environ``, or None."""
        return next((name for name in self.size if environ.get(name, "") != ""), None)


HYDRA = Family("MPICH/Hydra", ("PMI_SIZE",), "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
OPEN_MPI = Family("Open MPI", ("OMPI_COMM_WORLD_SIZE",), "OMPI_COMM_WORLD_RANK",
                  "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
SLURM = Family("Slurm", ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), "SLURM_PROCID",
               "SLURM_LOCALID", num_nodes="SLURM_STEP_NUM_NODES", node="SLURM_NODEID",
               tasks_per_node="SLURM_NTASKS_PER_NODE")
PADDLE = Family("Paddle", ("PADDLE_TRAINERS_NUM",), "PADDLE_TRAINER_ID")
# The launchers that start MPI ranks, in the order a rank's place is looked for in them.
MPI_LAUNCHERS = (HYDRA, OPEN_MPI, SLURM)
FAMILIES = MPI_LAUNCHERS + (PADDLE,)
# The number of ranks on this node, as each MPI launcher that says it does, in the order they
# are read (a launcher may set neither a local size nor tasks per node).
RANKS_ON_NODE = tuple(family.local_size or family.tasks_per_node for family in MPI_LAUNCHERS
                      if family.local_size or family.tasks_per_node)
# This rank's index on its node, as each MPI launcher says it, in the order they are read.
LOCAL_RANKS = tuple(family.local_rank for family in MPI_LAUNCHERS)
# What a process manager sets for MPI to reach it, beside the families' variables (PMI over an
# inherited descriptor, as mpiexec.gforker; PMIx, as prterun and srun --mpi=pmix).
PROCESS_MANAGER = ("PMI_FD", "PMI_PORT", "PMIX_RANK")
# The MPI library's transport kept to shared memory, UCX's (MPICH's default network module) and
# libfabric's (under MPICH_CH4_NETMOD=ofi), whose defaults listen on 127.0.0.1 and on the host's
# external address: set for the ranks of a job on one host and for a process started alone, so
# that neither opens a listener (docs/launch.md, "Network"). A variable the user set is left.
LOCAL_TRANSPORT_ENV = {"UCX_TLS": "self,sm", "FI_PROVIDER": "shm"}


def started_alone(environ):
    """Whether no launcher started this process: ``python train.py``, a world of one."""
    return not any(family.size_variable(environ) for family in MPI_LAUNCHERS) and \
        not any(environ.get(name) for name in PROCESS_MANAGER)


def launcher_number(names, least, environ=os.environ):
    """The first of the launcher's variables ``names`` that holds a whole number of at least
    ``least`` (what the launcher says before ``fleet.init()``), else ``least``."""
    for name in names:
        text = environ.get(name, "")
        if text.isdigit() and int(text) >= least:
            return int(text)
    return least

"""What the launcher says about this rank, checked against what MPI says.

MPI itself is the authority on rank, size, local rank and node (``fleetmpi.comm.Topology``).
Launchers also describe each process in environment variables, and scripts read them (a data
loader sharding by ``PADDLE_TRAINER_ID``); when the two disagree, something is wrong in the
launch, most often an mpi4py built against another MPI than the launcher's, so that every
process sees a world of one and trains alone. ``fleet.init`` therefore checks each family of
variables of ``fleetmpi.core.launcher_env.FAMILIES`` (Open MPI, MPICH/Hydra, Slurm, Paddle: the
size, rank, local rank, local size and number of nodes each sets; Slurm's node id, which must
group the ranks into the same nodes as MPI does) and raises ``EnvironmentMismatchError``
naming every variable that disagrees.

Variables leak: a job started from inside another job (a test runner under ``mpiexec`` that
starts ``mpiexec`` again, ``python train.py`` in an ``sbatch`` script, ranks of ``mpiexec``
whose proxies ``srun`` started) inherits the outer job's variables. So a family is judged by
its size variable:

* absent: the family is not checked;
* equal to MPI's world size: the family describes this job, and each of its other variables
  must agree with MPI;
* different from MPI's world size: the variables describe another job and are not checked,
  except in one case that is always an error: MPI says a world of one, the family says more,
  and this process's parent is a launcher (``srun``'s ``slurmstepd``, Open MPI's daemons,
  Hydra's proxy): the launcher started several processes and MPI sees each of them alone.

The Paddle family is checked in collective mode only: in parameter-server mode (``fleet.init``
with ``is_collective=False`` or a role maker, ``PADDLE_PSERVERS_NUM`` set, or ``TRAINING_ROLE``
other than ``TRAINER``) ``PADDLE_TRAINER_ID`` is the trainer index and ``PADDLE_TRAINERS_NUM``
the number of trainers, not world rank and size. Local ranks, local sizes and node ids are not
checked while ``FLEETMPI_LOCAL_SIZE`` makes up nodes. ``FLEETMPI_CHECK_ENVIRONMENT=0`` skips
the whole check.
"""
import os
from dataclasses import dataclass

from .core.knobs import CHECK_ENVIRONMENT
from .core.launcher_env import FAMILIES, PADDLE, SLURM

# Process names (as /proc/<pid>/comm shows them, at most 15 characters) of the programs that
# start ranks: Slurm's step daemon, Open MPI's launcher and daemons, Hydra's launcher and proxy,
# MPICH's single-host gforker.
LAUNCHER_PROCESSES = frozenset({
    "slurmstepd", "srun", "mpirun", "mpiexec", "orterun", "orted", "prterun", "prted",
    "mpiexec.hydra", "hydra_pmi_proxy", "mpiexec.gforker",
})


class EnvironmentMismatchError(RuntimeError):
    """The launcher's variables disagree with what MPI says about this process."""


@dataclass(frozen=True)
class MPIPlace:
    """What MPI says about this process; the node-level fields are None where not checked."""
    rank: int
    size: int
    local_rank: int = None
    local_size: int = None
    num_nodes: int = None


def check_enabled(environ=os.environ):
    """The value of ``FLEETMPI_CHECK_ENVIRONMENT`` (``1``, the default, or ``0``)."""
    return CHECK_ENVIRONMENT.value(environ)


def parent_process_name():
    """The name of this process's parent (``/proc/<ppid>/comm``), or None where unreadable."""
    try:
        with open(f"/proc/{os.getppid()}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def _paddle_applies(environ, collective):
    return (collective and environ.get("PADDLE_PSERVERS_NUM", "") == ""
            and environ.get("TRAINING_ROLE", "TRAINER") in ("", "TRAINER"))


def _integer(environ, name, problems):
    text = environ.get(name, "")
    if text == "":
        return None
    try:
        return int(text)
    except ValueError:
        problems.append(f"{name}={text!r} is not an integer")
        return None


def applicable(environ, family, size, collective=True):
    """True when ``family`` describes this job: its size variable equals MPI's world ``size``."""
    if family is PADDLE and not _paddle_applies(environ, collective):
        return False
    name = family.size_variable(environ)
    return name is not None and environ[name].strip() == str(size)


def disagreements(environ, place, parent=None, collective=True):
    """Every way the launcher's variables in ``environ`` contradict ``place`` (an ``MPIPlace``),
    as sentences like ``"SLURM_PROCID=3 but MPI says rank 1"``; see the module docstring for
    which families are checked. ``parent`` is the parent process's name."""
    problems = []
    for family in FAMILIES:
        if family is PADDLE and not _paddle_applies(environ, collective):
            continue
        size_name = family.size_variable(environ)
        if size_name is None:
            continue
        size = _integer(environ, size_name, problems)
        if size is None:
            continue
        if size != place.size:
            if place.size == 1 and size > 1 and parent in LAUNCHER_PROCESSES:
                problems.append(
                    f"{size_name}={size} but MPI says a world of 1: the launcher ({parent}) "
                    f"started {size} processes and MPI sees each of them alone; mpi4py is "
                    f"probably built against another MPI than this launcher's")
            continue
        expected = ((family.rank, place.rank, "rank"),
                    (family.local_rank, place.local_rank, "local rank"),
                    (family.local_size, place.local_size, "local size"),
                    (family.num_nodes, place.num_nodes, "number of nodes"))
        for name, truth, what in expected:
            if name is None or truth is None:
                continue
            value = _integer(environ, name, problems)
            if value is not None and value != truth:
                problems.append(f"{name}={value} but MPI says {what} {truth}")
    return problems


def reported_node(environ, size, collective=True):
    """``SLURM_NODEID`` as an integer where the Slurm family describes this job, else -1."""
    if not applicable(environ, SLURM, size, collective):
        return -1
    text = environ.get(SLURM.node, "")
    return int(text) if text.strip().isdigit() else -1


def node_disagreements(reported, mpi_nodes):
    """Compare the node ids the launcher gave each rank (``reported[r]``, -1 where unknown)
    with MPI's node of each rank: ranks share a reported id exactly when they share a node.
    Ids are compared as a partition (Slurm numbers nodes its own way, fleetmpi by lowest
    rank), and only when every rank reported one."""
    if any(r < 0 for r in reported):
        return []
    problems = []
    for first in range(len(reported)):
        for other in range(first + 1, len(reported)):
            same_reported = reported[first] == reported[other]
            if same_reported != (mpi_nodes[first] == mpi_nodes[other]):
                problems.append(
                    f"{SLURM.node} is {reported[first]} on rank {first} and {reported[other]} "
                    f"on rank {other} but MPI says they are on "
                    f"{'different nodes' if same_reported else 'the same node'}")
                if len(problems) == 3:
                    return problems
    return problems


def mismatch_error(problems):
    """The error ``fleet.init`` raises for ``problems`` (a non-empty list of sentences)."""
    return EnvironmentMismatchError(
        "the launcher's environment disagrees with MPI: " + "; ".join(problems)
        + f" (MPI is taken as right; unset the stale variables, or set "
          f"{CHECK_ENVIRONMENT.name}=0 to skip this check)")


def verify(topology, environ=os.environ, collective=True, emulated_nodes=False):
    """Check the launcher's variables against ``topology`` (a ``fleetmpi.comm.Topology``);
    raise ``EnvironmentMismatchError`` on a disagreement.

    Collective over ``topology.world`` when it has more than one rank (one small allgather of
    node ids), so every rank must call it.
    """
    import numpy as np

    real_nodes = not emulated_nodes
    reported = np.empty((topology.size, 2), dtype=np.int64)
    if topology.size > 1:
        # before any early return, so that every rank takes part whatever its variables say
        mine = np.array([reported_node(environ, topology.size, collective),
                         topology.node_index], dtype=np.int64)
        topology.world.Allgather(mine, reported)
    if not check_enabled(environ):
        return
    place = MPIPlace(topology.rank, topology.size,
                     topology.local_rank if real_nodes else None,
                     topology.local_size if real_nodes else None,
                     topology.num_nodes if real_nodes else None)
    problems = disagreements(environ, place, parent_process_name(), collective)
    if topology.size > 1 and real_nodes:
        problems += node_disagreements(list(reported[:, 0]), list(reported[:, 1]))
    if problems:
        raise mismatch_error(problems)

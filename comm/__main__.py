"""``python -m fleetmpi.comm``: the table of which algorithm runs when (``algorithm_choice``).

In one process it prints the table. Under ``mpiexec -n N`` rank 0 also prints what the world
communicator of this job chooses at a few sizes, the timed row resolved (every rank takes part
in that timing).
"""
import sys

from mpi4py import MPI

from .algorithm_choice import CHOICES, TIMED, choose, table_text
from .topology import topology_of

SIZES = (4 << 10, 64 << 10, 1 << 20, 64 << 20)


def world_choices():
    """Lines saying what the world communicator chooses at ``SIZES`` (collective)."""
    from .communicator import Communicator
    from .topology import Topology

    comm = Communicator(Topology(MPI.COMM_WORLD))
    lines = [f"this world: {comm.size} ranks on {comm.topology.num_nodes} node(s), transport "
             f"{comm.transport_name!r}, use_hierarchical_allreduce "
             f"{comm.use_hierarchical_allreduce}"]
    topology = topology_of(comm.size, comm.topology.local_size)
    for nbytes in SIZES:
        allreduce = comm.allreduce_algorithm(nbytes)
        if choose("allreduce", nbytes, comm.transport_name, topology,
                  hierarchical=comm.use_hierarchical_allreduce).algorithm == TIMED:
            allreduce += " (timed)"
        broadcast = choose("broadcast", nbytes, comm.transport_name, topology).algorithm
        lines.append(f"  {nbytes >> 10:>6} KiB: allreduce {allreduce}, "
                     f"allreduce fp16 {comm.allreduce_algorithm(nbytes, 'fp16')}, "
                     f"broadcast {broadcast}")
    return lines


def main(out=sys.stdout):
    lines = [f"Algorithm chosen with algorithm=None: the first row that matches "
             f"({len(CHOICES)} rows).", "", table_text(), ""]
    if MPI.COMM_WORLD.Get_size() > 1:
        lines += world_choices()
    else:
        lines.append("Under mpiexec -n N, this also prints what that world chooses.")
    if MPI.COMM_WORLD.Get_rank() == 0:
        print("\n".join(lines), file=out)


if __name__ == "__main__":
    main()

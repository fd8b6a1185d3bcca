"""The table of which algorithm a collective runs with algorithm=None, and its printout."""
import subprocess
import sys

import pytest

from fleetmpi.comm.algorithm_choice import (CHOICES, NATIVE_BELOW_BYTES, TIMED, TREE_MAX_BYTES,
                                            choose, size_range)
from fleetmpi.comm.topology import NODES, ONE_NODE, ONE_RANK, topology_of

from job_limits import HANG_SECONDS

TOPOLOGIES = (ONE_RANK, ONE_NODE, NODES)


def rule(nbytes, transport, topology, compression, hierarchical):
    """The choice as rules in order: hierarchical when asked for, the ring under compression,
    the library's own below 1 MiB, the timed choice on one node with MPI, else the ring."""
    if hierarchical:
        return "hierarchical"
    if compression is not None:
        return "ring"
    if nbytes < NATIVE_BELOW_BYTES:
        return "native"
    if transport == "mpi" and topology == ONE_NODE:
        return TIMED
    return "ring"


@pytest.mark.parametrize("transport", ["mpi", "nccl"])
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_allreduce_rows_follow_the_rules(transport, topology):
    for nbytes in (0, 4, NATIVE_BELOW_BYTES - 1, NATIVE_BELOW_BYTES, 1 << 30):
        for compression in (None, "fp16"):
            for hierarchical in (False, True):
                row = choose("allreduce", nbytes, transport, topology, compression, hierarchical)
                assert row.algorithm == rule(nbytes, transport, topology, compression,
                                             hierarchical), (nbytes, compression, hierarchical)


def test_broadcast_takes_the_tree_up_to_its_limit_and_the_chain_above():
    for topology in TOPOLOGIES:
        assert choose("broadcast", TREE_MAX_BYTES, "mpi", topology).algorithm == "tree"
        assert choose("broadcast", TREE_MAX_BYTES + 1, "nccl", topology).algorithm == "chain"


def test_topology_of_a_world():
    assert topology_of(1, 1) == ONE_RANK
    assert topology_of(4, 4) == ONE_NODE
    assert topology_of(4, 2) == NODES


def test_size_ranges_read_as_bytes():
    assert [size_range(row) for row in CHOICES[:7]] == [
        "any", "any", "< 1 MiB", ">= 1 MiB", ">= 1 MiB", "<= 64 KiB", "> 64 KiB"]
    assert all(size_range(row) == "any" for row in CHOICES[7:])


def test_an_unknown_collective_has_no_row():
    with pytest.raises(LookupError, match="no algorithm for allgatherv"):
        choose("allgatherv", 4, "mpi", ONE_NODE)


@pytest.mark.parametrize("collective", ["allgather", "reduce_scatter", "alltoall", "gather",
                                        "scatter", "send", "recv", "barrier"])
def test_collectives_of_one_algorithm_take_it_whatever_the_call(collective):
    picks = {choose(collective, nbytes, transport, topology, compression, hierarchical).algorithm
             for nbytes in (0, 1 << 30) for transport in ("mpi", "nccl")
             for topology in TOPOLOGIES for compression in (None, "fp16")
             for hierarchical in (False, True)}
    assert len(picks) == 1, picks


def test_python_m_fleetmpi_comm_prints_every_row_in_one_process():
    done = subprocess.run([sys.executable, "-m", "fleetmpi.comm"], capture_output=True,
                          text=True, timeout=HANG_SECONDS)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for row in CHOICES:
        assert any(row.algorithm in line and row.why in line for line in lines), row
    assert "mpiexec" in done.stdout


@pytest.mark.mpi
def test_comm_world_choices_are_the_same_on_every_rank():
    from mpi4py import MPI

    from fleetmpi.comm.__main__ import world_choices

    lines = world_choices()
    assert lines[0].startswith(f"this world: {MPI.COMM_WORLD.Get_size()} ranks")
    assert not any(f"allreduce {TIMED}," in line for line in lines), lines  # resolved
    everyone = MPI.COMM_WORLD.allgather(lines)
    assert all(theirs == lines for theirs in everyone), everyone

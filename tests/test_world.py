"""fleet.init and the role queries, in a single process (a world of one)."""
import logging
import os
import subprocess
import sys

import pytest
from mpi4py import MPI

import fleetmpi as fleet
from fleetmpi.core import job
from fleetmpi import world
from fleetmpi.comm.topology import Topology

from job_limits import HANG_SECONDS


def test_queries_before_init_say_to_call_init(monkeypatch):
    monkeypatch.setattr(job, "_topology", None)
    with pytest.raises(RuntimeError, match=r"fleet.init\(\)"):
        fleet.worker_index()


def test_a_plain_process_is_a_world_of_one():
    fleet.init(is_collective=True)
    fleet.init(is_collective=True)
    assert fleet.worker_index() == MPI.COMM_WORLD.Get_rank()
    assert fleet.worker_num() == MPI.COMM_WORLD.Get_size()
    if MPI.COMM_WORLD.Get_size() == 1:
        assert (fleet.worker_index(), fleet.worker_num()) == (0, 1)
        assert fleet.is_first_worker()
        assert (fleet.local_rank(), fleet.local_size()) == (0, 1)
        assert (fleet.node_index(), fleet.node_num()) == (0, 1)
    fleet.barrier_worker()


def test_init_twice_keeps_the_same_topology():
    fleet.init()
    first = world.topology()
    fleet.init()
    assert world.topology() is first


def test_switching_to_parameter_server_mode_after_init_is_refused_clearly():
    fleet.init()
    with pytest.raises(RuntimeError, match="already called in the other mode"):
        fleet.init(is_collective=False)


@pytest.mark.parametrize("value", ["0", "abc", "3"])
def test_bad_local_size_override_is_named(monkeypatch, value):
    if MPI.COMM_WORLD.Get_size() % 3 == 0 and value == "3":
        pytest.skip("3 divides this world size")
    monkeypatch.setenv("FLEETMPI_LOCAL_SIZE", value)
    with pytest.raises(ValueError, match=f"FLEETMPI_LOCAL_SIZE={value!r}|FLEETMPI_LOCAL_SIZE={value}"):
        Topology(MPI.COMM_WORLD)


def test_log_lines_carry_rank_and_node():
    code = ("import fleetmpi as f, fleetmpi.core.log as l; f.init(); "
            "l.logger.warning('hello from a rank')")
    env = dict(os.environ, FLEETMPI_LOG_LEVEL="INFO")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=HANG_SECONDS)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert "[fleetmpi rank 0/1 node 0] WARNING hello from a rank" in lines
    assert any(line.startswith("[fleetmpi rank 0/1 node 0] INFO joined") for line in lines)


def test_bad_log_level_is_named():
    code = "import fleetmpi as f; f.init()"
    env = dict(os.environ, FLEETMPI_LOG_LEVEL="LOUD")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=HANG_SECONDS)
    assert result.returncode != 0
    assert "FLEETMPI_LOG_LEVEL='LOUD'" in result.stderr


def test_logger_does_not_leak_into_the_root_logger():
    fleet.init()
    assert logging.getLogger("fleetmpi").propagate is False

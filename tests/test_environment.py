"""The launcher's variables are checked against what MPI says about each rank."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

import fleetmpi as fleet
from fleetmpi.core import knobs
from fleetmpi import launcher_check as env_check
from fleetmpi.launcher_check import EnvironmentMismatchError, MPIPlace
from fleetmpi.launch.mpi_command import local_command
from fleetmpi.world import topology

from comm_support import ok, raises
from job_limits import HANG_SECONDS

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "failure_jobs.py")
# rank 1 of 4, the second of two ranks on node 1 of 2
PLACE = MPIPlace(rank=1, size=4, local_rank=1, local_size=2, num_nodes=2)
OPEN_MPI = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
HYDRA = {"PMI_SIZE": "4", "PMI_RANK": "1", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
SLURM = {"SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "1",
         "SLURM_LOCALID": "1", "SLURM_STEP_NUM_NODES": "2", "SLURM_NODEID": "1"}
PADDLE = {"PADDLE_TRAINERS_NUM": "4", "PADDLE_TRAINER_ID": "1", "TRAINING_ROLE": "TRAINER"}


@pytest.mark.parametrize("family", [OPEN_MPI, HYDRA, SLURM, PADDLE, {}])
def test_agreeing_variables_pass(family):
    assert env_check.disagreements(family, PLACE) == []


def test_every_disagreeing_variable_is_named_with_what_mpi_says():
    environ = dict(SLURM, SLURM_PROCID="3", SLURM_LOCALID="0", SLURM_STEP_NUM_NODES="1",
                   **dict(OPEN_MPI, OMPI_COMM_WORLD_LOCAL_SIZE="4"))
    assert env_check.disagreements(environ, PLACE) == [
        "OMPI_COMM_WORLD_LOCAL_SIZE=4 but MPI says local size 2",
        "SLURM_PROCID=3 but MPI says rank 1",
        "SLURM_LOCALID=0 but MPI says local rank 1",
        "SLURM_STEP_NUM_NODES=1 but MPI says number of nodes 2",
    ]


def test_error_message_lists_the_disagreements_and_the_way_out():
    error = env_check.mismatch_error(["PMI_RANK=3 but MPI says rank 1", "X"])
    assert isinstance(error, EnvironmentMismatchError)
    assert "PMI_RANK=3 but MPI says rank 1; X" in str(error)
    assert "FLEETMPI_CHECK_ENVIRONMENT=0" in str(error)


def test_a_family_of_another_size_describes_another_job():
    # an sbatch allocation of 8 tasks around mpiexec -n 4, or hydra proxies started by srun
    stale = {"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "3",
             "PADDLE_TRAINERS_NUM": "2", "PADDLE_TRAINER_ID": "0"}
    assert env_check.disagreements(stale, PLACE, parent="hydra_pmi_proxy") == []


def test_step_size_wins_over_the_allocation_size():
    environ = dict(SLURM, SLURM_NTASKS="16", SLURM_PROCID="2")
    assert env_check.disagreements(environ, PLACE) == ["SLURM_PROCID=2 but MPI says rank 1"]


def test_processes_started_by_a_launcher_but_alone_in_mpi_are_an_error():
    alone = MPIPlace(rank=0, size=1, local_rank=0, local_size=1, num_nodes=1)
    environ = {"SLURM_NTASKS": "4", "SLURM_PROCID": "2"}
    (problem,) = env_check.disagreements(environ, alone, parent="slurmstepd")
    assert problem.startswith("SLURM_NTASKS=4 but MPI says a world of 1: the launcher "
                              "(slurmstepd) started 4 processes")
    # the same variables in a plain `python train.py` inside an sbatch script: left over
    assert env_check.disagreements(environ, alone, parent="bash") == []
    assert env_check.disagreements(environ, alone, parent=None) == []


@pytest.mark.parametrize("extra, collective", [
    ({"PADDLE_PSERVERS_NUM": "1"}, True),
    ({"TRAINING_ROLE": "PSERVER"}, True),
    ({}, False),
])
def test_paddle_variables_are_not_world_ranks_in_parameter_server_mode(extra, collective):
    environ = dict(PADDLE, PADDLE_TRAINER_ID="0", **extra)
    assert env_check.disagreements(environ, PLACE, collective=collective) == []


def test_paddle_variables_are_checked_in_collective_mode():
    environ = dict(PADDLE, PADDLE_TRAINER_ID="0")
    assert env_check.disagreements(environ, PLACE) == ["PADDLE_TRAINER_ID=0 but MPI says rank 1"]
    environ.pop("TRAINING_ROLE")
    assert env_check.disagreements(environ, PLACE) == ["PADDLE_TRAINER_ID=0 but MPI says rank 1"]


def test_values_that_are_not_integers_are_named():
    environ = dict(HYDRA, PMI_RANK="one", MPI_LOCALRANKID="")
    assert env_check.disagreements(environ, PLACE) == ["PMI_RANK='one' is not an integer"]
    assert env_check.disagreements({"PMI_SIZE": "x4"}, PLACE) == ["PMI_SIZE='x4' is not an integer"]


def test_made_up_nodes_leave_local_variables_unchecked():
    emulated = MPIPlace(rank=1, size=4)
    environ = dict(HYDRA, MPI_LOCALRANKID="3", MPI_LOCALNRANKS="4")
    assert env_check.disagreements(environ, emulated) == []
    assert env_check.disagreements(dict(environ, PMI_RANK="2"), emulated) == [
        "PMI_RANK=2 but MPI says rank 1"]


def test_node_ids_must_group_ranks_as_mpi_does():
    mpi_nodes = [0, 0, 1, 1]
    assert env_check.node_disagreements([5, 5, 2, 2], mpi_nodes) == []   # numbering may differ
    assert env_check.node_disagreements([0, 1, 0, 1], mpi_nodes)[0] == (
        "SLURM_NODEID is 0 on rank 0 and 1 on rank 1 but MPI says they are on the same node")
    assert env_check.node_disagreements([0, 0, 0, 1], mpi_nodes)[0] == (
        "SLURM_NODEID is 0 on rank 0 and 0 on rank 2 but MPI says they are on different nodes")
    assert env_check.node_disagreements([0, -1, 1, 1], mpi_nodes) == []   # not every rank knows


def test_check_knob_is_validated():
    assert env_check.check_enabled({})
    assert not env_check.check_enabled({knobs.CHECK_ENVIRONMENT.name: "0"})
    with pytest.raises(ValueError, match="FLEETMPI_CHECK_ENVIRONMENT='no' must be 0 or 1"):
        env_check.check_enabled({knobs.CHECK_ENVIRONMENT.name: "no"})


def _init_in_subprocess(extra):
    env = dict(os.environ, FLEETMPI_DEVICE="cpu", **extra)
    return subprocess.run([sys.executable, "-c", "import fleetmpi; fleetmpi.init()"],
                          env=env, capture_output=True, text=True, timeout=HANG_SECONDS)


def test_init_refuses_variables_of_this_job_that_disagree():
    result = _init_in_subprocess({"SLURM_NTASKS": "1", "SLURM_PROCID": "2"})
    assert result.returncode != 0
    assert "EnvironmentMismatchError" in result.stderr, result.stderr
    assert "SLURM_PROCID=2 but MPI says rank 0" in result.stderr, result.stderr
    assert _init_in_subprocess({"SLURM_NTASKS": "1", "SLURM_PROCID": "2",
                                "FLEETMPI_CHECK_ENVIRONMENT": "0"}).returncode == 0


def test_init_ignores_variables_left_over_from_an_enclosing_job():
    result = _init_in_subprocess({"SLURM_NTASKS": "8", "SLURM_PROCID": "5",
                                  "PADDLE_TRAINERS_NUM": "4", "PADDLE_TRAINER_ID": "3"})
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("launcher", ["mpiexec", "fleetmpirun"])
def test_jobs_started_inside_another_job_pass(launcher):
    """Variables of an enclosing job (an sbatch allocation, an outer fleetmpirun) leak into a
    job started from inside it; the inner job's own launcher variables win."""
    outer = {"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
             "PADDLE_TRAINERS_NUM": "8", "PADDLE_TRAINER_ID": "5", "PMI_RANK": "5",
             "PMI_SIZE": "8", "MPI_LOCALRANKID": "5", "FLEETMPI_DEVICE": "cpu"}
    if launcher == "mpiexec":
        cmd = local_command(2, [sys.executable, JOB, "place"])
    else:
        cmd = [sys.executable, "-m", "fleetmpi.launch", "--np", "2", JOB, "place"]
    result = subprocess.run(cmd, env=dict(os.environ, **outer), capture_output=True,
                            text=True, timeout=HANG_SECONDS)
    assert result.returncode == 0, result.stdout + result.stderr
    places = sorted(re.findall(r"place rank \d+ of \d+", result.stdout))
    assert places == ["place rank 0 of 2", "place rank 1 of 2"], result.stdout


@pytest.mark.mpi(min_size=2)
def test_the_launcher_of_this_job_agrees_with_mpi():
    fleet.init()
    size = MPI.COMM_WORLD.Get_size()
    checked = [f.name for f in env_check.FAMILIES if env_check.applicable(os.environ, f, size)]
    ok(checked != [], "no launcher variables describe this job: the check checks nothing")
    env_check.verify(topology(), dict(os.environ))


@pytest.mark.mpi(min_size=2)
def test_a_wrong_rank_variable_is_refused_on_the_rank_that_has_it():
    fleet.init()
    topo = topology()
    environ = dict(os.environ, PADDLE_TRAINERS_NUM=str(topo.size), TRAINING_ROLE="TRAINER",
                   PADDLE_TRAINER_ID=str((topo.rank + 1) % topo.size))
    with raises(EnvironmentMismatchError,
                match=f"PADDLE_TRAINER_ID={(topo.rank + 1) % topo.size} but MPI says rank "
                      f"{topo.rank}"):
        env_check.verify(topo, environ)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("grouping", ["one node", "node per rank"])
def test_slurm_node_ids_are_checked_across_ranks(grouping):
    fleet.init()
    topo = topology()
    node_id = 0 if grouping == "one node" else topo.rank
    environ = dict(os.environ, SLURM_NTASKS=str(topo.size), SLURM_PROCID=str(topo.rank),
                   SLURM_LOCALID=str(topo.local_rank), SLURM_NODEID=str(node_id))
    mpi_nodes = MPI.COMM_WORLD.allgather(topo.node_index)
    if len(set(mpi_nodes)) == 1 and grouping == "node per rank":
        with raises(EnvironmentMismatchError, match="SLURM_NODEID is 0 on rank 0 and 1 on rank 1 "
                                                    "but MPI says they are on the same node"):
            env_check.verify(topo, environ)
    else:
        ok(np.array_equal(mpi_nodes, np.arange(topo.size)) or grouping == "one node")
        env_check.verify(topo, environ)

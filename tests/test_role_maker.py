"""Paddle's role makers and endpoints: what each reads, how it is checked against the MPI
world, and what fleetmpirun exports for them. Single-process tests are not marked ``mpi``;
the ``mpi`` tests check every rank of the world they run in."""
import os
import subprocess
import sys

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.launch import fleetmpirun, rank_main
from fleetmpi.config.role_maker import PaddleCloudRoleMaker, endpoint_labels

from job_limits import HANG_SECONDS


def test_user_defined_role_maker_as_paddle_writes_it():
    servers = ["10.0.0.1:6001", "10.0.0.2:6001"]
    server = fleet.UserDefinedRoleMaker(current_id=1, role=fleet.Role.SERVER, worker_num=2,
                                        server_endpoints=servers)
    assert server.is_server() and not server.is_worker() and not server.is_collective
    assert (server.world_rank(), server.server_num(), server.worker_num()) == (3, 2, 2)
    assert server.current_endpoint() == "10.0.0.2:6001"
    assert server.bind(3, 4) is server
    worker = fleet.UserDefinedRoleMaker(current_id=1, role=fleet.Role.WORKER, worker_num=2,
                                        server_num=2)
    assert worker.world_rank() == 1
    assert worker.worker_endpoints == ["127.0.0.1:6170", "127.0.0.1:6171"]
    assert worker.server_endpoints == ["127.0.0.1:6172", "127.0.0.1:6173"]
    with pytest.raises(ValueError, match="MPI rank 2 cannot be worker 1"):
        worker.bind(2, 4)
    with pytest.raises(ValueError, match="2 worker.*2 server.*MPI world has 3"):
        worker.bind(1, 3)


@pytest.mark.parametrize("kwargs,match", [
    ({"current_id": 2, "role": fleet.Role.WORKER, "worker_num": 2}, "current_id 2 is out of "
                                                                     "range for a worker"),
    ({"role": "server"}, "role must be fleetmpi.Role"),
    ({"worker_num": 0}, "worker_num must be an integer >= 1, not 0"),
    ({"server_num": 1.5}, "server_num must be an integer >= 1, not 1.5"),
    ({"server_endpoints": ["a:1", "a:1"]}, "names an endpoint twice"),
    ({"server_endpoints": "host-without-port"}, "not of the form ip:port"),
    ({"server_endpoints": ["a:1"], "server_num": 2}, "server_num=2 does not match"),
    ({"worker_num": 2, "worker_endpoints": ["a:1"]}, "lists 1 endpoint.*worker_num is 2"),
    ({"is_collective": True, "server_num": 1}, "a collective job has no servers"),
])
def test_user_defined_role_maker_names_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fleet.UserDefinedRoleMaker(**kwargs)


def test_cloud_role_maker_reads_paddle_parameter_server_variables():
    env = {"TRAINING_ROLE": "PSERVER", "PADDLE_PSERVERS_IP_PORT_LIST": "10.1.1.1:7000,"
           "10.1.1.2:7000", "PADDLE_TRAINERS_NUM": "3", "POD_IP": "10.1.1.2",
           "PADDLE_PORT": "7000"}
    server = PaddleCloudRoleMaker(is_collective=False, environ=env)
    assert (server.role, server.current_id, server.worker_num(), server.server_num()) == (
        fleet.Role.SERVER, 1, 3, 2)
    assert server.server_endpoints == ["10.1.1.1:7000", "10.1.1.2:7000"]
    server.bind(4, 5)
    worker = PaddleCloudRoleMaker(environ=dict(env, TRAINING_ROLE="TRAINER",
                                               PADDLE_TRAINER_ID="2"))
    assert worker.is_worker() and worker.current_id == 2
    worker.bind(2, 5)
    with pytest.raises(ValueError, match="POD_IP:PADDLE_PORT = '10.1.1.3:7000' is not in"):
        PaddleCloudRoleMaker(environ=dict(env, POD_IP="10.1.1.3"))
    with pytest.raises(ValueError, match="PADDLE_TRAINERS_NUM=3 but PADDLE_TRAINER_ENDPOINTS "
                                         "lists 2"):
        PaddleCloudRoleMaker(environ=dict(env, PADDLE_TRAINER_ENDPOINTS="a:1,a:2"))
    with pytest.raises(ValueError, match="TRAINING_ROLE='' must be TRAINER or PSERVER"):
        PaddleCloudRoleMaker(environ={})
    with pytest.raises(TypeError, match="unexpected argument.*'colective'"):
        PaddleCloudRoleMaker(colective=True)


def test_cloud_role_maker_collective_follows_the_world_or_the_launcher():
    alone = PaddleCloudRoleMaker(is_collective=True, environ={}).bind(2, 4)
    assert alone.worker_endpoints == endpoint_labels(4) and alone.current_id == 2
    launched = {"PADDLE_TRAINER_ENDPOINTS": "h1:1,h1:2,h2:1", "PADDLE_TRAINER_ID": "1",
                "PADDLE_CURRENT_ENDPOINT": "h1:2"}
    roles = PaddleCloudRoleMaker(is_collective=True, environ=launched).bind(1, 3)
    assert roles.worker_endpoints == ["h1:1", "h1:2", "h2:1"] and roles.server_num() == 0
    with pytest.raises(ValueError, match="PADDLE_TRAINER_ID='1' but this process is MPI rank 2"):
        PaddleCloudRoleMaker(is_collective=True, environ=launched).bind(2, 3)
    with pytest.raises(ValueError, match="PADDLE_CURRENT_ENDPOINT='h1:2' but MPI rank 0"):
        PaddleCloudRoleMaker(is_collective=True,
                             environ=dict(launched, PADDLE_TRAINER_ID="0")).bind(0, 3)
    # endpoints of another job (a world of another size) are left to that job
    other = PaddleCloudRoleMaker(is_collective=True, environ=launched).bind(0, 2)
    assert other.worker_endpoints == endpoint_labels(2)


def _parse(*argv):
    return fleetmpirun.parser().parse_args(list(argv))


def test_fleetmpirun_exports_paddles_variables_for_each_rank():
    collective = fleetmpirun.job_environment(_parse("--np", "3", "train.py"), 3)
    assert collective["PADDLE_TRAINER_ENDPOINTS"] == ",".join(endpoint_labels(3))
    env, _ = rank_main.role_variables(2, 3, 2, environ=collective)
    assert env["PADDLE_CURRENT_ENDPOINT"] == endpoint_labels(3)[2]
    roles = PaddleCloudRoleMaker(is_collective=True, environ={**collective, **env}).bind(2, 3)
    assert roles.current_endpoint() == env["PADDLE_CURRENT_ENDPOINT"]

    args = _parse("--server_num", "2", "--worker_num", "3", "train.py")
    ps = fleetmpirun.job_environment(args, 5)
    assert ps["PADDLE_PSERVERS_IP_PORT_LIST"] == ",".join(endpoint_labels(2, first=3))
    for rank in range(5):
        env, _ = rank_main.role_variables(rank, 5, rank, server_num=2, worker_num=3, environ=ps)
        roles = PaddleCloudRoleMaker(environ={**ps, **env}).bind(rank, 5)
        assert roles.current_endpoint() == endpoint_labels(5)[rank]
        if rank >= 3:
            assert f"{env['POD_IP']}:{env['PADDLE_PORT']}" == endpoint_labels(5)[rank]


def test_collective_init_with_a_role_maker_in_a_fresh_process():
    """Paddle's usual collective start, as a script runs it (fleet.init runs once per
    process, so in a process of its own)."""
    script = (
        "import fleetmpi as fleet\n"
        "from fleetmpi import role_maker\n"
        "fleet.init(role_maker.PaddleCloudRoleMaker(is_collective=True))\n"
        "print(fleet.worker_num(), fleet.worker_index(), fleet.worker_endpoints(),\n"
        "      fleet.server_endpoints(), fleet.server_num(), fleet.server_index(),\n"
        "      fleet.is_worker(), fleet.is_server(), fleet.worker_endpoints(to_string=True))\n"
        "try:\n"
        "    fleet.init_worker()\n"
        "except ValueError as exc:\n"
        "    print(type(exc).__name__, exc)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "TRAINING_"))}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=HANG_SECONDS)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "1 0 ['127.0.0.1:6170'] [] 0 -1 True False 127.0.0.1:6170"
    assert lines[1].startswith("ModeError fleet.init_worker() belongs to parameter-server mode")


def _allgather(comm, text):
    return comm.allgather(text)


@pytest.mark.mpi(min_size=2)
def test_every_rank_has_its_endpoint_under_mpiexec():
    from mpi4py import MPI

    fleet.init(fleet.PaddleCloudRoleMaker(is_collective=True))
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    ends = fleet.worker_endpoints()
    assert ends == endpoint_labels(size)
    assert _allgather(comm, ends[fleet.worker_index()]) == endpoint_labels(size)
    assert (fleet.server_num(), fleet.server_index(), fleet.server_endpoints()) == (0, -1, [])
    assert fleet.is_worker() and not fleet.is_server()
    assert fleet.worker_index() == rank
    assert np.all(np.array(_allgather(comm, fleet.worker_endpoints(to_string=True)))
                  == ",".join(endpoint_labels(size)))


def test_fleetmpirun_gives_each_rank_paddles_collective_variables(tmp_path):
    script = tmp_path / "endpoints.py"
    script.write_text(
        "import os\n"
        "import fleetmpi as fleet\n"
        "from fleetmpi import role_maker\n"
        "fleet.init(role_maker.PaddleCloudRoleMaker(is_collective=True))\n"
        "ends = fleet.worker_endpoints()\n"
        "assert os.environ['PADDLE_TRAINER_ENDPOINTS'] == ','.join(ends)\n"
        "assert os.environ['PADDLE_CURRENT_ENDPOINT'] == ends[fleet.worker_index()]\n"
        "assert os.environ['PADDLE_TRAINER_ID'] == str(fleet.worker_index())\n"
        "print(f'rank {fleet.worker_index()} is {ends[fleet.worker_index()]}', flush=True)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "TRAINING_"))}
    done = subprocess.run([sys.executable, "-m", "fleetmpi.launch", "--np", "2", str(script)],
                          capture_output=True, text=True, env=env, timeout=HANG_SECONDS)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for rank, endpoint in enumerate(endpoint_labels(2)):
        assert f"rank {rank} is {endpoint}" in output, output


def test_role_makers_answer_before_fleet_init():
    """Paddle's queries of a role maker answer from its variables or the MPI world, with no
    fleet.init; the base class needs no arguments (a collective worker placed by MPI)."""
    from mpi4py import MPI

    from fleetmpi.config.role_maker import RoleMakerBase

    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    for roles in (RoleMakerBase(), PaddleCloudRoleMaker(is_collective=True, environ={})):
        assert (roles.worker_num(), roles.worker_index()) == (size, rank)
        assert roles.is_worker() and not roles.is_server() and roles.server_num() == 0
        assert roles.is_first_worker() == (rank == 0)
    env = {"TRAINING_ROLE": "PSERVER", "PADDLE_PSERVERS_IP_PORT_LIST": "h:1,h:2,h:3",
           "PADDLE_TRAINERS_NUM": "4", "POD_IP": "h", "PADDLE_PORT": "3"}
    server = PaddleCloudRoleMaker(environ=env)
    assert (server.worker_num(), server.server_num(), server.server_index()) == (4, 3, 2)
    assert server.is_server() and not server.is_worker() and server.worker_index() == 2
    worker = PaddleCloudRoleMaker(environ=dict(env, TRAINING_ROLE="TRAINER",
                                               PADDLE_TRAINER_ID="3"))
    assert (worker.worker_num(), worker.worker_index(), worker.is_worker()) == (4, 3, True)
    with pytest.raises(fleet.ModeError, match="server_index: this process is worker 3"):
        worker.server_index()


def test_a_collective_role_maker_answers_before_init_on_every_rank_of_fleetmpirun(tmp_path):
    script = tmp_path / "early.py"
    script.write_text(
        "import fleetmpi as fleet\n"
        "from fleetmpi import role_maker\n"
        "roles = role_maker.PaddleCloudRoleMaker(is_collective=True)\n"
        "early = (roles.worker_num(), roles.worker_index(), roles.is_worker(),"
        " roles.is_server())\n"
        "fleet.init(roles)\n"
        "late = (fleet.worker_num(), fleet.worker_index(), fleet.is_worker(), fleet.is_server())\n"
        "assert early == late, (early, late)\n"
        "print(f'rank {late[1]} of {late[0]} answered early', flush=True)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "TRAINING_"))}
    done = subprocess.run([sys.executable, "-m", "fleetmpi.launch", "--np", "2", str(script)],
                          capture_output=True, text=True, env=env, timeout=HANG_SECONDS)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for rank in range(2):
        assert f"rank {rank} of 2 answered early" in output, output

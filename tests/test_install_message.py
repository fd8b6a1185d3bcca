"""Without an MPI library, ``import fleetmpi`` (and so ``fleetmpirun`` and the planner) ends
with one short message saying how to get one, not mpi4py's page of loader errors."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("command", [["-c", "import fleetmpi"],
                                     ["-m", "fleetmpi.launch", "--help"],
                                     ["-m", "fleetmpi.plan", "--help"]])
def test_without_an_mpi_library_the_message_says_how_to_get_one(command):
    # mpi4py loads the library MPI4PY_LIBMPI names first: a path that does not exist stands
    # for a machine without MPI
    env = dict(os.environ, MPI4PY_LIBMPI=os.path.join(ROOT, "no-such-dir", "libmpi.so"))
    done = subprocess.run([sys.executable] + command, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: fleetmpi needs an MPI library, and mpi4py found none")
    assert "pip install 'fleetmpi[mpi]'" in last and "--no-binary mpi4py" in last
    assert len(done.stderr.strip().splitlines()) <= 8, done.stderr


def test_the_mpi_extra_and_the_python_versions_are_declared():
    import configparser

    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    extras = config["options.extras_require"]
    assert any(line.strip().startswith("mpich") for line in extras["mpi"].splitlines())
    for extra in ("test", "examples"):
        assert any(line.strip().startswith("mpich") for line in extras[extra].splitlines())
    # protobuf>=7.35.1 (install_requires) has wheels for Python 3.10 and later only
    assert config["options"]["python_requires"].strip() == ">=3.10"

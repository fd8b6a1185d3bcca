"""A missing package is said in one line naming the ``pip install`` that brings it, with no
traceback and once per node (not by every rank): no MPI library at ``import fleetmpi`` (and so
``fleetmpirun`` and the planner), an example's extra, the planner's matplotlib. An old Python
is refused before pip resolves anything."""
import configparser
import glob
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

from fleetmpi.launch.mpi_command import local_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def setup_cfg():
    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    return config


def hiding(tmp_path, *packages):
    """The environment of a Python where importing each of ``packages`` fails, as where it is
    not installed (a package of that name first on the path, raising ImportError)."""
    for package in packages:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(
            f'raise ImportError("No module named {package!r} (hidden by the test)")\n')
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))


def said(done):
    """The lines a command wrote, both streams, blank ones left out."""
    return [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]


@pytest.mark.parametrize("command", [["-c", "import fleetmpi"],
                                     ["-m", "fleetmpi.launch", "--help"],
                                     ["-m", "fleetmpi.plan", "--help"]])
def test_without_an_mpi_library_the_message_says_how_to_get_one(command):
    # mpi4py loads the library MPI4PY_LIBMPI names first: a path that does not exist stands
    # for a machine without MPI
    env = dict(os.environ, MPI4PY_LIBMPI=os.path.join(ROOT, "no-such-dir", "libmpi.so"))
    done = subprocess.run([sys.executable] + command, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1
    [line] = said(done)
    assert line.startswith("fleetmpi needs an MPI library (mpi4py: ")
    assert "pip install 'fleetmpi[mpi]'" in line and "--no-binary mpi4py" in line
    assert "'fleetmpi[examples]'" in line  # what the examples' one install brings


@pytest.mark.parametrize("ranks", [1, 2])
def test_an_example_without_its_extra_says_so_in_one_line_once(tmp_path, ranks):
    program = [sys.executable, os.path.join(ROOT, "examples", "train_digits.py"), "--epochs",
               "1"]
    command = program if ranks == 1 else local_command(ranks, program)
    done = subprocess.run(command, env=hiding(tmp_path, "sklearn"), capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode != 0
    assert said(done) == ["the digits dataset needs scikit-learn: "
                          "pip install 'fleetmpi[examples]'"], done.stdout + done.stderr


@pytest.mark.parametrize("png", [True, False])
def test_the_planner_without_matplotlib_ends_with_one_line_naming_the_extra(tmp_path, png):
    args = ["--model", "mlp:8,8", "--compute-ms", "1", "--max-ranks", "4"]
    args += ["--png", str(tmp_path / "x.png")] if png else []
    done = subprocess.run([sys.executable, "-m", "fleetmpi.plan", *args], cwd=tmp_path,
                          env=hiding(tmp_path, "matplotlib"), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == (1 if png else 0)  # asked for a PNG, or only the default one
    assert "| efficiency |" in done.stdout  # the tables came first
    assert said(done)[-1] == ("--png (drawing the scaling curves) needs matplotlib: "
                              "pip install 'fleetmpi[plan]'")
    assert "Traceback" not in done.stderr and not glob.glob(str(tmp_path / "*.png"))


def test_the_extras_are_declared():
    extras = setup_cfg()["options.extras_require"]
    for extra in ("mpi", "test", "examples"):
        assert any(line.strip().startswith("mpich") for line in extras[extra].splitlines())
    # threadpoolctl shares a node's cores between its ranks: every install has it
    assert "threadpoolctl" in setup_cfg()["options"]["install_requires"]


def load_setup_py():
    spec = importlib.util.spec_from_file_location("fleetmpi_setup", os.path.join(ROOT,
                                                                               "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not as __main__: defines, builds nothing
    return module


def test_an_old_python_is_refused_in_one_line_before_dependencies():
    setup = load_setup_py()
    # protobuf>=7.35.1 (install_requires) has wheels for Python 3.10 and later only
    assert setup.required_python() == (">=3.10", (3, 10))
    assert setup_cfg()["options"]["python_requires"].strip() == ">=3.10"
    refusal = setup.python_refusal((3, 9, 18, "final", 0), "3.9.18")
    assert refusal.startswith("fleetmpi requires Python >= 3.10 (this is Python 3.9.18)")
    assert setup.python_refusal((3, 10, 0, "final", 0), "3.10.0") is None
    assert setup.python_refusal(sys.version_info, "this one") is None


def old_pythons():
    """Interpreters older than 3.10 that run on this machine (pyenv's, then PATH's), newest
    first."""
    pyenv = os.path.join(os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv")),
                         "versions")
    found = sorted(glob.glob(os.path.join(pyenv, "3.[6-9].*", "bin", "python3")), reverse=True)
    found += [shutil.which(f"python3.{minor}") for minor in range(9, 5, -1)]
    return [path for path in found if path and subprocess.run(
        [path, "-c", "pass"], capture_output=True, timeout=60).returncode == 0]


def test_an_old_python_building_the_metadata_gets_the_line_not_a_resolver_error():
    """What pip runs first for ``pip install -e .`` (the build's setup.py), under an old
    Python where this machine has one."""
    pythons = old_pythons()
    if not pythons:
        pytest.skip("no Python older than 3.10 here; the refusal itself is tested above")
    done = subprocess.run([pythons[0], "setup.py", "egg_info"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1
    [line] = said(done)
    assert line.startswith("fleetmpi requires Python >= 3.10 (this is Python 3.")


@pytest.mark.parametrize("local_rank, warned", [(0, True), (1, False)])
def test_without_threadpoolctl_only_the_first_rank_of_a_node_says_so(monkeypatch,
                                                                      fleetmpi_warnings,
                                                                      local_rank, warned):
    from fleetmpi.core import backend, knobs

    monkeypatch.setitem(sys.modules, "threadpoolctl", None)  # import threadpoolctl fails
    monkeypatch.setenv(knobs.NUM_THREADS.name, "1")
    monkeypatch.setattr(backend, "_local_rank", lambda: local_rank)
    assert backend.limit_cpu_threads() is None
    said = [m for m in fleetmpi_warnings() if "threadpoolctl is not installed" in m]
    assert len(said) == (1 if warned else 0)

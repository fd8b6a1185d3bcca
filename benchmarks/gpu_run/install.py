"""The offline install: the carried wheels, then fleetmpi itself, under one prefix whose
site-packages folder the stages put first on ``PYTHONPATH``; nothing is downloaded
(``--no-index``). A prefix rather than ``pip install --target``, which drops the libraries a
wheel installs outside site-packages (the MPICH wheel's ``lib/libmpi.so.12``); and
``--ignore-installed``, without which pip would uninstall what the active environment holds of
the same names (a developer's editable fleetmpi), or install nothing where it holds the same
version.

fleetmpi must be installed, not only put on the path: setup.cfg maps the folders ``comm/``,
``strategies/``, ``proto/`` and ``launch/`` into the ``fleetmpi`` namespace. A wheel built for
another Python or platform (a cp312 wheel in a dry run on another Python) is listed as not
installed. fleetmpi is built from a clean copy of the tree, with the carried wheels on the
path, so that a carried ``wheel`` serves a setuptools too old to build wheels alone.
``pip-*.whl`` is the installer where the Python has no pip of its own (pip runs from its wheel
file), and is not installed.
"""
import glob
import os
import shutil
import subprocess
import sys

from .process import run_bounded

PIP_WHEEL = "pip-"


def _compatible(path):
    """Whether this Python can install the wheel at ``path`` (True where no ``packaging`` can
    tell; pip then decides)."""
    try:
        from packaging.tags import sys_tags
        from packaging.utils import parse_wheel_filename
    except ImportError:
        try:
            from pip._vendor.packaging.tags import sys_tags
            from pip._vendor.packaging.utils import parse_wheel_filename
        except ImportError:
            return True
    tags = parse_wheel_filename(os.path.basename(path))[3]
    return not tags.isdisjoint(sys_tags())


def pip_command(wheels):
    """This Python's pip, or pip run from a carried ``pip-*.whl``."""
    found = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
    if found.returncode == 0:
        return [sys.executable, "-m", "pip"]
    carried = sorted(glob.glob(os.path.join(wheels, PIP_WHEEL + "*.whl")))
    if not carried:
        raise RuntimeError(f"{sys.executable} has no pip and {wheels} carries no pip wheel")
    return [sys.executable, os.path.join(carried[-1], "pip")]


def site_packages(prefix):
    """The folder under ``prefix`` where pip put the Python packages, or None."""
    found = sorted(glob.glob(os.path.join(prefix, "**", "site-packages"), recursive=True)
                   + glob.glob(os.path.join(prefix, "**", "dist-packages"), recursive=True))
    return found[0] if found else None


def clean_copy(repo, dest):
    """Copy the project's files to ``dest``, leaving out ``.git`` and what ``.gitignore``
    names: pip builds in the tree it is given, and a ``build/`` folder left there by an
    earlier build would put modules deleted since into the wheel."""
    with open(os.path.join(repo, ".gitignore")) as f:
        ignored = [line.strip().strip("/") for line in f
                   if line.strip() and not line.startswith("#")]
    shutil.copytree(repo, dest, ignore=shutil.ignore_patterns(".git", *ignored))
    return dest


def choose_wheels(wheels):
    """``(paths to install, [{"wheel", "why"}] of those left out)`` of the folder ``wheels``."""
    if not os.path.isdir(wheels) or not glob.glob(os.path.join(wheels, "*.whl")):
        return [], [{"wheel": wheels, "why": "no wheels there: nothing carried"}]
    chosen, left_out = [], []
    for path in sorted(glob.glob(os.path.join(wheels, "*.whl"))):
        name = os.path.basename(path)
        if name.startswith(PIP_WHEEL):
            left_out.append({"wheel": name, "why": "the installer, for a Python without pip"})
        elif _compatible(path):
            chosen.append(path)
        else:
            left_out.append({"wheel": name, "why": "built for another Python or platform"})
    return chosen, left_out


def install_offline(wheels, repo, scratch, timeout_s, log_dir):
    """Install under the folder ``scratch/prefix``; returns the stage's record: ``status``,
    what was ``installed``, the wheels ``not_installed`` (with why), the ``prefix``, the
    ``site`` folder that holds the packages, and ``reason`` where something failed."""
    prefix = os.path.join(scratch, "prefix")
    chosen, left_out = choose_wheels(wheels)
    record = {"installed": [], "not_installed": left_out, "prefix": prefix, "wheels": wheels}
    pip = pip_command(wheels) + ["install", "--no-index", "--no-deps", "--ignore-installed",
                                 "--prefix", prefix, "--disable-pip-version-check",
                                 "--no-input", "-q"]
    steps = [("wheels", pip + chosen, [os.path.basename(p) for p in chosen])] if chosen else []
    source = clean_copy(repo, os.path.join(scratch, "source"))
    steps.append(("fleetmpi", pip + ["--no-build-isolation", source], ["fleetmpi (this tree)"]))
    seconds = 0.0
    for label, cmd, names in steps:
        # fleetmpi's build sees the carried wheels (``wheel`` for a setuptools before 70.1)
        record["site"] = site_packages(prefix)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (record["site"], os.environ.get("PYTHONPATH")) if p))
        done = run_bounded(cmd, env, scratch, timeout_s - seconds,
                           os.path.join(log_dir, f"install-{label}.log"))
        seconds += done.seconds
        if done.returncode != 0 or done.timed_out:
            ended = "timed out" if done.timed_out else f"exited {done.returncode}"
            record.update(status="failed", seconds=round(seconds, 1), tail=done.tail(12),
                          site=site_packages(prefix), reason=f"pip install of {label} {ended}")
            return record
        record["installed"] += names
    record.update(status="passed", seconds=round(seconds, 1), site=site_packages(prefix))
    return record

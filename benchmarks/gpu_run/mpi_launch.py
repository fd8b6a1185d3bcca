"""Which MPI launches the multi-rank stages: the first environment under which fleetmpi's own
launcher starts 2 ranks that see each other (``probe_mpi.py``).

The machine's mpi4py may be built against an MPI of its own, or find none. So two ways are
tried in turn: the environment as installed (mpi4py's MPI with the ``mpiexec`` that
``fleetmpi.launch.mpi_command.find_mpiexec`` finds), then the MPICH carried as a wheel (mpi4py
pointed at its ``libmpi`` with ``MPI4PY_LIBMPI``, its ``mpiexec`` first on ``PATH``); each way
as it is, then with MPI's transports kept to shared memory (``probe_mpi.py``).
"""
import os
import sys

from .process import run_bounded

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "probe_mpi.py")
CARRIED_LIBMPI = os.path.join("lib", "libmpi.so.12")


def candidates(prefix, environ):
    """``(name, variables to set)`` for each way to try; ``prefix``: the install's."""
    ways = [("as installed", {})]
    libmpi = os.path.join(prefix, CARRIED_LIBMPI) if prefix else None
    if libmpi and os.path.exists(libmpi):
        ways.append(("carried MPICH wheel", {
            "MPI4PY_LIBMPI": libmpi,
            "PATH": os.pathsep.join([os.path.join(prefix, "bin"), environ.get("PATH", "")]),
        }))
    return ways


def _judge(name, done):
    """The record of one try from its finished probe."""
    found = done.result()
    if found is None:
        ended = "timed out" if done.timed_out else f"exited {done.returncode}"
        return {"name": name, "ok": False,
                "why": f"the probe {ended}: " + " | ".join(done.tail(5))}
    hello = found.get("hello") or {}
    record = {"name": name, "ok": bool(hello.get("ok")), "library": found.get("library"),
              "command": " ".join(hello.get("command", [])),
              "variables": hello.get("variables", {})}
    if not record["ok"]:
        record["why"] = found.get("error") or ("2 ranks did not see each other: "
                                               + hello.get("output", "").strip()[-400:])
    return record


def choose_launcher(environ, prefix, cwd, timeout_s, log_dir):
    """``(variables to set or None, record)``: the first way whose 2 ranks see each other, and
    every try with why it failed."""
    tries = []
    ways = candidates(prefix, environ)
    for index, (name, extra) in enumerate(ways):
        seconds = timeout_s / len(ways)
        done = run_bounded([sys.executable, PROBE, str(seconds * 0.8)], dict(environ, **extra),
                           cwd, seconds, os.path.join(log_dir, f"mpi-probe-{index}.log"))
        tries.append(_judge(name, done))
        if tries[-1]["ok"]:
            return dict(extra, **tries[-1]["variables"]), {"chosen": name, "tries": tries}
    return None, {"chosen": None, "tries": tries}

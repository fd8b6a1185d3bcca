"""Print whether fleetmpi's launcher starts 2 ranks that see each other in this environment,
as one JSON object on a line that starts with ``RESULT``: the MPI library mpi4py loads, the
``mpiexec`` command ``fleetmpi.launch.mpi_command.local_command`` builds (the one
``tests/mpi_pytest.py`` and ``benchmarks/train_throughput.py`` use) and what
``python -m mpi4py.bench helloworld`` said under it. Two ranks that each see a world of one
mean that mpi4py's MPI is not the launcher's.

Run as a script in the environment to be judged; it never raises.
"""
import json
import re
import subprocess
import sys

RANKS = 2
TIMEOUT_S = 60


def library():
    import mpi4py

    mpi4py.rc.initialize = False
    from mpi4py import MPI

    return " ".join(MPI.Get_library_version().split("\n")[0].split())


def hello():
    from fleetmpi.launch.mpi_command import local_command

    cmd = local_command(RANKS, [sys.executable, "-m", "mpi4py.bench", "helloworld"])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    sizes = [int(n) for n in re.findall(r"I am process \d+ of (\d+)", done.stdout)]
    found = {"command": cmd, "ok": done.returncode == 0 and sizes == [RANKS] * RANKS}
    if not found["ok"]:
        found["output"] = (done.stdout + done.stderr)[-800:]
    return found


def probe_launch():
    found = {}
    for key, part in (("library", library), ("hello", hello)):
        try:
            found[key] = part()
        except Exception as exc:  # noqa: BLE001 - the probe reports every failure as text
            found[key] = None
            found["error"] = f"{key}: {type(exc).__name__}: {exc}"[:800]
            break
    return found


if __name__ == "__main__":
    print("RESULT " + json.dumps(probe_launch()))

"""Print whether fleetmpi's launcher starts 2 ranks that see each other in this environment,
as one JSON object on a line that starts with ``RESULT``: the MPI library mpi4py loads, the
``mpiexec`` command ``fleetmpi.launch.mpi_command.local_command`` builds (the one
``tests/mpi_pytest.py`` and ``benchmarks/train_throughput.py`` use) and what two fleetmpi ranks
said under it: each joins the job with ``fleet.init`` and allreduces its rank over the MPI
transport, as the multi-rank stage's ranks do first (mpi4py's own hello world passed on an
H200's Open MPI 4.1 where the stage's ranks then exited at once, saying nothing). Two ranks
that each see a world of one mean that mpi4py's MPI is not the launcher's. Where the ranks
fail as the environment is, they are started again with MPI's transports kept to shared memory
(``fleetmpi.core.launcher_env.LOCAL_TRANSPORT_ENV``, what ``fleetmpirun`` sets on one
host), and the variables that made them start are reported.

    python probe_mpi.py SECONDS

Run as a script in the environment to be judged, with the seconds it may take; it never
raises.
"""
import json
import os
import re
import subprocess
import sys

RANKS = 2
# One rank of the probe: what the multi-rank stage's ranks do before their tests.
RANK_PROGRAM = (
    "import os; os.environ['FLEETMPI_TRANSPORT'] = 'mpi'; import fleetmpi as fleet; "
    "from fleetmpi.comm import get_communicator; from fleetmpi.core import backend; "
    "fleet.init(is_collective=True); rank, size = fleet.worker_index(), fleet.worker_num(); "
    "total = backend.to_numpy(get_communicator().allreduce(backend.asarray([rank], 'float32')));"
    " print(f'I am process {rank} of {size}: sum {total[0]:g}', flush=True)")


def saw_each_other(returncode, stdout):
    """Whether every rank said it is one of ``RANKS`` and that the allreduce summed the ranks.
    ``mpiexec`` may join two ranks' lines (one's text, the other's, then both newlines)."""
    said = re.findall(r"I am process \d+ of (\d+): sum (\d+)", stdout)
    return returncode == 0 and said == [(str(RANKS), f"{sum(range(RANKS)):g}")] * RANKS


def library():
    import mpi4py

    mpi4py.rc.initialize = False
    from mpi4py import MPI

    return " ".join(MPI.Get_library_version().split("\n")[0].split())


def hello(seconds):
    """``{"command", "ok", "variables"}`` (or ``"output"`` where no try started the ranks)."""
    from fleetmpi.core.launcher_env import LOCAL_TRANSPORT_ENV
    from fleetmpi.launch.mpi_command import local_command

    cmd = local_command(RANKS, [sys.executable, "-c", RANK_PROGRAM])
    local = {name: value for name, value in LOCAL_TRANSPORT_ENV.items() if name not in os.environ}
    found = {"command": cmd, "ok": False, "output": ""}
    for variables in [{}, local] if local else [{}]:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds / 2,
                                  env=dict(os.environ, **variables))
        except subprocess.TimeoutExpired:
            found["output"] += f"[{variables or 'as is'}: no answer in {seconds / 2:.0f} s] "
            continue
        if saw_each_other(done.returncode, done.stdout):
            return {"command": cmd, "ok": True, "variables": variables}
        found["output"] += f"[{variables or 'as is'}: {(done.stdout + done.stderr)[-400:]}] "
    return found


def probe_launch(seconds):
    found = {}
    for key, part in (("library", library), ("hello", lambda: hello(seconds))):
        try:
            found[key] = part()
        except Exception as exc:  # noqa: BLE001 - the probe reports every failure as text
            found[key] = None
            found["error"] = f"{key}: {type(exc).__name__}: {exc}"[:800]
            break
    return found


if __name__ == "__main__":
    print("RESULT " + json.dumps(probe_launch(float(sys.argv[1]))))

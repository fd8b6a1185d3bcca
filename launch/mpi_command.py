"""The ``mpiexec`` command line of the installed MPI, for Open MPI and MPICH (hydra).

The two launchers spell the same request differently; this module is the one place that
knows both spellings:

| request                     | MPICH (hydra)        | Open MPI                          |
| --------------------------- | -------------------- | --------------------------------- |
| hosts                       | ``-hosts h1,h2``     | ``--host h1:k,h2:k``              |
| host file                   | ``-f FILE``          | ``--hostfile FILE``               |
| its slot counts             | ``host:4``           | ``host slots=4``                  |
| k ranks per host            | ``-ppn k``           | ``--map-by ppr:k:node``           |
| environment to every rank   | ``-genvall``         | ``-x NAME`` for each variable     |
| a variable set for the job  | ``-genv NAME VALUE`` | ``-x NAME=VALUE``                 |
| more ranks than cores       | allowed              | ``--oversubscribe``               |
| started by root             | allowed              | ``--allow-run-as-root``           |

On one host, MPICH's ranks are started by ``mpiexec.gforker`` instead of hydra where the MPI
has it (the MPICH wheel installs it beside ``mpiexec``): gforker forks the ranks and speaks PMI
to them over inherited file descriptors, so it opens no socket, where hydra's control port
listens on every interface. It takes ``-n``, ``-genv NAME VALUE`` and passes its own
environment to the ranks (``-genvall`` is hydra's spelling of that, and gforker refuses it);
it places ranks on no other host. ``fleetmpi.core.launcher_env.LOCAL_TRANSPORT_ENV`` keeps the
ranks' own transport on shared memory, so that it opens no listener either (docs/launch.md,
"Network").
"""
import os
import shutil
import subprocess
import sys

OPEN_MPI = "openmpi"
MPICH = "mpich"
FLAVOURS = (OPEN_MPI, MPICH)
# MPICH's two process managers: hydra (``mpiexec``, any hosts) and gforker (one host, no socket).
HYDRA = "hydra"
GFORKER = "gforker"
GFORKER_NAME = "mpiexec.gforker"
# The options gforker takes from ``--mpi_args``, with the number of values each takes; hydra's
# others (``-bind-to``, ``-ppn``, ``-hosts``, ...) need hydra. ``-genvall`` is gforker's
# default, so it is dropped rather than passed.
GFORKER_OPTIONS = {"-l": 0, "-exitinfo": 0, "-genvnone": 0, "-envnone": 0, "-genvall": 0,
                   "-usize": 1, "-maxtime": 1, "-soft": 1, "-wdir": 1, "-path": 1,
                   "-genvlist": 1, "-envlist": 1, "-genv": 2, "-env": 2}
# Variables Open MPI forwards to the ranks on other hosts with ``-x`` (hydra forwards all).
EXPORTED_PREFIXES = ("FLEETMPI_", "PADDLE_", "FLAGS_", "CUDA_", "NCCL_", "OMP_")
EXPORTED_NAMES = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV")


def find_mpiexec():
    """The ``mpiexec`` beside this Python (the registry wheel in a venv), else the first
    ``mpiexec`` or ``mpirun`` on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(beside):
        return beside
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError(
        "no mpiexec or mpirun found beside this Python or on PATH: install an MPI "
        "(pip install mpich, or Open MPI from the system's packages)")


def find_gforker(mpiexec):
    """MPICH's ``mpiexec.gforker`` beside ``mpiexec`` (a path, or a name on PATH), or None."""
    if os.path.basename(mpiexec) == GFORKER_NAME:
        return mpiexec
    found = shutil.which(mpiexec) if os.sep not in mpiexec else mpiexec
    if not found:
        return None
    beside = os.path.join(os.path.dirname(os.path.abspath(found)), GFORKER_NAME)
    return beside if os.path.isfile(beside) and os.access(beside, os.X_OK) else None


def gforker_arguments(extra_args):
    """``extra_args`` (``--mpi_args``) as gforker takes them (``-genvall`` dropped), or None
    when one of them is not gforker's (then hydra must start the job)."""
    kept, index = [], 0
    while index < len(extra_args):
        word = extra_args[index]
        count = GFORKER_OPTIONS.get(word)
        if count is None or index + count >= len(extra_args):
            return None
        if word != "-genvall":
            kept += extra_args[index:index + count + 1]
        index += count + 1
    return kept


def detect_flavour(mpiexec):
    """``"openmpi"`` or ``"mpich"``, from what ``mpiexec --version`` says (MPICH's
    ``mpiexec.gforker``, which has no ``--version``, is known by its name)."""
    if os.path.basename(mpiexec) == GFORKER_NAME:
        return MPICH
    try:
        result = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                                timeout=60)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{mpiexec} --version did not answer within 60 s") from None
    text = result.stdout + result.stderr
    if "Open MPI" in text or "OpenRTE" in text or "PRRTE" in text:
        return OPEN_MPI
    if "HYDRA" in text or "MPICH" in text or "Intel(R) MPI" in text:
        return MPICH
    raise RuntimeError(f"{mpiexec} --version names neither Open MPI nor MPICH (hydra); "
                       f"fleetmpirun supports those two. It said: {text.strip()[:200]!r}")


def exported_names(environ):
    """The variables of ``environ`` that Open MPI is asked to forward with ``-x``."""
    return sorted(name for name in environ
                  if name in EXPORTED_NAMES or name.startswith(EXPORTED_PREFIXES))


def mpiexec_command(flavour, mpiexec, np, program, hosts=None, hostfile=None,
                  ranks_per_host=None, extra_args=(), environ=None, as_root=None, job_env=None,
                  process_manager=HYDRA):
    """The whole ``mpiexec`` argument list that starts ``np`` copies of ``program``.

    ``hosts`` (a list of host names, each may carry a slot count as ``host:4``, which both
    launchers read) and ``hostfile`` are exclusive; ``ranks_per_host`` places that many
    consecutive ranks on each host (give it with plain host names); ``extra_args`` go to the
    MPI launcher as given, before the program. ``environ`` (default ``os.environ``) chooses
    Open MPI's ``-x`` names; ``as_root`` (default: the effective user is root) adds
    ``--allow-run-as-root``.
    ``job_env`` (name -> value) are variables set for every rank on every host, named on the
    command line so that they reach other hosts whatever the launcher forwards by default.
    ``process_manager`` ``"gforker"`` (MPICH only) starts the ranks on this host with
    ``mpiexec.gforker``: ``mpiexec`` is then its path, and no hosts can be given.
    """
    if flavour not in FLAVOURS:
        raise ValueError(f"MPI flavour {flavour!r} is not supported; allowed: {FLAVOURS}")
    if hosts and hostfile:
        raise ValueError("give hosts or a hostfile, not both")
    if np < 1:
        raise ValueError(f"number of ranks must be at least 1, got {np}")
    environ = os.environ if environ is None else environ
    job_env = dict(job_env or {})
    as_root = os.geteuid() == 0 if as_root is None else as_root
    cmd = [mpiexec, "-n", str(np)]
    if process_manager == GFORKER:
        if flavour != MPICH:
            raise ValueError("mpiexec.gforker is MPICH's; Open MPI has no such launcher")
        if hosts or hostfile or ranks_per_host:
            raise ValueError("mpiexec.gforker starts ranks on this host only; hosts need "
                             "hydra (mpiexec)")
        for name, value in sorted(job_env.items()):
            cmd += ["-genv", name, value]
    elif flavour == MPICH:
        if hosts:
            cmd += ["-hosts", ",".join(hosts)]
        if hostfile:
            cmd += ["-f", hostfile]
        if ranks_per_host:
            cmd += ["-ppn", str(ranks_per_host)]
        cmd.append("-genvall")
        for name, value in sorted(job_env.items()):
            cmd += ["-genv", name, value]
    else:
        cmd.append("--oversubscribe")
        if as_root:
            cmd.append("--allow-run-as-root")
        if hosts:
            slots = f":{ranks_per_host}" if ranks_per_host else ""
            cmd += ["--host", ",".join(host + slots for host in hosts)]
        if hostfile:
            cmd += ["--hostfile", hostfile]
        if ranks_per_host:
            cmd += ["--map-by", f"ppr:{ranks_per_host}:node"]
        for name in exported_names(environ):
            if name not in job_env:
                cmd += ["-x", name]
        for name, value in sorted(job_env.items()):
            cmd += ["-x", f"{name}={value}"]
    return cmd + list(extra_args) + list(program)


def local_command(np, program=()):
    """``mpiexec -n np program`` on this machine with the installed MPI, whichever it is."""
    mpiexec = find_mpiexec()
    return mpiexec_command(detect_flavour(mpiexec), mpiexec, np, program)

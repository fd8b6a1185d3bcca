"""``fleetmpirun --slurm``: start the ranks with ``srun`` inside a Slurm allocation.

    #SBATCH --ntasks=8
    fleetmpirun --slurm train.py --epochs 2

Inside ``sbatch`` or ``salloc`` Slurm already holds the nodes and tasks, so the ranks are Slurm
tasks started by ``srun`` rather than by ``mpiexec``. srun also serves them the
process-management interface from which their MPI builds one world: PMI-2 for MPICH (the
mpich wheel from PyPI included), PMIx for Open MPI. Without it every task would start as an
MPI world of its own. ``--kill-on-bad-exit=1`` ends the whole step when a rank exits non-zero,
so a failing rank cannot leave the others waiting in a collective.

An ``--mpi=...`` of the user's in ``--mpi_args`` replaces the plugin chosen here.
"""
import os
import shlex
import shutil
import subprocess

from . import mpi_command

PMI2 = "pmi2"
PMIX = "pmix"
# The plugin each MPI flavour's ranks build their world from under srun.
PLUGIN_OF_FLAVOUR = {mpi_command.MPICH: PMI2, mpi_command.OPEN_MPI: PMIX}


def require_allocation(environ):
    """ValueError unless ``environ`` is that of a process inside a Slurm allocation."""
    if not environ.get("SLURM_JOB_ID"):
        raise ValueError(
            "--slurm starts the ranks with srun inside a Slurm allocation, but SLURM_JOB_ID is "
            "not set: call fleetmpirun --slurm from a batch script (sbatch) or an salloc "
            "shell, or leave out --slurm to start the ranks with mpiexec")


def find_srun():
    found = shutil.which("srun")
    if found is None:
        raise FileNotFoundError("--slurm needs Slurm's srun, and there is none on PATH")
    return found


def available_plugins(srun):
    """The MPI plugin names ``srun --mpi=list`` reports (e.g. ``["none", "pmi2", "pmix"]``)."""
    result = subprocess.run([srun, "--mpi=list"], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"{srun} --mpi=list failed with exit code {result.returncode}: "
                           f"{(result.stdout + result.stderr).strip()[:300]!r}")
    return parse_plugin_list(result.stdout + result.stderr)


def parse_plugin_list(text):
    """The plugin names of ``srun --mpi=list`` output: one indented name a line (Slurm 22-23),
    or ``srun: name`` lines (older Slurm); the lines that describe the list are skipped."""
    names = []
    for line in text.splitlines():
        word = line.strip()
        if word.startswith("srun:"):
            word = word[len("srun:"):].strip()
        if word and " " not in word and not word.endswith(":"):
            names.append(word)
    return names


def mpi_plugin(flavour, plugins):
    """The ``srun --mpi`` plugin for an MPI of ``flavour``, checked against ``plugins``."""
    if flavour not in PLUGIN_OF_FLAVOUR:
        raise ValueError(f"MPI flavour {flavour!r} is not supported; "
                         f"allowed: {tuple(PLUGIN_OF_FLAVOUR)}")
    wanted = PLUGIN_OF_FLAVOUR[flavour]
    if not any(name == wanted or name.startswith(wanted + "_") for name in plugins):
        raise ValueError(
            f"{flavour} ranks build their MPI world from srun's {wanted} plugin, but srun "
            f"--mpi=list offers only {', '.join(plugins) or 'none'}: ask the cluster's "
            f"administrators for it, or name another plugin with --mpi_args=--mpi=NAME")
    return wanted


def _count(environ, name):
    value = environ.get(name, "")
    return int(value) if value.isdigit() else None


def srun_layout(args, environ, exclude=()):
    """``(np, ranks_per_node)`` of the srun step; either is None where srun is left to take it
    from the allocation. ``exclude`` are nodes of the allocation left out (an elastic restart).
    ValueError names a conflict."""
    if args.ips or args.hostfile:
        raise ValueError("--slurm runs on the allocation's nodes; --ips and --hostfile are not "
                         "allowed with it (ask sbatch or salloc for --nodes instead)")
    if args.np is not None and args.np < 1:
        raise ValueError(f"--np must be at least 1, got {args.np}")
    gpus = [gpu for gpu in (args.gpus or "").split(",") if gpu.strip()]
    nodes = _count(environ, "SLURM_JOB_NUM_NODES") or _count(environ, "SLURM_NNODES") or 1
    nodes = max(nodes - len(exclude), 1)
    implied, why = None, None
    if args.server_num or args.worker_num:
        if args.server_num < 1 or args.worker_num < 1:
            raise ValueError(f"parameter-server mode needs --server_num and --worker_num "
                             f"both at least 1, got {args.server_num} and {args.worker_num}")
        implied, why = args.server_num + args.worker_num, "--server_num + --worker_num"
    elif gpus:
        implied = len(gpus) * nodes
        why = f"{len(gpus)} GPU(s) in --gpus on each of the allocation's {nodes} node(s)"
    if implied is not None and args.np is not None and args.np != implied:
        raise ValueError(f"--np {args.np} does not match {why}, which make {implied} ranks")
    np = args.np if args.np is not None else implied
    if np is None:
        np = _count(environ, "SLURM_NTASKS") or _count(environ, "SLURM_NPROCS")
    return np, (len(gpus) if gpus and not args.server_num else None)


def names_plugin(srun_args):
    """Whether ``srun_args`` choose the MPI plugin (``--mpi=NAME`` or ``--mpi NAME``)."""
    return any(word == "--mpi" or word.startswith("--mpi=") for word in srun_args)


def srun_command(srun, plugin, np, program, ranks_per_node=None, extra_args=(), exclude=()):
    """The ``srun`` argument list that starts ``program`` as ``np`` tasks (srun's choice when
    None) with MPI plugin ``plugin`` (none named when None), on the allocation's nodes but
    ``exclude``; ``extra_args`` go to srun as given, before the program."""
    cmd = [srun] if plugin is None else [srun, f"--mpi={plugin}"]
    cmd.append("--kill-on-bad-exit=1")
    if exclude:
        cmd.append(f"--exclude={','.join(exclude)}")
    if np is not None:
        cmd += ["-n", str(np)]
    if ranks_per_node:
        cmd += ["--ntasks-per-node", str(ranks_per_node)]
    return cmd + list(extra_args) + list(program)


def srun_launch_command(args, program, flavour, environ=None, srun=None, plugins=None,
                   exclude=()):
    """The whole ``srun`` command of ``fleetmpirun --slurm`` for the parsed ``args``.

    ``environ`` defaults to ``os.environ``, ``srun`` to the one on PATH, ``plugins`` to what
    that srun reports (asked only when the plugin is not given in ``--mpi_args``);
    ``exclude`` names nodes to leave out (``fleetmpirun --elastic`` after a node failed).
    """
    environ = os.environ if environ is None else environ
    require_allocation(environ)
    np, ranks_per_node = srun_layout(args, environ, exclude)
    extra = [word for text in args.mpi_args for word in shlex.split(text)]
    srun = srun or find_srun()
    if names_plugin(extra):
        plugin = None
    else:
        plugin = mpi_plugin(flavour, available_plugins(srun) if plugins is None else plugins)
    return srun_command(srun, plugin, np, program, ranks_per_node, extra, exclude)


# Node states (sinfo's short form, %t) in which a node cannot run a rank; a "*" after any state
# means the node does not respond.
UNUSABLE_STATES = frozenset({"down", "drain", "drng", "drained", "fail", "failg", "maint",
                             "unk", "npc", "pow_dn", "powering_down", "inval"})


def parse_node_states(text):
    """The nodes that cannot run a rank, from ``sinfo -h -N -o "%N %t"`` output (one
    "node state" a line), in the order listed, each once."""
    nodes = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) != 2:
            continue
        node, state = fields
        base = state.rstrip("*~#!%$@^-+")
        if (state.endswith("*") or base in UNUSABLE_STATES) and node not in nodes:
            nodes.append(node)
    return nodes


def unusable_nodes(environ, sinfo=None):
    """The allocation's nodes that Slurm reports as down, drained, failing or not responding
    (``sinfo`` on ``SLURM_JOB_NODELIST``); the nodes an elastic restart leaves out."""
    sinfo = sinfo or shutil.which("sinfo")
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if sinfo is None or not nodelist:
        return []
    try:
        result = subprocess.run([sinfo, "-h", "-N", "-n", nodelist, "-o", "%N %t"],
                                capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{sinfo} did not answer within 30 s") from None
    if result.returncode != 0:
        raise RuntimeError(f"{sinfo} failed with exit code {result.returncode}: "
                           f"{(result.stdout + result.stderr).strip()[:300]!r}")
    return parse_node_states(result.stdout)

"""Whether what a rank writes to a stream reaches a terminal, for the progress bar's ``auto``.

``isatty`` says no under ``mpiexec`` in a terminal: an MPI launcher hands its ranks pipes and
copies what comes through them to its own streams. So where the stream is a pipe, this follows
it up the launcher's processes (Linux's ``/proc``): the rank's parent must be a launcher
(``LAUNCHERS``, by process name, or ``python -m fleetmpi.launch``) holding that pipe, and its
own stream of the same number is followed in turn, until one is a terminal. MPICH's ``mpiexec``
(rank, ``hydra_pmi_proxy``, ``mpiexec``) and ``fleetmpirun`` (rank, ``mpiexec.gforker``,
``fleetmpirun``) so reach the terminal they run in; output redirected to a file or piped into
another program (``| tee``), a ``fleetmpirun --log_dir`` log (the rank's own copier reads the
pipe) and a Slurm job (its step daemon is no launcher of this list) do not. Elsewhere than
Linux, ``isatty`` alone.
"""
import os

LAUNCHERS = frozenset({"mpiexec", "mpirun", "mpiexec.hydra", "mpiexec.gforker",
                       "hydra_pmi_proxy", "orterun", "prterun", "prted", "orted", "fleetmpirun"})
# A launcher's chain of processes is short: rank, proxy, mpiexec, fleetmpirun.
MOST_HOPS = 4


def _read(pid, name):
    try:
        with open(f"/proc/{pid}/{name}") as f:
            return f.read()
    except OSError:
        return ""


def _link(pid, fd):
    """What ``/proc/pid/fd/fd`` points to (``pipe:[inode]``, ``/dev/pts/3``), or None."""
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None


def _holds(pid, link):
    """Whether the process ``pid`` has a descriptor open on ``link``."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    return any(_link(pid, fd) == link for fd in fds)


def _is_launcher(pid):
    """Whether the process ``pid`` is an MPI launcher of ``LAUNCHERS`` or ``python -m
    fleetmpi.launch`` (fleetmpirun run through its module)."""
    if _read(pid, "comm").strip() in LAUNCHERS:
        return True
    words = _read(pid, "cmdline").split("\0")
    return any(word == "-m" and following == "fleetmpi.launch"
               for word, following in zip(words, words[1:]))


def _parent(pid):
    stat = _read(pid, "stat")
    return int(stat.rsplit(")", 1)[1].split()[1]) if ")" in stat else 0


def is_terminal_path(link):
    return link is not None and (link.startswith("/dev/pts/") or link.startswith("/dev/tty"))


def reaches_terminal(fd):
    """Whether descriptor ``fd`` of this process is a terminal, or a pipe that launchers copy
    to one (module docstring)."""
    if os.isatty(fd):
        return True
    link, pid = _link("self", fd), os.getppid()
    for _ in range(MOST_HOPS):
        if (link is None or not link.startswith("pipe:") or pid <= 1
                or not _is_launcher(pid) or not _holds(pid, link)):
            return False
        link = _link(pid, fd)
        if is_terminal_path(link):
            return True
        pid = _parent(pid)
    return False


def stream_reaches_terminal(stream):
    """``reaches_terminal`` of a Python stream; False for one without a descriptor."""
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return True
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return reaches_terminal(fd)

"""``fleetmpirun``: start a training script on several ranks through the installed MPI.

    fleetmpirun --gpus 0,1,2,3 --log_dir log train.py --epochs 2
    fleetmpirun --np 4 train.py
    fleetmpirun --ips 10.0.0.1,10.0.0.2 --gpus 0,1,2,3,4,5,6,7 train.py
    fleetmpirun --hostfile hosts --gpus 0,1 --mpi_args "-bind-to core" train.py
    fleetmpirun --server_num 1 --worker_num 2 train.py
    fleetmpirun --dry-run --np 2 train.py            # print the mpiexec command only
    fleetmpirun --np 4 --timeline trace.json train.py  # every rank records into one timeline
    fleetmpirun --slurm train.py                     # in an sbatch script: srun starts the ranks
    fleetmpirun --elastic --max_restarts 3 --np 4 train.py  # restart after a failure (restart.py)

It builds one ``mpiexec`` command (see ``fleetmpi.launch.mpi_command``) whose ranks each run
the wrapper ``fleetmpi/launch/rank_main.py``, which sets the rank's GPU, role and log file and
then runs the script. Its exit code is the job's. See docs/launch.md. Under ``--slurm`` the
ranks are started by ``srun`` instead (``fleetmpi.launch.slurm``): each way of starting them is
one ``RankStart`` class, which ``rank_start`` chooses from the options.

A job of MPICH on this host only is started by ``mpiexec.gforker`` where it is installed, with
the ranks' transport on shared memory, so that no process of the job listens on a socket
(``process_manager``; docs/launch.md, "Network").
"""
import abc
import argparse
import fcntl
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from fleetmpi.training import elastic
from fleetmpi.core import knobs, launcher_env
from fleetmpi.config.role_maker import endpoint_labels
from . import mpi_command, rank_main, restart, shm, slurm, watch


def parse_list(text):
    """``"a, b,c"`` -> ``["a", "b", "c"]`` (spaces and empty items dropped)."""
    return [item.strip() for item in (text or "").split(",") if item.strip()]


def read_hostfile(path):
    """``([(host, slots or None), ...], spelling)`` of a host file; ``#`` starts a comment.

    ``spelling`` is the launcher whose format the file uses for slot counts: ``"mpich"`` for
    ``host:4``, ``"openmpi"`` for ``host slots=4``, None when it gives no counts (plain host
    names, which both read). Each launcher refuses the other's format, so
    ``mpiexec_launch_command`` rewrites a file of the other spelling as a host list."""
    if not os.path.isfile(path):
        raise ValueError(f"--hostfile {path!r} does not exist")
    entries, spellings = [], set()
    with open(path) as lines:
        for number, line in enumerate(lines, 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            host, _, count = fields[0].partition(":")
            if count:
                spellings.add(mpi_command.MPICH)
            for field in fields[1:]:
                if field.startswith("slots="):
                    count = field[len("slots="):]
                    spellings.add(mpi_command.OPEN_MPI)
            if count and not count.isdigit() or count == "0":
                raise ValueError(f"--hostfile {path!r} line {number}: {line.strip()!r} has "
                                 f"slot count {count!r}; a count is a whole number of at least 1")
            entries.append((host, int(count) if count else None))
    if not entries:
        raise ValueError(f"--hostfile {path!r} names no host")
    if len(spellings) > 1:
        raise ValueError(f"--hostfile {path!r} mixes MPICH's host:N and Open MPI's "
                         f"host slots=N; use one of them")
    return entries, (spellings.pop() if spellings else None)


def parser():
    p = argparse.ArgumentParser(
        prog="fleetmpirun", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Per-rank logs (--log_dir): workerlog.<trainer id>, serverlog.<server id>; "
               "rank 0's output also goes to the terminal.")
    p.add_argument("--np", "-n", type=int,
                   help="number of ranks (default: one per listed GPU on each host, the "
                        "servers plus workers in parameter-server mode, else one per host)")
    p.add_argument("--gpus", help="comma-separated GPU ids; one rank per id on each host, "
                                  "each rank seeing only its own GPU")
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument("--ips", help="comma-separated hosts to run on")
    hosts.add_argument("--hostfile", help="a host file in the MPI launcher's format")
    p.add_argument("--log_dir", help="write each rank's output to DIR/workerlog.<rank>")
    p.add_argument("--timeline", metavar="PATH",
                   help="write a Chrome-trace/Perfetto timeline of every rank to PATH "
                        "(sets FLEETMPI_TIMELINE for every rank)")
    p.add_argument("--server_num", type=int, default=0,
                   help="parameter-server mode: number of server ranks")
    p.add_argument("--worker_num", type=int, default=0,
                   help="parameter-server mode: number of trainer ranks")
    p.add_argument("--mpi_args", action="append", default=[],
                   help="arguments for the MPI launcher, as one shell-quoted string "
                        "(may be repeated)")
    p.add_argument("--mpiexec", help="the mpiexec/mpirun to use (default: the one beside "
                                     "this Python, else on PATH)")
    p.add_argument("--slurm", action="store_true",
                   help="inside a Slurm allocation (sbatch, salloc): start the ranks with srun "
                        "(-n from --np, else the allocation's tasks); --mpi_args go to srun")
    p.add_argument("--elastic", action="store_true",
                   help="restart the job after a failure, with the ranks still available; the "
                        "script resumes with fleetmpi.training.elastic.State (see docs/launch.md)")
    p.add_argument("--max_restarts", type=int,
                   help=f"--elastic: restart at most this many times (default "
                        f"{restart.DEFAULT_MAX_RESTARTS})")
    p.add_argument("--min_np", type=int,
                   help=f"--elastic: never restart with fewer ranks than this (default "
                        f"{restart.DEFAULT_MIN_NP})")
    p.add_argument("--np_file", metavar="FILE",
                   help="--elastic: before each restart, read the number of ranks still "
                        "available from FILE (at most the first run's count)")
    p.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true",
                   help="print the command instead of running it")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER,
                   help="arguments for the script")
    return p


def check_inputs(args):
    """ValueError naming the first bad input that does not depend on the hosts: a script
    that is not there, a GPU listed twice, a timeline in a folder that does not exist."""
    if not os.path.isfile(args.script):
        raise ValueError(f"the training script {args.script!r} does not exist (or is not a "
                         f"file) in {os.getcwd()}")
    gpus = parse_list(args.gpus)
    twice = sorted({gpu for gpu in gpus if gpus.count(gpu) > 1})
    if twice:
        raise ValueError(f"--gpus {args.gpus!r} lists GPU {', '.join(twice)} more than once; "
                         f"each rank gets a GPU of its own")
    if args.timeline is not None:
        folder = os.path.dirname(os.path.abspath(args.timeline))
        if os.path.isdir(args.timeline) or not os.path.isdir(folder):
            raise ValueError(f"--timeline {args.timeline!r} must name a file in an existing "
                             f"folder")
    check_elastic_inputs(args)


def elastic_limits(args):
    """``(max_restarts, min_np)`` of ``--elastic``, the defaults where not given."""
    return (restart.DEFAULT_MAX_RESTARTS if args.max_restarts is None else args.max_restarts,
            restart.DEFAULT_MIN_NP if args.min_np is None else args.min_np)


def check_elastic_inputs(args):
    """ValueError naming an elastic option that cannot work (``launch/restart.py``)."""
    given = [name for name, value in (("--np_file", args.np_file),
                                      ("--max_restarts", args.max_restarts),
                                      ("--min_np", args.min_np)) if value is not None]
    if not args.elastic:
        if given:
            raise ValueError(f"{', '.join(given)} only apply with --elastic")
        return
    max_restarts, min_np = elastic_limits(args)
    if max_restarts < 0:
        raise ValueError(f"--max_restarts must be at least 0, got {max_restarts}")
    if min_np < 1:
        raise ValueError(f"--min_np must be at least 1, got {min_np}")
    if args.server_num or args.worker_num:
        raise ValueError("--elastic restarts collective jobs; parameter-server mode "
                         "(--server_num/--worker_num) has fixed roles and cannot lose a rank")
    if args.np_file is not None and args.gpus:
        raise ValueError("--np_file cannot change the rank count of --gpus, which is one "
                         "rank per listed GPU; give --np_file with --np instead")
    rank_start(args).check_elastic_inputs()


def rank_layout(args):
    """``(np, hosts, ranks_per_host)`` from the parsed options; ValueError names a conflict.

    The rank count comes from whichever of ``--np``, ``--gpus`` (one rank per listed GPU on
    each host) and ``--server_num + --worker_num`` are given, and they must agree; with none
    of them it is one rank per host of ``--ips``, or per slot of ``--hostfile`` (a host
    without a count has one)."""
    gpus = parse_list(args.gpus)
    ips = parse_list(args.ips)
    entries = read_hostfile(args.hostfile)[0] if args.hostfile else []
    num_hosts = len(ips or entries) or 1
    if args.np is not None and args.np < 1:
        raise ValueError(f"--np must be at least 1, got {args.np}")
    counts = []
    if args.np is not None:
        counts.append((args.np, f"--np {args.np}"))
    if gpus:
        counts.append((len(gpus) * num_hosts,
                       f"{len(gpus)} GPU(s) in --gpus on each of {num_hosts} host(s)"))
    if args.server_num or args.worker_num:
        if args.server_num < 1 or args.worker_num < 1:
            raise ValueError(f"parameter-server mode needs --server_num and --worker_num "
                             f"both at least 1, got {args.server_num} and {args.worker_num}")
        counts.append((args.server_num + args.worker_num,
                       f"--server_num {args.server_num} + --worker_num {args.worker_num}"))
    for count, why in counts[1:]:
        if count != counts[0][0]:
            raise ValueError(f"{counts[0][1]} does not match {why}, which make {count} ranks")
    if counts:
        np = counts[0][0]
    else:
        np = sum(slots or 1 for _, slots in entries) if entries else num_hosts
    ranks_per_host = len(gpus) if gpus and (ips or entries) else None
    return np, ips, ranks_per_host


def job_environment(args, np=None):
    """The variables ``fleetmpirun`` sets for every rank of the job, on every host; with the
    job's rank count ``np``, also Paddle's endpoint lists (``endpoint_environment``)."""
    env = {} if np is None else endpoint_environment(args, np)
    if args.timeline is not None:
        env[knobs.TIMELINE.name] = os.path.abspath(args.timeline)
    if getattr(args, "elastic", False):
        env[knobs.RESTART_COUNT.name] = str(getattr(args, "restart_count", 0))
        if getattr(args, "progress_file", None):
            env[knobs.ELASTIC_PROGRESS.name] = args.progress_file
    return env


def endpoint_environment(args, np):
    """``PADDLE_TRAINER_ENDPOINTS`` and, in parameter-server mode,
    ``PADDLE_PSERVERS_IP_PORT_LIST``, as Paddle's launcher exports them: the labels of the
    ranks (``fleetmpi.config.role_maker.endpoint_labels``; nothing listens on them). Each rank's
    wrapper takes its own ``PADDLE_CURRENT_ENDPOINT``, ``POD_IP`` and ``PADDLE_PORT`` from
    them (``rank_main.role_variables``)."""
    workers = args.worker_num if args.server_num else np
    env = {"PADDLE_TRAINER_ENDPOINTS": ",".join(endpoint_labels(workers))}
    if args.server_num:
        env["PADDLE_PSERVERS_IP_PORT_LIST"] = ",".join(endpoint_labels(args.server_num,
                                                                       first=workers))
    return env


# Names that mean this host in --ips or a host file.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_this_host(name):
    """Whether the host ``name`` (``host`` or ``host:slots``) is this machine, by name."""
    name = name.rpartition(":")[0] if name.count(":") == 1 else name
    here = socket.gethostname()
    return name in LOOPBACK_NAMES or name in (here, here.split(".")[0], socket.getfqdn())


def on_this_host_only(args):
    """Whether every rank of the job runs on this host: not ``--slurm``, and ``--ips`` or
    ``--hostfile``, where given, name one host, this one."""
    if not rank_start(args).may_run_here():
        return False
    names = parse_list(args.ips) or (
        [host for host, _ in read_hostfile(args.hostfile)[0]] if args.hostfile else [])
    return len(names) <= 1 and all(map(is_this_host, names))


def process_manager(args, flavour, mpiexec):
    """``(launcher, kind, note)``: the program that starts the ranks, ``"gforker"`` or
    ``"hydra"`` (Open MPI's launcher counts as hydra here: it is left as it is), and a line
    for the user when hydra is used on one host only because ``--mpi_args`` need it.

    MPICH on this host only: ``mpiexec.gforker`` beside ``mpiexec`` (it opens no socket;
    hydra's control port listens on every interface), unless ``--mpiexec`` names
    ``mpiexec.hydra`` or ``--mpi_args`` hold an option gforker does not take."""
    extra = [word for text in args.mpi_args for word in shlex.split(text)]
    is_gforker = os.path.basename(mpiexec) == mpi_command.GFORKER_NAME
    if flavour != mpi_command.MPICH or not on_this_host_only(args):
        if is_gforker:
            raise ValueError(f"{mpiexec} starts ranks on this host only; a job over several "
                             f"hosts (--ips, --hostfile, --slurm) needs hydra's mpiexec")
        return mpiexec, mpi_command.HYDRA, None
    gforker = mpi_command.find_gforker(mpiexec)
    if gforker is None or os.path.basename(mpiexec) == "mpiexec.hydra":
        return mpiexec, mpi_command.HYDRA, None
    if mpi_command.gforker_arguments(extra) is None:
        if is_gforker:
            raise ValueError(f"--mpi_args {' '.join(args.mpi_args)!r} hold an option that "
                             f"{mpi_command.GFORKER_NAME} does not take; it takes "
                             f"{' '.join(sorted(mpi_command.GFORKER_OPTIONS))}")
        return mpiexec, mpi_command.HYDRA, (
            f"fleetmpirun: --mpi_args {' '.join(args.mpi_args)!r} need hydra (mpiexec), whose "
            f"control port listens on every interface; {mpi_command.GFORKER_NAME}, which "
            f"opens none, takes only {' '.join(sorted(mpi_command.GFORKER_OPTIONS))} "
            f"(docs/launch.md, Network)")
    return gforker, mpi_command.GFORKER, None


def transport_environment(args, flavour, environ):
    """The variables that keep MPICH's transport on shared memory for a job on this host only
    (``launcher_env.LOCAL_TRANSPORT_ENV``), less those the user set in ``environ``; none for
    Open MPI or a job over several hosts."""
    if flavour != mpi_command.MPICH or not on_this_host_only(args):
        return {}
    return {name: value for name, value in launcher_env.LOCAL_TRANSPORT_ENV.items()
            if name not in environ}


def rank_program(args, single_host=False):
    """What each rank runs: the rank wrapper, its options, ``--``, the script and its args.
    ``single_host``: the launcher (gforker) gives no local rank; every rank is on this host."""
    program = [sys.executable, os.path.abspath(rank_main.__file__)]
    if single_host:
        program.append("--single_host")
    gpus = parse_list(args.gpus)
    if gpus:
        program += ["--gpus", ",".join(gpus)]
    if args.log_dir:
        program += ["--log_dir", os.path.abspath(args.log_dir)]
    if args.server_num:
        program += ["--server_num", str(args.server_num), "--worker_num", str(args.worker_num)]
    if getattr(args, "finished_dir", None):
        program += ["--finished_dir", args.finished_dir]
    return program + ["--", args.script] + list(args.script_args)


def finished_records_dir(args, local):
    """A new folder where each rank records that its script ran to its end (``rank_main``):
    inside ``--log_dir`` when there is one (shared by the hosts, as the logs are), else a
    private temporary folder when every rank runs on this host (``local``); None for a job
    over several hosts without ``--log_dir`` (then a rank leaving early with status 0 goes
    unnoticed)."""
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        return tempfile.mkdtemp(prefix=".finished-", dir=os.path.abspath(args.log_dir))
    if local:
        return tempfile.mkdtemp(prefix="fleetmpirun-finished-")
    return None


def unfinished_ranks(directory, np):
    """The ranks that left no record in ``directory``."""
    done = {name for name in os.listdir(directory) if name.startswith("rank.")}
    return [rank for rank in range(np) if f"rank.{rank}" not in done]


def describe_unfinished(directory, np):
    """A line naming the ranks that did not run their script to its end, with the process id
    and host of each, so that the MPI launcher's report of a process (which names a PID)
    can be read as a rank; None when every rank finished."""
    missing = unfinished_ranks(directory, np)
    if not missing:
        return None
    processes = watch.rank_processes(directory)
    records = set(os.listdir(directory))
    places = [f"{rank} (pid {processes[rank][0]} on {processes[rank][1]})" if rank in processes
              else f"{rank} (never started)" for rank in missing]
    places = [place + "".join(f", {text}" for name, _, text in rank_main.LEAVING.values()
                              if f"{name}.{rank}" in records)
              for rank, place in zip(missing, places)]
    return f"fleetmpirun: rank(s) that did not run their script to its end: {'; '.join(places)}"


def mpiexec_launch_command(args, flavour, mpiexec, environ=None, as_root=None):
    """The whole ``mpiexec`` command for the parsed ``args`` and an MPI of ``flavour``
    (``mpiexec.gforker`` in its place for MPICH on this host only, see ``process_manager``)."""
    np, hosts, ranks_per_host = rank_layout(args)
    launcher, kind, _ = process_manager(args, flavour, mpiexec)
    job_env = dict(transport_environment(args, flavour,
                                         os.environ if environ is None else environ),
                   **job_environment(args))
    extra = [word for text in args.mpi_args for word in shlex.split(text)]
    if kind == mpi_command.GFORKER:
        return mpi_command.mpiexec_command(
            flavour, launcher, np, rank_program(args, single_host=True),
            extra_args=mpi_command.gforker_arguments(extra), environ=environ, as_root=as_root,
            job_env=job_env, process_manager=mpi_command.GFORKER)
    hostfile = args.hostfile
    if hostfile:
        entries, spelling = read_hostfile(hostfile)
        if spelling not in (None, flavour):
            # the other launcher's format: the same hosts and counts as a host list
            hostfile = None
            hosts = [host if slots is None or ranks_per_host else f"{host}:{slots}"
                     for host, slots in entries]
    return mpi_command.mpiexec_command(
        flavour, mpiexec, np, rank_program(args), hosts=hosts, hostfile=hostfile,
        ranks_per_host=ranks_per_host, extra_args=extra, environ=environ, as_root=as_root,
        job_env=job_env)


LOG_NAME = re.compile(r"(workerlog|serverlog)\.(\d+)")
TRACEBACK = "Traceback (most recent call last):"
# At most this many logs, and this many lines of each, in the report of a failed job.
REPORTED_LOGS = 4
REPORTED_LINES = 40


def failure_excerpt(text):
    """The last traceback in ``text`` (with the line before it when that names the failing
    rank), cut to its last ``REPORTED_LINES`` lines; None when there is none."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(TRACEBACK)]
    if not starts:
        return None
    start = starts[-1]
    if start > 0 and "failed" in lines[start - 1]:
        start -= 1
    return "\n".join(lines[start:][-REPORTED_LINES:])


def wait_for_copier(path, seconds=5.0):
    """Wait up to ``seconds`` for rank 0's output copier to finish writing ``path``: it holds
    an exclusive ``flock`` on the log while it runs (see ``rank_main``)."""
    deadline = time.monotonic() + seconds
    with open(path, "rb") as log:
        while True:
            try:
                fcntl.flock(log, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return True
            except OSError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.02)


def failed_rank_logs(log_dir, since, skip_interrupts=False):
    """``(path, excerpt)`` of this job's logs (written since ``since``) that end a rank with a
    traceback, workers then servers, in rank order. ``skip_interrupts`` leaves out a
    traceback that ends in ``KeyboardInterrupt``: under ``mpiexec.gforker``, which sends the
    other ranks SIGINT when one leaves early, that is the launcher's clean-up, not a failure.

    Rank 0's log is among them although its output was echoed: when a rank aborts the job,
    the MPI launcher stops forwarding output, and the end of rank 0's may never reach the
    terminal; its log (see ``rank_main``) always has it."""
    if not os.path.isdir(log_dir):
        return []
    names = sorted((match.group(1) == "serverlog", int(match.group(2)), match.group(0))
                   for match in map(LOG_NAME.fullmatch, os.listdir(log_dir)) if match)
    found = []
    for _, _, name in names:
        path = os.path.join(log_dir, name)
        if os.path.getmtime(path) < since:
            continue
        if name == "workerlog.0":
            wait_for_copier(path)
        with open(path, errors="replace") as log:
            excerpt = failure_excerpt(log.read())
        if excerpt is not None and not (
                skip_interrupts and excerpt.rstrip().endswith("KeyboardInterrupt")):
            found.append((path, excerpt))
    return found[:REPORTED_LOGS]


# After SIGINT or SIGTERM, how long the MPI launcher and the ranks get to end by themselves
# before whatever is left of them is killed.
STOP_GRACE_SECONDS = 0.5
# How often fleetmpirun looks at the MPI launcher (and at most how long it sleeps between).
POLL_SECONDS = 0.05


# gforker's line for a rank that a signal ended: "[0]1:Return code = 0, signaled with Killed"
# (world, rank, exit code, the signal's strsignal text), on its standard error.
GFORKER_SIGNALED = re.compile(rb"\[\d+\](\d+):Return code = -?\d+, signaled with ([^\n]+)")
SIGNAL_NUMBERS = {signal.strsignal(s): int(s) for s in signal.Signals if signal.strsignal(s)}


class LauncherErrors:
    """Copies the MPI launcher's standard error (a pipe) to this process's as it comes, and
    notes from ``mpiexec.gforker``'s report which signal ended which rank (``signaled``,
    rank -> signal number): gforker exits 0 when a signal killed a rank."""

    def __init__(self, pipe):
        self.signaled = {}
        self._pipe = pipe
        self._thread = threading.Thread(target=self._copy, daemon=True)
        self._thread.start()

    def _copy(self):
        pending = b""
        fd = self._pipe.fileno()
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            view = memoryview(chunk)
            try:
                while view:
                    view = view[os.write(2, view):]
            except OSError:  # our standard error is gone; keep reading the report
                pass
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                match = GFORKER_SIGNALED.search(line)
                number = match and SIGNAL_NUMBERS.get(match.group(2).strip().decode(
                    errors="replace"))
                if number:
                    self.signaled.setdefault(int(match.group(1)), number)
        self._pipe.close()

    def join(self, seconds=1.0):
        self._thread.join(seconds)


def run_job(cmd, env, records=None, rank_watch=None, end_on_loss=False):
    """Run the launcher command; ``(exit status, interrupted)``. The status is the launcher's
    (128 + N when a signal N ended it); when SIGINT (Ctrl-C) or SIGTERM reached
    ``fleetmpirun`` it is 128 + that signal (130, 143) and ``interrupted`` is True.

    The signal is passed on to the MPI launcher at once (Ctrl-C from a terminal reaches it
    too, as the same process group). What has not ended ``STOP_GRACE_SECONDS`` later is
    killed: the launcher, and the ranks whose ``pid.<rank>`` records (``records``, on this
    host) name a live process, so that none outlives ``fleetmpirun``. A ``rank_watch``
    (``watch.RankWatch``) watches the ranks while the launcher runs; with ``end_on_loss``
    (under ``mpiexec.gforker``, which takes 1 to 3 s to end the others, and reports a rank
    killed by a signal as a success) the other ranks are killed as soon as it sees a rank
    gone without finishing its script, as hydra does, and when a signal ended the rank seen
    gone first, the status is that signal's number, as hydra's."""
    process = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE if end_on_loss else None)
    errors = LauncherErrors(process.stderr) if end_on_loss else None
    received = []

    def stop(signum, frame):
        if not received:
            received.append((signum, time.monotonic()))
        process.send_signal(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    ended_others = nudged = False
    try:
        while True:
            if rank_watch is not None:
                rank_watch.wait(POLL_SECONDS)
                if end_on_loss and rank_watch.first_gone and not ended_others:
                    ended_others = True
                    _kill_ranks(records)
                if ended_others and not nudged and not received and not _ranks_alive(records):
                    # gforker idles about 2 s after its ranks are gone; SIGTERM ends it within
                    # 1 s, with its report (which rank a signal ended) and its exit status
                    nudged = True
                    process.send_signal(signal.SIGTERM)
            try:
                code = process.wait(timeout=0 if rank_watch is not None else POLL_SECONDS)
                break
            except subprocess.TimeoutExpired:
                if received and time.monotonic() - received[0][1] > STOP_GRACE_SECONDS:
                    process.kill()
        if received:
            _end_ranks(records)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if errors is not None:
            errors.join()
    if received:
        return 128 + received[0][0], True
    if errors is not None and code == 0 and rank_watch.first_gone:
        code = errors.signaled.get(rank_watch.first_gone[0][0], 0)
    return (128 - code if code < 0 else code), False


def _ranks_alive(records):
    """Whether a rank ``records`` names still runs."""
    return any(watch.alive(pid) for pid, _ in watch.rank_processes(records).values())


def _kill_ranks(records):
    """SIGKILL every rank ``records`` names that still runs."""
    for pid, _ in watch.rank_processes(records).values():
        if watch.alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _end_ranks(records):
    """Kill the ranks ``records`` names that are still alive ``STOP_GRACE_SECONDS`` after the
    launcher was told to stop."""
    if records is None:
        return
    pids = [pid for pid, _ in watch.rank_processes(records).values()]
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if watch.alive(pid)]
        time.sleep(0.02)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def check_finished(directory, np, gforker=False):
    """0 when every rank's script ran to its end, else 1 after naming the ranks that did not:
    the MPI launcher reports success when a rank leaves with status 0 without finalizing MPI
    (``os._exit(0)``, a kill with status 0), and ends the other ranks without a word;
    ``mpiexec.gforker`` (``gforker``) also when a signal killed a rank."""
    missing = unfinished_ranks(directory, np)
    if not missing:
        return 0
    how = ("a rank left without an error (os._exit(0)) or was killed by a signal, which "
           "mpiexec.gforker reports as success, and the others were then ended" if gforker else
           "a rank left without an error (os._exit(0), or a kill with status 0) and the MPI "
           "launcher then ended the others")
    print(f"fleetmpirun: the MPI launcher reported success, but rank(s) "
          f"{', '.join(map(str, missing))} of {np} did not run their script to its end: "
          f"{how}; the job did not finish", file=sys.stderr)
    return 1


class RankStart(abc.ABC):
    """One way of starting the job's ranks: the answers ``fleetmpirun`` asks of it, each
    with the answer of a launcher that needs nothing more. A subclass is one launcher
    (``MpiexecStart``, ``SrunStart``); ``rank_start`` chooses it from the parsed options."""

    def __init__(self, args):
        self.args = args

    def check_elastic_inputs(self):
        """ValueError naming an option ``--elastic`` needs with this launcher."""

    def check_before_start(self, environ):
        """ValueError when ``environ`` is not one this launcher can start ranks in."""

    def may_run_here(self):
        """False when the launcher places the ranks on hosts of its own choosing, so that
        no rank can be taken to run on this host."""
        return True

    def runs_here(self, hosts):
        """Whether every rank runs on this host, where ``fleetmpirun`` watches them and
        kills what is left; ``hosts`` is ``rank_layout``'s list."""
        return self.may_run_here() and len(hosts) <= 1

    @abc.abstractmethod
    def command(self, flavour, mpiexec, exclude=(), environ=None):
        """The command that starts the ranks of an MPI of ``flavour`` (``mpiexec`` is the
        one found or given), leaving out the nodes ``exclude`` names; ``environ`` is the
        environment it runs in."""

    def rank_count(self, np, exclude=()):
        """The job's rank count, given ``rank_layout``'s ``np`` and the nodes left out."""
        return np

    def ends_on_loss(self, flavour, mpiexec):
        """Whether ``run_job`` ends the other ranks when one is gone (``mpiexec.gforker``,
        which does not do it itself)."""
        return False

    def note(self, flavour, mpiexec):
        """A line for the user about how the ranks are started, or None."""
        return None

    # ``restart.run``'s probe of the nodes to leave out of a restart (called with no
    # arguments, returns node names); None where the launcher has no way to learn them.
    failed_nodes = None


class MpiexecStart(RankStart):
    """The installed MPI's ``mpiexec`` (``mpiexec.gforker`` in its place for MPICH on this
    host only, see ``process_manager``) on the hosts of ``--ips`` or ``--hostfile``."""

    def command(self, flavour, mpiexec, exclude=(), environ=None):
        return mpiexec_launch_command(self.args, flavour, mpiexec, environ=environ)

    def ends_on_loss(self, flavour, mpiexec):
        return process_manager(self.args, flavour, mpiexec)[1] == mpi_command.GFORKER

    def note(self, flavour, mpiexec):
        return process_manager(self.args, flavour, mpiexec)[2]


class SrunStart(RankStart):
    """``--slurm``: Slurm's ``srun`` inside an allocation (``launch/slurm.py``)."""

    def check_elastic_inputs(self):
        if not self.args.log_dir:
            raise ValueError("--elastic under --slurm needs --log_dir (shared by the nodes): "
                             "the ranks record there which node each ran on, so that the "
                             "ranks of a failed node are left out of the restart")

    def check_before_start(self, environ):
        slurm.require_allocation(environ)

    def may_run_here(self):
        return False

    def command(self, flavour, mpiexec, exclude=(), environ=None):
        return slurm.srun_launch_command(self.args, rank_program(self.args), flavour,
                                         environ=environ, exclude=exclude)

    def rank_count(self, np, exclude=()):
        return slurm.srun_layout(self.args, os.environ, exclude)[0] or np

    def failed_nodes(self):
        return slurm.unusable_nodes(os.environ)


# The launchers an option chooses (the option's dest, the class), first match first;
# mpiexec without any of them.
STARTS_BY_OPTION = (("slurm", SrunStart),)


def rank_start(args):
    """The ``RankStart`` of the parsed options."""
    chosen = next((start for dest, start in STARTS_BY_OPTION if getattr(args, dest)),
                  MpiexecStart)
    return chosen(args)


def ranks_per_host(records):
    """``{host: number of ranks}`` from the ``pid.<rank>`` records (short host names, as
    Slurm names nodes)."""
    counts = {}
    for _, host in watch.rank_processes(records).values():
        short = host.split(".")[0]
        counts[short] = counts.get(short, 0) + 1
    return counts


def run_attempt(args, start, flavour, mpiexec, exclude=()):
    """Run the job once, its ranks started by ``start`` (a ``RankStart``), and report a
    failure; a ``restart.Attempt`` with what came of it."""
    np, hosts, _ = rank_layout(args)
    np = start.rank_count(np, exclude)
    attempt = restart.Attempt(getattr(args, "restart_count", 0), np, excluded=tuple(exclude))
    local = start.runs_here(hosts)
    args.finished_dir = finished_records_dir(args, local)
    rank_watch = watch.RankWatch(args.finished_dir) if local else None
    shm_before = shm.existing() if local else set()
    started = time.time() - 1.0
    gforker = start.ends_on_loss(flavour, mpiexec)
    try:
        environ = dict(os.environ, **job_environment(args, np))
        code, interrupted = run_job(start.command(flavour, mpiexec, exclude, environ),
                                    environ,
                                    args.finished_dir if local else None, rank_watch,
                                    end_on_loss=gforker)
        if code == 0 and args.finished_dir:
            code = check_finished(args.finished_dir, np, gforker)
        unfinished = describe_unfinished(args.finished_dir, np) \
            if code != 0 and args.finished_dir else None
        if args.finished_dir:
            attempt.ranks_on_host = ranks_per_host(args.finished_dir)
    finally:
        if rank_watch is not None:
            rank_watch.close()
        if args.finished_dir:
            shutil.rmtree(args.finished_dir, ignore_errors=True)
    attempt.code, attempt.interrupted = code, interrupted
    if rank_watch is not None:
        attempt.first_gone = watch.describe_first_gone(rank_watch.first_gone)
        removed = shm.remove_left_segments(rank_watch.segments, shm_before)
        if removed:
            print(f"fleetmpirun: removed what the job left in {shm.SHM_DIR}: "
                  f"{', '.join(removed)}", file=sys.stderr)
    if getattr(args, "progress_file", None):
        attempt.progress = elastic.read_progress(args.progress_file)
    if code != 0:
        where = f"; per-rank logs in {os.path.abspath(args.log_dir)}" if args.log_dir else ""
        print(f"fleetmpirun: the job exited with code {code}{where}", file=sys.stderr)
        if unfinished:
            print(unfinished, file=sys.stderr)
        reported = args.log_dir and not interrupted
        for path, excerpt in failed_rank_logs(args.log_dir, started, gforker) \
                if reported else ():
            print(f"fleetmpirun: {path} ends with:\n{excerpt}", file=sys.stderr)
    return attempt


def run_elastic(args, start, flavour, mpiexec):
    """``--elastic``: attempts until one succeeds or no restart is allowed (``restart.run``),
    then the summary; the last attempt's status."""
    first_np, given_np = run_attempt_count(args, start), args.np
    max_restarts, min_np = elastic_limits(args)
    folder = os.path.abspath(args.log_dir) if args.log_dir else None
    private = tempfile.mkdtemp(prefix="fleetmpirun-elastic-") if folder is None else None
    if folder is not None:
        os.makedirs(folder, exist_ok=True)

    def attempt(restart_count, np, exclude):
        args.restart_count = restart_count
        args.np = given_np if np == first_np else np
        fd, args.progress_file = tempfile.mkstemp(prefix=".elastic-progress-",
                                                  dir=folder or private)
        os.close(fd)
        try:
            return run_attempt(args, start, flavour, mpiexec, exclude)
        finally:
            os.remove(args.progress_file)

    try:
        attempts, reason = restart.run(first_np, attempt, max_restarts, min_np, args.np_file,
                                       start.failed_nodes)
    finally:
        if private:
            shutil.rmtree(private, ignore_errors=True)
    print(restart.summary(attempts), file=sys.stderr)
    if reason:
        print(f"fleetmpirun: elastic: gave up: {reason}", file=sys.stderr)
    return attempts[-1].code


def run_attempt_count(args, start):
    """The first attempt's rank count (``--slurm``: srun's, when fleetmpirun decides it)."""
    return start.rank_count(rank_layout(args)[0])


def main(argv=None):
    p = parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        check_inputs(args)
        start = rank_start(args)
        start.check_before_start(os.environ)
        mpiexec = args.mpiexec or mpi_command.find_mpiexec()
        flavour = mpi_command.detect_flavour(mpiexec)
        cmd = start.command(flavour, mpiexec)
        note = start.note(flavour, mpiexec)
        if args.elastic and elastic_limits(args)[1] > run_attempt_count(args, start):
            raise ValueError(f"--min_np {args.min_np} is more than the "
                             f"{run_attempt_count(args, start)} rank(s) the job starts with")
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        p.error(str(error))
    if note:
        print(note, file=sys.stderr)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    if args.elastic:
        return run_elastic(args, start, flavour, mpiexec)
    return run_attempt(args, start, flavour, mpiexec).code


if __name__ == "__main__":
    sys.exit(main())

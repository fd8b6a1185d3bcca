"""What each rank of a ``fleetmpirun`` job runs before the user's script.

    python .../fleetmpi/launch/rank_main.py [--gpus 0,1] [--log_dir DIR]
        [--server_num S --worker_num W] -- script.py [script args]

``fleetmpirun`` runs it by its file path rather than with ``-m``, so that nothing of fleetmpi
is imported before the rank's variables are in place (the script's own ``import fleetmpi``
then sees them) and a script that does not use fleetmpi starts without its import cost; it
imports only the standard library, and loads the one module of fleetmpi it reads
(``fleetmpi/core/launcher_env.py``, which imports nothing) by its file path. As with
``python script.py``, the script's folder is first on ``sys.path``.

It learns its rank from the variables the MPI launcher sets (so MPI itself is initialized only
by the script's ``fleet.init()``, after ``CUDA_VISIBLE_DEVICES`` is in place), sets the
device and role variables, sends its output to its log file and runs the script as
``__main__`` with ``sys.argv`` set to the script's.

Roles in parameter-server mode: ranks ``0..W-1`` are the trainers (trainer ``i`` is rank
``i``), ranks ``W..W+S-1`` the servers (server ``j`` is rank ``W+j``).

An exception the script does not catch goes to ``sys.excepthook`` as it would without the
wrapper, so the hook ``fleet.init()`` installs (``fleetmpi.core.failure``) still ends the job. When
no such hook ended it and the script had started MPI, the wrapper aborts the MPI job itself:
a rank that returns from an exception while the others wait in a collective would otherwise
leave the job hanging.
"""
import argparse
import atexit
import fcntl
import importlib.util
import os
import runpy
import signal
import socket
import sys
import tempfile
import time

# How long a rank that ends normally waits for its terminal copier to write what is left.
COPIER_EXIT_SECONDS = 10.0
# run_script's status for a rank that left the job after an uncaught exception while the
# others go on, and for one that SIGINT interrupted so (Ctrl-C, or the MPI launcher ending the
# job: mpiexec.gforker sends SIGINT to the ranks still running, a hung one among them).
LEFT = -1
INTERRUPTED = -2
# What such a rank records for fleetmpirun (``<name>.<rank>``), its process's exit status, and
# what fleetmpirun's summary says of it.
LEAVING = {LEFT: ("left", 1, "left after an uncaught exception while the others went on"),
           INTERRUPTED: ("interrupted", 128 + signal.SIGINT,
                         "interrupted by SIGINT (Ctrl-C, or the MPI launcher ending the job's "
                         "ranks)")}


def _launcher_env():
    """``fleetmpi.core.launcher_env``, the table of the launchers' variables, loaded by its file
    path: importing it by name would import fleetmpi first (see the module docstring)."""
    package = importlib.util.find_spec("fleetmpi").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location("fleetmpi_launcher_env",
                                                  os.path.join(package, "core", "launcher_env.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _whole_numbers(environ, names):
    """The values of variables ``names`` as integers; None unless each is a whole number (a
    name of None is a variable that is not set)."""
    values = [environ.get(name, "") if name else "" for name in names]
    return tuple(int(value) for value in values) if all(v.isdigit() for v in values) else None


def place(environ, single_host=False):
    """``(rank, size, local_rank)`` of this process from the launcher's variables, asking
    MPI only when no launcher set all three of its own. One launcher's three are used together,
    so that a variable left over from an enclosing launcher (an sbatch script's
    ``SLURM_LOCALID`` under mpiexec) never mixes in. ``single_host``: every rank runs on this
    host, started by MPICH's ``mpiexec.gforker``, which sets ``PMI_RANK`` and ``PMI_SIZE`` but
    no local rank; the local rank is then the rank."""
    launchers = _launcher_env()
    if single_host:
        hydra = launchers.HYDRA
        found = _whole_numbers(environ, (hydra.rank, hydra.size_variable(environ)))
        if found:
            rank, size = found
            return rank, size, rank
    for family in launchers.MPI_LAUNCHERS:
        found = _whole_numbers(environ, (family.rank, family.size_variable(environ),
                                         family.local_rank))
        if found:
            return found
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    return world.Get_rank(), world.Get_size(), world.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()


def _endpoint_list(environ, name, count):
    """The endpoint labels ``fleetmpirun`` exported in ``name``, or None where absent or made
    for another number of ranks than ``count`` (the role maker then makes the same labels)."""
    labels = [e for e in environ.get(name, "").split(",") if e]
    return labels if len(labels) == count else None


def role_variables(rank, size, local_rank, gpus=None, server_num=0, worker_num=0, environ=None):
    """The variables this rank runs its script with, and the name of its log file: Paddle's
    launcher's (``PADDLE_TRAINER_ID``, ``PADDLE_TRAINERS_NUM``, ``PADDLE_RANK_IN_NODE``,
    ``TRAINING_ROLE``, and this rank's ``PADDLE_CURRENT_ENDPOINT``, or ``POD_IP`` and
    ``PADDLE_PORT``, from the endpoint lists in ``environ``), plus ``PADDLE_PSERVERS_NUM`` and
    ``PADDLE_PSERVER_ID``.

    Collective mode: every rank is trainer ``rank`` of ``size``. Parameter-server mode
    (``server_num`` > 0): see the module docstring for which rank takes which role.
    """
    environ = {} if environ is None else environ
    env = {"PADDLE_RANK_IN_NODE": str(local_rank)}
    if gpus:
        if local_rank >= len(gpus):
            raise ValueError(f"local rank {local_rank} has no GPU: --gpus lists {len(gpus)} "
                             f"({','.join(gpus)}), one rank per listed GPU on each host")
        env["CUDA_VISIBLE_DEVICES"] = gpus[local_rank]
        env["FLAGS_selected_gpus"] = gpus[local_rank]
    if server_num:
        if size != server_num + worker_num:
            raise ValueError(f"the job has {size} ranks but --server_num {server_num} and "
                             f"--worker_num {worker_num} need {server_num + worker_num}")
        env["PADDLE_TRAINERS_NUM"] = str(worker_num)
        env["PADDLE_PSERVERS_NUM"] = str(server_num)
        workers = _endpoint_list(environ, "PADDLE_TRAINER_ENDPOINTS", worker_num)
        servers = _endpoint_list(environ, "PADDLE_PSERVERS_IP_PORT_LIST", server_num)
        if rank < worker_num:
            env["TRAINING_ROLE"] = "TRAINER"
            env["PADDLE_TRAINER_ID"] = str(rank)
            current = workers[rank] if workers else None
            log_name = f"workerlog.{rank}"
        else:
            env["TRAINING_ROLE"] = "PSERVER"
            env["PADDLE_PSERVER_ID"] = str(rank - worker_num)
            current = servers[rank - worker_num] if servers else None
            log_name = f"serverlog.{rank - worker_num}"
        if current:
            env["POD_IP"], env["PADDLE_PORT"] = current.rsplit(":", 1)
    else:
        env["TRAINING_ROLE"] = "TRAINER"
        env["PADDLE_TRAINER_ID"] = str(rank)
        env["PADDLE_TRAINERS_NUM"] = str(size)
        workers = _endpoint_list(environ, "PADDLE_TRAINER_ENDPOINTS", size)
        if workers:
            env["PADDLE_CURRENT_ENDPOINT"] = workers[rank]
        log_name = f"workerlog.{rank}"
    return env, log_name


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _copy(read_end, log_fd, terminal_fd):
    """The copier's loop: each chunk to the log first (so the log is complete whatever
    happens to the terminal), then to the terminal while it accepts writes; ends at EOF, when
    every writer (the rank, and any process it started) has closed the pipe."""
    terminal_open = True
    while True:
        chunk = os.read(read_end, 65536)
        if not chunk:
            return
        _write_all(log_fd, chunk)
        if terminal_open:
            try:
                _write_all(terminal_fd, chunk)
            except OSError:  # the launcher stopped reading (job aborted): keep the log going
                terminal_open = False


def _tee_into(log_fd):
    """Send this process's stdout and stderr to ``log_fd`` and to the terminal; returns the
    process id of the forked copier that reads them from a pipe.

    The copier runs in a process group of its own and ignores SIGINT, so the launcher's
    signals to the rank's group (MPI_Abort's kill, a Ctrl-C) do not reach it: it outlives the
    rank, drains the pipe and exits at EOF, and the log keeps the rank's last words (an
    abort's traceback) even when the launcher has stopped forwarding them to the terminal.
    It holds an exclusive ``flock`` on the log while it runs, which ``fleetmpirun`` waits for
    before it reads the log of a failed job (taken before the fork: the lock belongs to the
    open log, which after the parent closes it only the copier holds).
    """
    fcntl.flock(log_fd, fcntl.LOCK_EX)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            os.setpgid(0, 0)
            os.close(write_end)
            _copy(read_end, log_fd, 1)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(read_end)
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    os.close(write_end)
    return pid


def _await_copier(pid, seconds=COPIER_EXIT_SECONDS):
    """At a normal exit: close this process's ends of the pipe and give the copier up to
    ``seconds`` to write what is left (a child of the script still holding the pipe open
    could keep it going longer; then it finishes on its own)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # the script reaped it, or ignores SIGCHLD
            return
        if done:
            return
        time.sleep(0.01)


def redirect_output(log_path, echo):
    """Send fds 1 and 2 to ``log_path`` (truncated first), also to the terminal when
    ``echo``; Python's streams become line-buffered so the log follows the run."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        # never through a symbolic link planted at the predictable name (fleetmpi.core.files)
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                         0o644)
    except OSError as error:
        link = " (it is a symbolic link)" if os.path.islink(log_path) else ""
        raise SystemExit(f"fleetmpirun: cannot write the rank's log {log_path}: "
                         f"{error.strerror}{link}") from None
    if echo:
        copier = _tee_into(log_fd)
        atexit.register(_await_copier, copier)
    else:
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
    os.close(log_fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)


def _script_frames(tb):
    """``tb`` without its leading frames of this wrapper and of runpy."""
    wrapper_files = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}
    while tb is not None and tb.tb_next is not None and (
            tb.tb_frame.f_code.co_filename in wrapper_files
            or os.path.abspath(tb.tb_frame.f_code.co_filename) in wrapper_files):
        tb = tb.tb_next
    return tb


def _abort_started_mpi(rank, size):
    """End the whole MPI job when the script started MPI in a world of several ranks."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or size < 2 or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    sys.stderr.write(f"fleetmpirun: rank {rank} of {size} ended with an uncaught exception; "
                     "aborting the job\n")
    sys.stderr.flush()
    mpi.COMM_WORLD.Abort(1)


def _missing_package(error):
    """Whether ``error`` is fleetmpi's one-line report of a missing package
    (``fleetmpi.core.extras.MissingExtra``): every rank lacks it alike and ends its script, no
    abort (which could end the job before the first rank of a node has written the line)."""
    extras = sys.modules.get("fleetmpi.core.extras")
    return extras is not None and isinstance(error, extras.MissingExtra)


def _leaves_alone():
    """Whether the script asked that an uncaught exception end this rank alone
    (``fleetmpi.core.failure.leave_instead``: an asynchronous parameter-server worker)."""
    failure = sys.modules.get("fleetmpi.core.failure")
    return failure is not None and failure.leaves_alone()


def run_script(script, args, rank=0, size=1):
    """Run ``script`` as ``__main__`` with ``sys.argv = [script] + args``; its exit code.

    An uncaught exception is reported by ``sys.excepthook`` (see the module docstring); it
    ends the job, unless the script asked that it end this rank alone (status ``LEFT``, or
    ``INTERRUPTED`` for a KeyboardInterrupt, which is no failure of the script's own) or it
    is a missing package, which ends each rank with status 1 (``_missing_package``)."""
    sys.argv = [script] + list(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            return done.code or 0
        print(done.code, file=sys.stderr)
        return 1
    except BaseException as error:
        error.with_traceback(_script_frames(error.__traceback__))
        sys.excepthook(type(error), error, error.__traceback__)
        if _leaves_alone():
            return INTERRUPTED if isinstance(error, KeyboardInterrupt) else LEFT
        if not _missing_package(error):
            _abort_started_mpi(rank, size)
        return 128 + signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1
    return 0


def parse_args(argv):
    """Options before ``--``, then the script and its own arguments, untouched."""
    if "--" not in argv:
        raise SystemExit("usage: rank_main.py [options] -- script [args]")
    split = argv.index("--")
    if split + 1 >= len(argv):
        raise SystemExit("rank_main: no script after --")
    parser = argparse.ArgumentParser(prog="rank_main.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="")
    parser.add_argument("--log_dir")
    parser.add_argument("--server_num", type=int, default=0)
    parser.add_argument("--worker_num", type=int, default=0)
    parser.add_argument("--single_host", action="store_true",
                        help="every rank runs on this host (mpiexec.gforker): the local rank "
                             "is the rank")
    parser.add_argument("--finished_dir", help="where a rank whose script ran to its end "
                        "records it, for fleetmpirun to check")
    args = parser.parse_args(argv[:split])
    args.script, args.script_args = argv[split + 1], argv[split + 2:]
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    rank, size, local_rank = place(os.environ, args.single_host)
    gpus = [g for g in args.gpus.split(",") if g]
    env, log_name = role_variables(rank, size, local_rank, gpus, args.server_num,
                                   args.worker_num, os.environ)
    if args.single_host:
        # hydra's local-rank variables, which scripts read, as hydra would set them on one host
        env.update(MPI_LOCALRANKID=str(local_rank), MPI_LOCALNRANKS=str(size))
    os.environ.update(env)
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        redirect_output(os.path.join(args.log_dir, log_name), echo=rank == 0)
    if args.finished_dir:
        record(args.finished_dir, f"pid.{rank}", f"{os.getpid()} {socket.gethostname()}")
    code = run_script(args.script, args.script_args, rank, size)
    if code in LEAVING:
        name, code, _ = LEAVING[code]
    else:
        name = "rank" if code == 0 else None
    if name and args.finished_dir:
        record(args.finished_dir, f"{name}.{rank}")
    return code


def record(directory, name, text=""):
    """Leave ``directory/name`` for ``fleetmpirun``: ``pid.<rank>`` ("<pid> <host>") when the
    rank starts (so that an interrupted job's ranks can be ended for sure, and a failed job's
    report can name ranks by their process ids), ``rank.<rank>`` when its script
    ran to its end. A rank that leaves otherwise (``os._exit``, a kill, even with status 0)
    leaves no ``rank.<rank>``, which is how ``fleetmpirun`` tells a finished job from one
    whose MPI launcher reported success only because a rank left without an error.

    The record appears whole or not at all (written under a fresh random name, then linked
    to its own, which fails if that exists): ``fleetmpirun`` reads the folder while the
    ranks write into it."""
    fd, temporary = tempfile.mkstemp(prefix=f".{name}.", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.link(temporary, os.path.join(directory, name))
    finally:
        os.unlink(temporary)


if __name__ == "__main__":
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # run by path: this folder is not the script's
    sys.exit(main())

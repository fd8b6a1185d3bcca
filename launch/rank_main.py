"""What each rank of a ``fleetmpirun`` job runs before the user's script.

    python -m fleetmpi.launch.rank_main [--gpus 0,1] [--log_dir DIR]
        [--server_num S --worker_num W] -- script.py [script args]

It learns its rank from the variables the MPI launcher sets (so MPI itself is initialized only
by the script's ``fleet.init()``, after ``CUDA_VISIBLE_DEVICES`` is in place), sets the
device and role variables, sends its output to its log file and runs the script as
``__main__`` with ``sys.argv`` set to the script's.

Roles in parameter-server mode: ranks ``0..W-1`` are the trainers (trainer ``i`` is rank
``i``), ranks ``W..W+S-1`` the servers (server ``j`` is rank ``W+j``).
"""
import argparse
import os
import runpy
import sys
import traceback

RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")
LOCAL_RANK_VARIABLES = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")


def _first(environ, names):
    for name in names:
        if environ.get(name, "") != "":
            return int(environ[name])
    return None


def place(environ):
    """``(rank, size, local_rank)`` of this process from the launcher's variables, asking
    MPI only when the launcher set none of them."""
    rank, size = _first(environ, RANK_VARIABLES), _first(environ, SIZE_VARIABLES)
    local_rank = _first(environ, LOCAL_RANK_VARIABLES)
    if rank is None or size is None or local_rank is None:
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        rank, size = world.Get_rank(), world.Get_size()
        local_rank = world.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    return rank, size, local_rank


def role_variables(rank, size, local_rank, gpus=None, server_num=0, worker_num=0):
    """The variables this rank runs its script with, and the name of its log file.

    Collective mode: every rank is trainer ``rank`` of ``size``. Parameter-server mode
    (``server_num`` > 0): see the module docstring for which rank takes which role.
    """
    env = {}
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
        if rank < worker_num:
            env["TRAINING_ROLE"] = "TRAINER"
            env["PADDLE_TRAINER_ID"] = str(rank)
            log_name = f"workerlog.{rank}"
        else:
            env["TRAINING_ROLE"] = "PSERVER"
            env["PADDLE_PSERVER_ID"] = str(rank - worker_num)
            log_name = f"serverlog.{rank - worker_num}"
    else:
        env["TRAINING_ROLE"] = "TRAINER"
        env["PADDLE_TRAINER_ID"] = str(rank)
        env["PADDLE_TRAINERS_NUM"] = str(size)
        log_name = f"workerlog.{rank}"
    return env, log_name


def _tee_into(log_path):
    """Send this process's stdout and stderr to ``log_path`` and to the terminal: a forked
    copier reads them from a pipe until the last writer closes it."""
    read_end, write_end = os.pipe()
    if os.fork() == 0:
        os.close(write_end)
        with open(log_path, "ab", buffering=0) as log:
            while True:
                chunk = os.read(read_end, 65536)
                if not chunk:
                    os._exit(0)
                log.write(chunk)
                os.write(1, chunk)
    os.close(read_end)
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    os.close(write_end)


def redirect_output(log_path, echo):
    """Send fds 1 and 2 to ``log_path`` (also to the terminal when ``echo``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if echo:
        _tee_into(log_path)
    else:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)


def run_script(script, args):
    """Run ``script`` as ``__main__`` with ``sys.argv = [script] + args``; its exit code."""
    sys.argv = [script] + list(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            return done.code or 0
        print(done.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def parse_args(argv):
    """Options before ``--``, then the script and its own arguments, untouched."""
    if "--" not in argv:
        raise SystemExit("usage: python -m fleetmpi.launch.rank_main [options] -- script [args]")
    split = argv.index("--")
    if split + 1 >= len(argv):
        raise SystemExit("rank_main: no script after --")
    parser = argparse.ArgumentParser(prog="python -m fleetmpi.launch.rank_main",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="")
    parser.add_argument("--log_dir")
    parser.add_argument("--server_num", type=int, default=0)
    parser.add_argument("--worker_num", type=int, default=0)
    args = parser.parse_args(argv[:split])
    args.script, args.script_args = argv[split + 1], argv[split + 2:]
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    rank, size, local_rank = place(os.environ)
    gpus = [g for g in args.gpus.split(",") if g]
    env, log_name = role_variables(rank, size, local_rank, gpus, args.server_num,
                                   args.worker_num)
    os.environ.update(env)
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        if rank == 0:
            open(os.path.join(args.log_dir, log_name), "w").close()
        redirect_output(os.path.join(args.log_dir, log_name), echo=rank == 0)
    return run_script(args.script, args.script_args)


if __name__ == "__main__":
    sys.exit(main())

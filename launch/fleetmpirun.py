"""``fleetmpirun``: start a training script on several ranks through the installed MPI.

    fleetmpirun --gpus 0,1,2,3 --log_dir log train.py --epochs 2
    fleetmpirun --np 4 train.py
    fleetmpirun --ips 10.0.0.1,10.0.0.2 --gpus 0,1,2,3,4,5,6,7 train.py
    fleetmpirun --hostfile hosts --gpus 0,1 --mpi_args "-bind-to core" train.py
    fleetmpirun --server_num 1 --worker_num 2 train.py
    fleetmpirun --dry-run --np 2 train.py            # print the mpiexec command only

It builds one ``mpiexec`` command (see ``fleetmpi.launch.mpi_command``) whose ranks each run
``fleetmpi.launch.rank_main``, which sets the rank's GPU, role and log file and then runs the
script. Its exit code is the job's.
"""
import argparse
import os
import shlex
import subprocess
import sys

from . import mpi_command


def parse_list(text):
    """``"a, b,c"`` -> ``["a", "b", "c"]`` (spaces and empty items dropped)."""
    return [item.strip() for item in (text or "").split(",") if item.strip()]


def hostfile_hosts(path):
    """The host names of a host file, in either launcher's format (``host:4`` or
    ``host slots=4``); ``#`` starts a comment."""
    if not os.path.isfile(path):
        raise ValueError(f"--hostfile {path!r} does not exist")
    hosts = []
    with open(path) as lines:
        for line in lines:
            fields = line.split("#", 1)[0].split()
            if fields:
                hosts.append(fields[0].split(":", 1)[0])
    if not hosts:
        raise ValueError(f"--hostfile {path!r} names no host")
    return hosts


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
    p.add_argument("--server_num", type=int, default=0,
                   help="parameter-server mode: number of server ranks")
    p.add_argument("--worker_num", type=int, default=0,
                   help="parameter-server mode: number of trainer ranks")
    p.add_argument("--mpi_args", action="append", default=[],
                   help="arguments for the MPI launcher, as one shell-quoted string "
                        "(may be repeated)")
    p.add_argument("--mpiexec", help="the mpiexec/mpirun to use (default: the one beside "
                                     "this Python, else on PATH)")
    p.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true",
                   help="print the command instead of running it")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER,
                   help="arguments for the script")
    return p


def plan(args):
    """``(np, hosts, ranks_per_host)`` from the parsed options; ValueError names a conflict."""
    gpus = parse_list(args.gpus)
    ips = parse_list(args.ips)
    hosts = ips or (hostfile_hosts(args.hostfile) if args.hostfile else [])
    num_hosts = len(hosts) or 1
    if args.np is not None and args.np < 1:
        raise ValueError(f"--np must be at least 1, got {args.np}")
    if args.server_num or args.worker_num:
        if args.server_num < 1 or args.worker_num < 1:
            raise ValueError(f"parameter-server mode needs --server_num and --worker_num "
                             f"both at least 1, got {args.server_num} and {args.worker_num}")
        implied, why = args.server_num + args.worker_num, "--server_num + --worker_num"
    elif gpus:
        implied = len(gpus) * num_hosts
        why = f"{len(gpus)} GPU(s) in --gpus on each of {num_hosts} host(s)"
    else:
        implied, why = None, None
    if implied is not None and args.np is not None and args.np != implied:
        raise ValueError(f"--np {args.np} does not match {why}, which make {implied} ranks")
    np = implied if implied is not None else args.np if args.np is not None else num_hosts
    ranks_per_host = len(gpus) if gpus and hosts else None
    return np, ips, ranks_per_host


def rank_program(args):
    """What each rank runs: the rank wrapper, its options, ``--``, the script and its args."""
    program = [sys.executable, "-m", "fleetmpi.launch.rank_main"]
    gpus = parse_list(args.gpus)
    if gpus:
        program += ["--gpus", ",".join(gpus)]
    if args.log_dir:
        program += ["--log_dir", os.path.abspath(args.log_dir)]
    if args.server_num:
        program += ["--server_num", str(args.server_num), "--worker_num", str(args.worker_num)]
    return program + ["--", args.script] + list(args.script_args)


def launch_command(args, flavour, mpiexec, environ=None, as_root=None):
    """The whole ``mpiexec`` command for the parsed ``args`` and an MPI of ``flavour``."""
    np, ips, ranks_per_host = plan(args)
    extra = [word for text in args.mpi_args for word in shlex.split(text)]
    return mpi_command.build_command(
        flavour, mpiexec, np, rank_program(args), hosts=ips, hostfile=args.hostfile,
        ranks_per_host=ranks_per_host, extra_args=extra, environ=environ, as_root=as_root)


def main(argv=None):
    p = parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        mpiexec = args.mpiexec or mpi_command.find_mpiexec()
        cmd = launch_command(args, mpi_command.detect_flavour(mpiexec), mpiexec)
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        p.error(str(error))
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    code = subprocess.run(cmd).returncode
    if code < 0:
        code = 128 - code
    if code != 0:
        where = f"; per-rank logs in {os.path.abspath(args.log_dir)}" if args.log_dir else ""
        print(f"fleetmpirun: the job exited with code {code}{where}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())

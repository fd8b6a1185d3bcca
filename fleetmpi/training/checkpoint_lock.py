"""One job at a time saves into a checkpoint folder: the job's rank 0 holds the folder's lock
from its first save until it exits.

Two jobs saving one folder (a requeued job while the old one still runs, two runs given one
path) would each remove the files the other's manifest names, as stale files of its own ranks:
in 30 trials 3 left a manifest naming nothing that exists. The lock is a POSIX record lock
(``fcntl.lockf``) on ``<folder>/.lock``, which NFSv4 and the cluster file systems carry between
hosts and the kernel drops when the process ends, however it ends (a killed job leaves no stale
lock to clear by hand). The holder writes who it is into the file, so a second job is told
which job holds the folder. A file system that cannot lock is warned about once, and saves go
on as before.

A POSIX lock belongs to the process and is dropped when the process closes any descriptor of
the file, so the holder never opens the file again; the other ranks and jobs only read it.
"""
import datetime
import errno
import fcntl
import json
import os
import socket

from ..core.log import logger

LOCK = ".lock"
# Folders this process holds the lock of: {real path: descriptor kept open}.
_held = {}
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


def _this_job(world_size):
    """Who holds the lock, as the file tells a second job."""
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "slurm_job": os.environ.get("SLURM_JOB_ID"), "world_size": world_size,
            "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def holder_text(directory):
    """The job that holds ``directory``'s lock, in words, from what it wrote there."""
    try:
        with open(os.path.join(directory, LOCK), encoding="utf-8") as f:
            job = json.load(f)
        slurm = f"Slurm job {job['slurm_job']}, " if job.get("slurm_job") else ""
        return (f"{slurm}{job['world_size']} rank(s), rank 0 is process {job['pid']} on "
                f"{job['host']}, saving there since {job['since']}")
    except (OSError, ValueError, KeyError, TypeError):
        return "a process whose description cannot be read"


def hold(directory, world_size):
    """Take ``directory``'s lock for the rest of this process, once; True when this process
    holds it (or the file system cannot lock), False when another process does."""
    key = os.path.realpath(directory)
    if key in _held:
        return True
    fd = os.open(os.path.join(directory, LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(fd)
        if error.errno in (errno.EACCES, errno.EAGAIN):
            return False
        if error.errno not in _UNSUPPORTED:
            raise
        logger.warning("checkpoint folder %s: its file system cannot lock files (%s), so a "
                       "second job saving into it would not be stopped", directory,
                       error.strerror)
        _held[key] = None
        return True
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps(_this_job(world_size)).encode())
    os.fsync(fd)
    _held[key] = fd
    return True


def held_elsewhere_error(directory):
    """The error every rank raises when another job holds ``directory``."""
    return RuntimeError(
        f"checkpoint.save({directory!r}): another job saves into this folder ("
        f"{holder_text(directory)}), and two jobs saving one folder would remove each other's "
        "checkpoints; nothing was written. Give this job another folder, or end that job first")

"""The shared-memory segments of a job's ranks, and their removal after the job.

MPICH's ranks on one host share a segment, a file ``/dev/shm/mpich_shm_<hash>_<n>`` named
after the job (its PMI job name). MPICH removes it when the job finalizes; a job that is
aborted or killed leaves it behind, 1 to 4 MB each time. ``fleetmpirun`` therefore notes the
segments its ranks have mapped while they run (``/proc/<pid>/maps``, so only this job's own
segments, never another job's of the same user) and removes those still there once the job
has ended. A file is removed only when all of this holds: its name is MPICH's, it was not
there when the job started, it is owned by this user, and a rank of this job had it mapped.
"""
import os
import re
import stat

SHM_DIR = "/dev/shm"
MPICH_SEGMENT = re.compile(r"mpich_shm_[0-9a-f]+_\d+")


def existing():
    """The names in ``/dev/shm`` now (an empty set where there is no such folder)."""
    try:
        return set(os.listdir(SHM_DIR))
    except OSError:
        return set()


def mapped_segments(pid):
    """The MPICH segments in ``/dev/shm`` that process ``pid`` has mapped, by file name; an
    empty set when it is gone or its maps cannot be read."""
    found = set()
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) != 6:  # no path, or "(deleted)" after it: not a file there now
                    continue
                folder, name = os.path.split(fields[5])
                if folder == SHM_DIR and MPICH_SEGMENT.fullmatch(name):
                    found.add(name)
    except OSError:
        pass
    return found


def remove_left_segments(names, before):
    """Remove each of ``names`` (segments this job's ranks mapped) that is still in
    ``/dev/shm``, was not among ``before`` (the names there when the job started), matches
    MPICH's naming and is a plain file owned by this user; the names removed, sorted."""
    removed = []
    for name in sorted(names):
        if name in before or not MPICH_SEGMENT.fullmatch(name):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            info = os.lstat(path)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                continue
            os.unlink(path)
        except FileNotFoundError:
            continue
        removed.append(name)
    return removed

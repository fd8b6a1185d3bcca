"""What ``fleetmpirun`` observes of a running job's ranks on its own host.

Each rank leaves ``pid.<rank>`` ("<pid> <host>") in the job's records folder when it starts
(``rank_main``). While the MPI launcher runs, ``fleetmpirun`` watches those processes
(``RankWatch.wait``, on pidfds where the system has them), which tells it two things nothing
else does:

* which rank ended first without finishing its script: when a rank dies, MPICH kills the
  others with SIGKILL and names one process id, not always the right one. The rank seen gone
  while the others still ran is the likely cause (several when they went within one wake-up
  of each other; on a busy machine MPICH's kill can complete first, see docs/launch.md);
* which MPICH shared-memory segments the job's ranks mapped (``launch/shm.py``), so that those
  an aborted job leaves in ``/dev/shm`` can be removed, and nothing else.
"""
import os
import select

from . import shm


def rank_processes(directory):
    """``{rank: (pid, host)}`` from the ``pid.<rank>`` records the ranks left."""
    found = {}
    for name in os.listdir(directory):
        if name.startswith("pid."):
            with open(os.path.join(directory, name)) as f:
                pid, _, host = f.read().partition(" ")
            if name[4:].isdigit() and pid.isdigit():  # a record of rank_main's, whole
                found[int(name[4:])] = (int(pid), host)
    return found


def alive(pid):
    """Whether ``pid`` is a running process (an exited one its parent has not reaped yet, a
    zombie, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


class RankWatch:
    """Watches the ranks of ``records`` (their records folder, on this host): each rank's
    process is opened as a pidfd as soon as its record appears, and ``wait`` sleeps in
    ``poll(2)`` on them, so the first rank to end wakes the launcher, usually before MPICH's
    clean-up has killed the others (without pidfds, where the system lacks them, a rank is seen gone only at
    the next poll, and the one that ended first may not be told from the others)."""

    def __init__(self, records):
        self.records = records
        self.first_gone = []    # [(rank, pid, host)] seen gone first
        self.segments = set()   # MPICH segments the ranks mapped
        self._processes = {}    # rank -> (pid, host)
        self._pidfds = {}       # pidfd -> rank
        self._gone = set()
        self._poller = select.poll()

    def _open_new_ranks(self):
        for rank, (pid, host) in watch_new(self.records, self._processes).items():
            self._processes[rank] = (pid, host)
            try:
                fd = os.pidfd_open(pid)
            except (AttributeError, OSError):  # no pidfds here, or the rank is gone already
                continue
            self._pidfds[fd] = rank
            self._poller.register(fd, select.POLLIN)

    def wait(self, seconds):
        """Sleep up to ``seconds``, waking when a rank ends; note which ranks have ended."""
        self._open_new_ranks()
        ended = set()
        for fd, _ in self._poller.poll(seconds * 1000):
            ended.add(self._pidfds.pop(fd))
            self._poller.unregister(fd)
            os.close(fd)
        watched = set(self._pidfds.values())
        ended |= {rank for rank, (pid, _) in self._processes.items()
                  if rank not in watched and rank not in self._gone and not alive(pid)}
        finished = {rank for rank in ended
                    if any(os.path.exists(os.path.join(self.records, f"{kind}.{rank}"))
                           for kind in ("rank", "left"))}
        newly_gone = sorted(ended - finished - self._gone)
        if newly_gone and not self.first_gone:
            self.first_gone = [(rank, *self._processes[rank]) for rank in newly_gone]
        self._gone.update(ended)
        if not self.segments:
            for rank, (pid, _) in sorted(self._processes.items()):
                if rank not in self._gone:
                    self.segments |= shm.mapped_segments(pid)

    def close(self):
        for fd in self._pidfds:
            os.close(fd)
        self._pidfds.clear()


def watch_new(records, known):
    """The ``pid.<rank>`` records of ``records`` not in ``known`` yet, as
    ``{rank: (pid, host)}``."""
    return {rank: place for rank, place in rank_processes(records).items() if rank not in known}


def describe_first_gone(first_gone):
    """``"rank 2 (pid 123 on vm)"``, joined with commas; None for an empty list."""
    if not first_gone:
        return None
    return ", ".join(f"rank {rank} (pid {pid} on {host})" for rank, pid, host in first_gone)

"""``fleetmpirun --elastic``: run a failed job again, with the ranks still available.

    fleetmpirun --elastic --max_restarts 3 --min_np 2 --np 4 train.py

When an attempt fails (a rank raised, was killed or left early), the job is started again, up
to ``--max_restarts`` times, and the training script resumes from its latest complete
checkpoint (``fleetmpi.training.elastic.State``). How many ranks a restart gets:

* by default as many as the failed attempt had (on one host the same slots are still there);
* with ``--np_file FILE``, the whole number in ``FILE``, read again before each restart (at
  most the first attempt's count): whatever watches the machines writes there how many ranks
  are left, as a test does to simulate a lost node;
* under ``--slurm``, the nodes Slurm reports as down, drained or not responding are left out
  (``srun --exclude``), and with them the ranks the failed attempt ran there.

A restart below ``--min_np`` ranks is not made: the job ends with the failed attempt's status
and a line naming the count and ``--min_np``. Every restart is reported as it happens, with
its cause (the job's status, the rank that ended first) and the steps it lost (the steps
reached after the last commit), and again in a summary when the job ends.
"""
import sys
from dataclasses import dataclass, field

DEFAULT_MAX_RESTARTS = 3
DEFAULT_MIN_NP = 1


def read_np_file(path):
    """The number of ranks available, from ``path``; ValueError naming the file and what it
    holds when that is not a whole number >= 1."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError as error:
        raise ValueError(f"--np_file {path!r} cannot be read ({error.strerror}); it must hold "
                         "the number of ranks still available") from None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--np_file {path!r} holds {text[:40]!r}; it must hold the number of "
                         "ranks still available, a whole number >= 1")
    return int(text)


@dataclass
class Attempt:
    """One run of the job: which restart it is (0 for the first run), its rank count, and what
    came of it."""
    restart: int
    np: int
    code: int = None
    interrupted: bool = False
    first_gone: str = None      # "rank 2 (pid 123 on vm)", where fleetmpirun saw it
    progress: tuple = None      # (committed step, reached step) from rank 0, if it wrote one
    excluded: tuple = ()        # nodes left out of this attempt (--slurm)
    ranks_on_host: dict = field(default_factory=dict)  # host -> ranks run there

    def cause(self):
        """Why it failed, in words."""
        text = f"exit status {self.code}"
        if self.code is not None and self.code > 128:
            text += f" (signal {self.code - 128})"
        if self.first_gone:
            text += f"; ended first: {self.first_gone}"
        return text

    def steps_lost(self):
        """Steps reached after the last commit, or None when rank 0 recorded no progress."""
        if self.progress is None:
            return None
        committed, reached = self.progress
        return reached - committed

    def describe(self):
        lost = self.steps_lost()
        steps = ("steps lost unknown (no fleetmpi.training.elastic.State progress)" if lost is None
                 else f"{lost} step(s) lost (reached {self.progress[1]}, last commit "
                      f"{self.progress[0]})")
        return f"attempt {self.restart} with {self.np} rank(s) failed: {self.cause()}; {steps}"


def next_rank_count(attempt, first_np, np_file=None, excluded_ranks=0):
    """How many ranks the restart after ``attempt`` gets (see the module docstring)."""
    np = attempt.np if np_file is None else min(read_np_file(np_file), first_np)
    return np - excluded_ranks


def summary(attempts):
    """The final report of an elastic job, one line per restart."""
    restarts = len(attempts) - 1
    lines = [f"fleetmpirun: elastic: {restarts} restart(s); the last attempt ran "
             f"{attempts[-1].np} rank(s) and ended with status {attempts[-1].code}"]
    lines += [f"fleetmpirun: elastic: {attempt.describe()}" for attempt in attempts
              if attempt.code != 0]
    lost = [attempt.steps_lost() for attempt in attempts if attempt.code != 0]
    if lost and None not in lost:
        lines.append(f"fleetmpirun: elastic: {sum(lost)} step(s) lost in all")
    return "\n".join(lines)


def run(first_np, run_attempt, max_restarts, min_np, np_file=None, failed_nodes=None):
    """Run attempts until one succeeds, is interrupted, or no restart is allowed; the list of
    ``Attempt``s and, when the job was given up, the reason.

    ``run_attempt(restart, np, excluded)`` runs one attempt and returns its ``Attempt``;
    ``failed_nodes()`` (under ``--slurm``) names the nodes to leave out from now on."""
    attempts, excluded, np = [], (), first_np
    while True:
        attempt = run_attempt(len(attempts), np, excluded)
        attempts.append(attempt)
        if attempt.code == 0 or attempt.interrupted:
            return attempts, None
        if len(attempts) > max_restarts:
            return attempts, (f"{attempt.describe()}; no restart left (--max_restarts "
                              f"{max_restarts})")
        try:
            lost_ranks = 0
            if failed_nodes is not None:
                newly = sorted(set(failed_nodes()) - set(excluded))
                lost_ranks = sum(attempt.ranks_on_host.get(node, 0) for node in newly)
                excluded = tuple(excluded) + tuple(newly)
            np = next_rank_count(attempt, first_np, np_file, lost_ranks)
        except (ValueError, RuntimeError) as error:
            return attempts, f"{attempt.describe()}; cannot restart: {error}"
        if np < min_np:
            return attempts, (f"{attempt.describe()}; cannot restart: only {np} rank(s) are "
                              f"available, below --min_np {min_np}")
        where = f", leaving out node(s) {', '.join(excluded)}" if excluded else ""
        print(f"fleetmpirun: elastic: {attempt.describe()}; restart {len(attempts)} of at most "
              f"{max_restarts} with {np} rank(s){where}", file=sys.stderr, flush=True)

"""Elastic training: resume after ``fleetmpirun --elastic`` restarted a failed job.

    state = fleetmpi.training.elastic.State("ckpt", model, opt, commit_every=10)
    for step in range(state.restore(), total_steps):
        train_one_step(step)
        state.commit(step + 1)

``restore()`` loads the latest complete checkpoint in the folder (``fleetmpi.training.checkpoint``,
so a crash in the middle of a save leaves the previous one) and returns the number of steps it
holds, 0 when there is none. ``commit(step)`` saves every ``commit_every`` steps; every rank
calls both. A restart may run with fewer ranks than the checkpoint was written by: the model
and optimizer state are the same on every rank of a data-parallel job, so rank ``r`` takes
them from saved rank ``r % saved size`` (``checkpoint.load(..., replicated=True)``), and a
sharded optimizer's state is re-sharded. With a fixed global batch and
``fleetmpi.training.data.DistributedSampler`` (whose order does not depend on the number of ranks),
the resumed job trains on the same samples as an uninterrupted one.

The launcher tells each rank two things through the variables below, both set only under
``fleetmpirun --elastic``: which attempt this is, and a file where rank 0 keeps the last step
it reached and the last step it committed, from which ``fleetmpirun`` reports the steps a
failure lost.
"""
import os

from . import checkpoint
from ..core.knobs import ELASTIC_PROGRESS, RESTART_COUNT

# Width of the record, rewritten in place at every commit (spaces pad a shorter one).
_RECORD_BYTES = 48


def restart_count(environ=os.environ):
    """How many times ``fleetmpirun --elastic`` restarted this job before this attempt (0 when
    it did not, or outside such a launcher)."""
    return RESTART_COUNT.value(environ)


def _rank():
    from ..core import job

    return job.worker_index() if job.joined() else 0


def read_progress(path):
    """``(committed, reached)`` from a progress file rank 0 wrote; None when it wrote none."""
    try:
        with open(path) as f:
            fields = f.read().split()
    except FileNotFoundError:
        return None
    if len(fields) != 2 or not all(field.isdigit() for field in fields):
        return None
    return int(fields[0]), int(fields[1])


class State:
    """A training job's model and optimizer, saved every ``commit_every`` steps into
    ``directory`` and restored from there at start; see the module docstring."""

    def __init__(self, directory, model, optimizer=None, commit_every=1):
        if not isinstance(commit_every, int) or isinstance(commit_every, bool) \
                or commit_every < 1:
            raise ValueError(f"commit_every must be a whole number of steps >= 1, not "
                             f"{commit_every!r}")
        self.directory = directory
        self.model = model
        self.optimizer = optimizer
        self.commit_every = commit_every
        self.committed = 0
        self.restart_count = restart_count()
        self._progress_fd = None

    def restore(self):
        """Load the latest complete checkpoint, if any; the number of steps it holds (0 when
        there is none, and then nothing changes)."""
        if os.path.exists(os.path.join(self.directory, checkpoint.MANIFEST)):
            self.committed = checkpoint.load(self.directory, self.model, self.optimizer,
                                             replicated=True)["step"]
        self._record(self.committed)
        return self.committed

    def commit(self, step):
        """Record that ``step`` steps are done; every ``commit_every``-th one is saved (every
        rank must call it with the same ``step``)."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a whole number >= 0, not {step!r}")
        if step % self.commit_every == 0 and step != self.committed:
            checkpoint.save(self.directory, self.model, self.optimizer, step)
            self.committed = step
        self._record(step)

    def _record(self, reached):
        """Rewrite rank 0's progress record for the launcher, when it asked for one. No fsync:
        it has to survive this process, not the machine."""
        path = ELASTIC_PROGRESS.value()
        if not path or _rank() != 0:
            return
        if self._progress_fd is None:
            self._progress_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        text = f"{self.committed} {reached}".ljust(_RECORD_BYTES).encode()
        os.pwrite(self._progress_fd, text, 0)

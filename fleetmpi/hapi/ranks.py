"""The ranks a ``Model`` trains over, and what it asks of them.

Paddle's ``Model`` runs data parallel by itself when its script was launched on several
ranks: it joins the job and wraps the network in ``DataParallel``. So does this one: started
by ``mpiexec``, ``srun`` or ``fleetmpirun`` with several ranks it calls ``fleet.init`` (in
collective mode) unless the script did, and trains through ``fleetmpi.DataParallel`` (rank
0's parameters on every rank, gradients averaged over the ranks by ``backward``, or by the
strategies of a ``fleet.distributed_optimizer`` the script passed to ``prepare``).

What each rank computes on its own shard is then made the job's: the outputs and labels the
metrics see are gathered from every rank (so every rank's metrics are those of one process
on the global batch), a pass over a dataset drops the samples ``DistributedBatchSampler``
repeated to even out the ranks (``Coverage``), and the loss logged is the mean of the ranks'
losses weighted by their batch sizes. Every rank therefore logs the same numbers.
"""
import numpy as np
from mpi4py import MPI

from .. import world
from ..core import backend, job
from ..autograd import Tensor
from ..distributed import DataParallel
from ..fleet_util import util


def host(value):
    """A Tensor's or an array's values as a NumPy array."""
    return value.numpy() if isinstance(value, Tensor) else backend.to_numpy(value)


class Ranks:
    """This process's rank among ``nranks`` and, for training, ``network`` as the ranks share
    it (``train_network``: the network itself on one rank)."""

    def __init__(self, network):
        if not job.joined() and MPI.COMM_WORLD.Get_size() > 1:
            world.init(is_collective=True)
        if job.joined() and job.roles() is not None:
            raise ValueError("Model trains data parallel in collective mode; this job runs in "
                             "parameter-server mode (fleet.init(is_collective=False))")
        self.nranks = job.worker_num() if job.joined() else 1
        self.rank = job.worker_index() if job.joined() else 0
        self.train_network = DataParallel(network) if self.nranks > 1 else network

    def gather(self, arrays):
        """Each of ``arrays`` (NumPy, batch first) joined over the ranks in rank order."""
        if self.nranks == 1:
            return list(arrays)
        return [np.concatenate(util.all_gather(np.ascontiguousarray(a))) for a in arrays]

    def mean_losses(self, losses, samples):
        """The mean of each of ``losses`` (numbers) over the ranks, weighted by each rank's
        ``samples``, as float32 arrays."""
        if self.nranks == 1:
            return [np.asarray(loss, np.float32) for loss in losses]
        local = np.array([float(loss) * samples for loss in losses] + [samples], np.float64)
        summed = util.all_reduce(local, mode="sum")
        return [np.asarray(total / summed[-1], np.float32) for total in summed[:-1]]


class Coverage:
    """The samples of one pass over a dataset of ``total`` samples taken so far: ``take`` says
    how many of a batch's are not past the end (``DistributedBatchSampler`` deals the ranks
    equal shares by repeating the first samples, which the last batch then holds).
    ``last``: how many the latest batch kept."""

    def __init__(self, total):
        self.total = total
        self.seen = 0
        self.last = None

    def take(self, rows):
        self.last = max(0, min(rows, self.total - self.seen))
        self.seen += self.last
        return self.last

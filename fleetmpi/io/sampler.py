"""Paddle's samplers (``paddle.io``): which samples, in which order, in which batches.

``DistributedBatchSampler`` gives each rank its own batches of one shared order, as Paddle's
does, so a script moving from Paddle gets the same shards: the order (shuffled by the epoch
when ``shuffle``) is padded by repeating its head to a multiple of the ranks, and then dealt
batch by batch: rank r takes the r-th run of ``batch_size`` indices of every group of
``num_replicas * batch_size``, and an equal share of the last, partial group. Every rank
therefore has the same number of samples; with ``drop_last`` each drops its last partial
batch, so every rank also runs the same number of steps.
"""
import math

import numpy as np


def _count(name, value, low):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, not {value!r}")
    return int(value)


class Sampler:
    """Indices of a dataset, one at a time: subclass it and define ``__iter__`` (and
    ``__len__`` where the count is known)."""

    def __init__(self, data_source=None):
        self.data_source = data_source

    def __iter__(self):
        raise NotImplementedError(f"{type(self).__name__} must define __iter__")


class SequenceSampler(Sampler):
    """0, 1, ..., ``len(data_source) - 1``."""

    def __iter__(self):
        return iter(range(len(self.data_source)))

    def __len__(self):
        return len(self.data_source)


class RandomSampler(Sampler):
    """A random permutation of the dataset's indices each time it is iterated, from NumPy's
    global generator (``numpy.random.seed`` or ``fleet.seed`` make it repeatable), or from
    ``generator`` (a ``numpy.random.Generator``)."""

    def __init__(self, data_source, generator=None):
        super().__init__(data_source)
        self.generator = generator

    def __iter__(self):
        count = len(self.data_source)
        order = (self.generator.permutation(count) if self.generator is not None
                 else np.random.permutation(count))
        return iter(order.tolist())

    def __len__(self):
        return len(self.data_source)


class SubsetRandomSampler(Sampler):
    """The given ``indices`` in a random order each time it is iterated (the generator as
    ``RandomSampler``'s)."""

    def __init__(self, indices, generator=None):
        super().__init__(None)
        self.indices, self.generator = list(indices), generator

    def __iter__(self):
        order = (self.generator.permutation(len(self.indices)) if self.generator is not None
                 else np.random.permutation(len(self.indices)))
        return iter([self.indices[i] for i in order])

    def __len__(self):
        return len(self.indices)


class WeightedRandomSampler(Sampler):
    """``num_samples`` indices drawn with probability proportional to ``weights`` (one per
    index), with or without ``replacement``, from NumPy's global generator."""

    def __init__(self, weights, num_samples, replacement=True):
        weights = np.asarray(getattr(weights, "numpy", lambda: weights)(), dtype=np.float64)
        if weights.ndim != 1 or not weights.size or (weights < 0).any() \
                or not weights.sum() > 0:
            raise ValueError(f"weights must be a 1-d sequence of numbers >= 0, not all 0, "
                             f"not {weights!r}")
        self.num_samples = _count("num_samples", num_samples, 1)
        if not replacement and self.num_samples > int((weights > 0).sum()):
            raise ValueError(f"num_samples={num_samples} without replacement needs as many "
                             f"indices of weight > 0, and there are {int((weights > 0).sum())}")
        super().__init__(None)
        self.weights, self.replacement = weights, bool(replacement)

    def __iter__(self):
        drawn = np.random.choice(len(self.weights), self.num_samples, self.replacement,
                                 self.weights / self.weights.sum())
        return iter(drawn.tolist())

    def __len__(self):
        return self.num_samples


class BatchSampler(Sampler):
    """Lists of ``batch_size`` indices: from ``sampler``, or from ``dataset`` in order (or
    shuffled); the last shorter batch is kept unless ``drop_last``."""

    def __init__(self, dataset=None, sampler=None, shuffle=False, batch_size=1, drop_last=False):
        if (dataset is None) == (sampler is None):
            raise ValueError("BatchSampler takes a dataset or a sampler, exactly one of them")
        if sampler is not None and shuffle:
            raise ValueError("shuffle applies to a dataset; a sampler sets its own order")
        super().__init__(dataset)
        self.sampler = sampler if sampler is not None else (
            RandomSampler(dataset) if shuffle else SequenceSampler(dataset))
        self.batch_size = _count("batch_size", batch_size, 1)
        self.drop_last = bool(drop_last)

    def __iter__(self):
        batch = []
        for index in self.sampler:
            batch.append(int(index))
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __len__(self):
        count = len(self.sampler)
        return count // self.batch_size if self.drop_last else math.ceil(count / self.batch_size)


def fleet_world():
    from ..core import job

    return (job.worker_num(), job.worker_index()) if job.joined() else (1, 0)


class DistributedBatchSampler(BatchSampler):
    """This rank's batches of ``dataset`` (module docstring). ``num_replicas`` and ``rank``
    default to the fleet world (a world of one before ``fleet.init``). Call
    ``set_epoch(epoch)`` before each epoch: the shuffle of an epoch is the same on every rank
    and differs between epochs."""

    def __init__(self, dataset, batch_size, num_replicas=None, rank=None, shuffle=False,
                 drop_last=False):
        world_size, world_rank = fleet_world()
        self.dataset = self.data_source = dataset
        self.batch_size = _count("batch_size", batch_size, 1)
        self.nranks = (world_size if num_replicas is None
                       else _count("num_replicas", num_replicas, 1))
        self.local_rank = world_rank if rank is None else _count("rank", rank, 0)
        if self.local_rank >= self.nranks:
            raise ValueError(f"rank {self.local_rank} must be below num_replicas {self.nranks}")
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.num_samples = math.ceil(len(dataset) / self.nranks)
        self.total_size = self.num_samples * self.nranks

    def set_epoch(self, epoch):
        self.epoch = _count("epoch", epoch, 0)

    def _order(self):
        order = np.arange(len(self.dataset))
        if self.shuffle:
            np.random.RandomState(self.epoch).shuffle(order)
        repeats = math.ceil(self.total_size / max(len(order), 1))
        return np.tile(order, repeats)[:self.total_size]

    def local_indices(self):
        """This rank's ``num_samples`` indices of the epoch, in the order they are batched."""
        order, group = self._order(), self.batch_size * self.nranks
        whole = self.total_size - self.total_size % group
        mine = [order[start + self.local_rank * self.batch_size:
                      start + (self.local_rank + 1) * self.batch_size]
                for start in range(0, whole, group)]
        tail_share = (self.total_size - whole) // self.nranks
        mine.append(order[whole + self.local_rank * tail_share:
                          whole + (self.local_rank + 1) * tail_share])
        return np.concatenate(mine).tolist()

    def __iter__(self):
        indices = self.local_indices()
        for start in range(0, len(indices), self.batch_size):
            batch = indices[start:start + self.batch_size]
            if len(batch) == self.batch_size or not self.drop_last:
                yield batch

    def __len__(self):
        return (self.num_samples // self.batch_size if self.drop_last
                else math.ceil(self.num_samples / self.batch_size))

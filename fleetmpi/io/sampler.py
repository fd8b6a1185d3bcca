"""Paddle's samplers (``paddle.io``): which samples, in which order, in which batches.

``DistributedBatchSampler`` gives each rank its own batches of one shared order, as Paddle's
does, so a script moving from Paddle gets the same shards: the order (shuffled by the epoch
when ``shuffle``) is padded by repeating its head to a multiple of the ranks, and then dealt
batch by batch: rank r takes the r-th run of ``batch_size`` indices of every group of
``num_replicas * batch_size``, and an equal share of the last, partial group. Every rank
therefore has the same number of samples; with ``drop_last`` each drops its last partial
batch, so every rank also runs the same number of steps.
"""
import itertools
import math

import numpy as np


def _count(name, value, low):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, not {value!r}")
    return int(value)


def _flag(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, not {value!r}")
    return bool(value)


class SamplerArgumentError(ValueError, AssertionError):
    """A sampler's argument that does not fit: a ``ValueError``, and an ``AssertionError`` as
    Paddle's samplers raise from their asserts (a ``BatchSampler`` given a sampler and
    ``shuffle``, a ``WeightedRandomSampler`` drawing from weights that cannot be drawn from)."""


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
    """A random permutation of the dataset's indices each time it is iterated, or with
    ``replacement`` ``num_samples`` indices drawn independently (by default as many as the
    dataset has), from NumPy's global generator (``numpy.random.seed`` or ``fleet.seed`` make
    it repeatable) or from ``generator``: a ``numpy.random.Generator`` draws them; any other
    iterator is Paddle's form, whose items are the indices (at most ``num_samples`` of them)."""

    def __init__(self, data_source, replacement=False, num_samples=None, generator=None):
        super().__init__(data_source)
        self.replacement = _flag("replacement", replacement)
        if num_samples is not None and not self.replacement:
            raise ValueError(f"num_samples={num_samples!r} is for drawing with replacement; "
                             f"without it the sampler gives each index once")
        self._num_samples = None if num_samples is None else _count("num_samples", num_samples, 1)
        self.generator = generator

    @property
    def num_samples(self):
        return len(self.data_source) if self._num_samples is None else self._num_samples

    def __iter__(self):
        if self.generator is not None and not isinstance(self.generator, np.random.Generator):
            return itertools.islice(self.generator, self.num_samples)
        draw = self.generator if self.generator is not None else np.random
        count = len(self.data_source)
        order = (draw.choice(count, self.num_samples, replace=True) if self.replacement
                 else draw.permutation(count))
        return iter(order.tolist())

    def __len__(self):
        return self.num_samples


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
    index), with or without ``replacement``, from NumPy's global generator. As Paddle's, the
    weights are checked when drawing (``SamplerArgumentError``), the counts when built."""

    def __init__(self, weights, num_samples, replacement=True):
        self.num_samples = _count("num_samples", num_samples, 1)
        super().__init__(None)
        self.weights = np.asarray(getattr(weights, "numpy", lambda: weights)(), dtype=np.float64)
        self.replacement = _flag("replacement", replacement)

    def _check_weights(self):
        weights = self.weights
        if weights.ndim != 1 or not weights.size or (weights < 0).any() \
                or not weights.sum() > 0:
            raise SamplerArgumentError(f"weights must be a 1-d sequence of numbers >= 0, "
                                       f"not all 0, not {weights!r}")
        if not self.replacement and self.num_samples > int((weights > 0).sum()):
            raise SamplerArgumentError(
                f"num_samples={self.num_samples} without replacement needs as many indices "
                f"of weight > 0, and there are {int((weights > 0).sum())}")

    def __iter__(self):
        self._check_weights()
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
            raise SamplerArgumentError("BatchSampler takes a dataset or a sampler, exactly one "
                                       "of them")
        if sampler is not None and shuffle:
            raise SamplerArgumentError("shuffle applies to a dataset; a sampler sets its own "
                                       "order")
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

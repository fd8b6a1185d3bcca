"""Data for training: a distributed sampler, batches on the backend's device, and the datasets
(scikit-learn's bundled digits, synthetic images of any shape).

Every rank must run the same number of steps per epoch, or the last collective waits forever.
``DistributedSampler`` pads the dataset to a multiple of the number of ranks by resampling
indices (the seeds' recommendation, so the whole dataset is still trained on), shuffles with one
permutation per epoch shared by all ranks, and deals each rank a disjoint shard of it.
"""
import math

import numpy as np

from ..core import backend
from ..core.extras import MissingExtra


def _check_int(name, value, low):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, not {value!r}")
    return int(value)


def _world():
    from ..core import job

    return (job.worker_num(), job.worker_index()) if job.joined() else (1, 0)


class DistributedSampler:
    """Indices of this rank's shard of a dataset of ``num_samples``, in per-rank batches of
    ``batch_size``; every rank gets ``num_batches`` batches of equal size. Call
    ``set_epoch(epoch)`` before each epoch to reshuffle. ``num_replicas`` and ``rank`` default to
    the fleet world (or a world of one before ``fleet.init``)."""

    def __init__(self, num_samples, batch_size, num_replicas=None, rank=None, shuffle=True,
                 seed=None, drop_last=False):
        world_size, world_rank = _world()
        self.num_samples = _check_int("num_samples", num_samples, 1)
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.num_replicas = world_size if num_replicas is None else _check_int(
            "num_replicas", num_replicas, 1)
        self.rank = world_rank if rank is None else _check_int("rank", rank, 0)
        if self.rank >= self.num_replicas:
            raise ValueError(f"rank {self.rank} is not below num_replicas {self.num_replicas}")
        self.shuffle = bool(shuffle)
        self.seed = backend.get_seed() if seed is None else _check_int("seed", seed, 0)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.shard_size = math.ceil(self.num_samples / self.num_replicas)
        if self.drop_last:
            self.num_batches = self.shard_size // self.batch_size
            if self.num_batches == 0:
                raise ValueError(f"drop_last with batch_size {self.batch_size} leaves no batch "
                                 f"of a shard of {self.shard_size} samples")
        else:
            self.num_batches = math.ceil(self.shard_size / self.batch_size)

    def set_epoch(self, epoch):
        self.epoch = _check_int("epoch", epoch, 0)

    def global_order(self):
        """This epoch's order of all samples, padded by resampling to a multiple of the ranks;
        the same on every rank."""
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 2, self.epoch]))
        order = (rng.permutation(self.num_samples) if self.shuffle
                 else np.arange(self.num_samples))
        padding = self.shard_size * self.num_replicas - self.num_samples
        if padding:
            order = np.concatenate([order, rng.choice(self.num_samples, padding,
                                                      replace=padding > self.num_samples)])
        return order

    def indices(self):
        """This rank's shard for this epoch."""
        return self.global_order()[self.rank::self.num_replicas]

    def __len__(self):
        return self.num_batches

    def __iter__(self):
        shard = self.indices()
        for b in range(self.num_batches):
            yield shard[b * self.batch_size:(b + 1) * self.batch_size]


class ArrayDataset:
    """Features and integer labels held on the host; ``batch(indices)`` copies the selected rows
    to the backend's device."""

    def __init__(self, features, labels):
        features, labels = np.asarray(features), np.asarray(labels)
        if len(features) != len(labels):
            raise ValueError(f"{len(features)} feature rows but {len(labels)} labels")
        self.features = features
        self.labels = labels

    def __len__(self):
        return len(self.labels)

    def batch(self, indices):
        return backend.asarray(self.features[indices]), backend.asarray(self.labels[indices])

    def batches(self, sampler):
        """``(x, y)`` for every batch of ``sampler`` this epoch."""
        for indices in sampler:
            yield self.batch(indices)


def load_digits(dtype="float32", test_fraction=0.2, seed=0):
    """scikit-learn's bundled 8x8 digits (1797 images, nothing downloaded), pixels scaled to
    [0, 1] and flattened to 64 features; returns ``(train, test)`` ``ArrayDataset``s split by a
    fixed shuffle, so every rank sees the same split."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        raise MissingExtra("the digits dataset", "scikit-learn", "examples") from None
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must lie in (0, 1), not {test_fraction!r}")
    digits = sklearn_digits()
    features = (digits.data / 16.0).astype(dtype)
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    cut = int(round(len(labels) * (1 - test_fraction)))
    train, test = order[:cut], order[cut:]
    return ArrayDataset(features[train], labels[train]), ArrayDataset(features[test],
                                                                      labels[test])


def synthetic_images(num_samples, shape=(3, 32, 32), num_classes=10, dtype="float32", seed=0):
    """Random normal images of ``shape`` and uniform random labels, for throughput runs."""
    num_samples = _check_int("num_samples", num_samples, 1)
    num_classes = _check_int("num_classes", num_classes, 1)
    shape = tuple(_check_int("shape entry", s, 1) for s in shape)
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((num_samples,) + shape, dtype=np.float32).astype(dtype)
    return ArrayDataset(features, rng.integers(0, num_classes, num_samples))

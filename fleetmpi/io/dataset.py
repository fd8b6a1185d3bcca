"""Paddle's dataset classes (``paddle.io``): what a ``DataLoader`` reads samples from, and
``random_split``."""
import math

import numpy as np

from ..autograd.tensor import Tensor


class Dataset:
    """A map-style dataset: ``dataset[i]`` is sample ``i`` (an array, a number, or a tuple,
    list or dict of them), ``len(dataset)`` how many there are. Subclass it and define both."""

    def __getitem__(self, index):
        raise NotImplementedError(f"{type(self).__name__} must define __getitem__")

    def __len__(self):
        raise NotImplementedError(f"{type(self).__name__} must define __len__")


class IterableDataset(Dataset):
    """A stream of samples: ``iter(dataset)`` yields them. Subclass it and define
    ``__iter__``; a ``DataLoader`` batches the stream in order (no sampler, no shuffle). With
    workers, each worker iterates its own copy: split the stream in ``__iter__`` by
    ``get_worker_info()``, or every worker yields every sample."""

    def __iter__(self):
        raise NotImplementedError(f"{type(self).__name__} must define __iter__")

    def __getitem__(self, index):
        raise TypeError(f"{type(self).__name__} is an IterableDataset: iterate it, it has no "
                        f"samples by index")

    def __len__(self):
        # a TypeError, as for any object without a length: list(dataset) then just iterates
        raise TypeError(f"{type(self).__name__} is an IterableDataset: it has no length")


def _host(value):
    return value.numpy() if isinstance(value, Tensor) else np.asarray(value)


class TensorDataset(Dataset):
    """Samples from arrays or tensors of the same first dimension: sample ``i`` is the tuple
    of their rows ``i``."""

    def __init__(self, tensors):
        arrays = [_host(t) for t in tensors]
        if not arrays:
            raise ValueError("TensorDataset needs at least one tensor")
        lengths = {a.shape[0] if a.ndim else None for a in arrays}
        if None in lengths or len(lengths) != 1:
            raise ValueError("TensorDataset's tensors must share their first dimension, got "
                             f"shapes {[a.shape for a in arrays]}")
        self.tensors = arrays

    def __getitem__(self, index):
        return tuple(a[index] for a in self.tensors)

    def __len__(self):
        return self.tensors[0].shape[0]


class Subset(Dataset):
    """The samples of ``dataset`` at ``indices``, in that order."""

    def __init__(self, dataset, indices):
        self.dataset, self.indices = dataset, list(indices)

    def __getitem__(self, index):
        return self.dataset[self.indices[index]]

    def __len__(self):
        return len(self.indices)


class ComposeDataset(Dataset):
    """Map-style datasets of one length side by side: sample ``i`` is the tuple of the fields
    of every dataset's sample ``i`` (a sample that is not a tuple or list is one field)."""

    def __init__(self, datasets):
        self.datasets = list(datasets)
        if not self.datasets:
            raise ValueError("ComposeDataset needs at least one dataset")
        for dataset in self.datasets:
            if isinstance(dataset, IterableDataset):
                raise TypeError(f"ComposeDataset takes map-style datasets, not the "
                                f"IterableDataset {type(dataset).__name__}")
        lengths = [len(d) for d in self.datasets]
        if len(set(lengths)) != 1:
            raise ValueError(f"ComposeDataset's datasets must have one length, got {lengths}")

    def __getitem__(self, index):
        fields = []
        for dataset in self.datasets:
            sample = dataset[index]
            fields.extend(sample if isinstance(sample, (tuple, list)) else [sample])
        return tuple(fields)

    def __len__(self):
        return len(self.datasets[0])


class ChainDataset(IterableDataset):
    """Iterable datasets one after the other."""

    def __init__(self, datasets):
        self.datasets = list(datasets)
        for dataset in self.datasets:
            if not isinstance(dataset, IterableDataset):
                raise TypeError(f"ChainDataset takes IterableDatasets, not "
                                f"{type(dataset).__name__}")

    def __iter__(self):
        for dataset in self.datasets:
            yield from dataset


def _split_lengths(lengths, total):
    """Whole lengths summing to ``total``: ``lengths`` as given, or fractions summing to 1
    turned into counts (rounded down, the rest dealt one by one from the first)."""
    lengths = list(lengths)
    if lengths and all(isinstance(n, float) for n in lengths) \
            and math.isclose(sum(lengths), 1.0) and all(0 <= n <= 1 for n in lengths):
        counts = [int(math.floor(total * n)) for n in lengths]
        for i in range(total - sum(counts)):
            counts[i % len(counts)] += 1
        return counts
    if any(not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0
           for n in lengths) or sum(lengths) != total:
        raise ValueError(f"random_split lengths {lengths!r} must be integers >= 0 summing to "
                         f"the dataset's length {total}, or fractions summing to 1")
    return [int(n) for n in lengths]


def random_split(dataset, lengths, generator=None):
    """``Subset``s of ``dataset`` of the given ``lengths`` (or fractions), of one random
    permutation of its indices, from NumPy's global generator (``fleet.seed`` or
    ``numpy.random.seed`` make it repeatable) or from ``generator`` (a
    ``numpy.random.Generator``), as ``RandomSampler`` draws."""
    counts = _split_lengths(lengths, len(dataset))
    total = len(dataset)
    order = (generator.permutation(total) if generator is not None
             else np.random.permutation(total)).tolist()
    subsets, start = [], 0
    for count in counts:
        subsets.append(Subset(dataset, order[start:start + count]))
        start += count
    return subsets

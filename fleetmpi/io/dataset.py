"""Paddle's dataset classes (``paddle.io``): what a ``DataLoader`` reads samples from."""
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

"""Batches from samples: ``default_collate_fn`` stacks on the host, ``to_tensors`` moves a
batch to the backend's device as Tensors (in the main process: workers never touch a
device)."""
import numbers

import numpy as np

from ..autograd.tensor import Tensor, to_tensor


def default_collate_fn(samples):
    """Stack a list of samples into one batch of the same structure: arrays and numbers become
    an array with a leading batch axis; tuples, lists and dicts are collated field by field;
    strings become a list."""
    first = samples[0]
    if isinstance(first, Tensor):
        return np.stack([s.numpy() for s in samples])
    if isinstance(first, (np.ndarray, np.generic)):
        return np.stack(samples)
    if isinstance(first, numbers.Number):
        return np.asarray(samples)
    if isinstance(first, (str, bytes)):
        return list(samples)
    if isinstance(first, dict):
        return {key: default_collate_fn([s[key] for s in samples]) for key in first}
    if isinstance(first, (tuple, list)):
        if any(len(s) != len(first) for s in samples):
            raise ValueError("the samples of a batch must have the same number of fields, got "
                             f"{sorted({len(s) for s in samples})}")
        return [default_collate_fn(list(field)) for field in zip(*samples)]
    raise TypeError(f"default_collate_fn cannot batch samples of type {type(first).__name__}: "
                    "give the DataLoader a collate_fn")


def to_tensors(batch):
    """``batch`` with every array replaced by a Tensor on the backend's device."""
    if isinstance(batch, np.ndarray) and batch.dtype.kind in "biuf":
        return to_tensor(batch)
    if isinstance(batch, dict):
        return {key: to_tensors(value) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return [to_tensors(value) for value in batch]
    return batch

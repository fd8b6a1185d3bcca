"""Paddle's data loading (``paddle.io``): datasets, samplers and the ``DataLoader``.

A distributed script gives its ``DataLoader`` a ``DistributedBatchSampler``: each rank then
reads its own batches of one shared order, every rank the same number of them.
"""
from ..core.paddle_names import module_getattr as _module_getattr
from .collate import default_collate_fn
from .dataloader import DataLoader
from .dataset import (ChainDataset, ComposeDataset, Dataset, IterableDataset, Subset,
                      TensorDataset, random_split)
from .sampler import (BatchSampler, DistributedBatchSampler, RandomSampler, Sampler,
                      SamplerArgumentError, SequenceSampler, SubsetRandomSampler,
                      WeightedRandomSampler)
from .workers import WorkerError, WorkerInfo, get_worker_info

__all__ = ["BatchSampler", "ChainDataset", "ComposeDataset", "DataLoader", "Dataset",
           "DistributedBatchSampler", "IterableDataset", "RandomSampler", "Sampler",
           "SamplerArgumentError", "SequenceSampler", "Subset", "SubsetRandomSampler",
           "TensorDataset", "WeightedRandomSampler", "WorkerError", "WorkerInfo",
           "default_collate_fn", "get_worker_info", "random_split"]


# A name Paddle has and fleetmpi lacks raises an error that says so (core.paddle_names).
__getattr__ = _module_getattr(__name__, "paddle.io", globals())

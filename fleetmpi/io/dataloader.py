"""Paddle's ``DataLoader`` (``paddle.io.DataLoader``): batches of a dataset as Tensors on the
backend's device, loaded in worker processes ahead of the loop when ``num_workers > 0``."""
import numpy as np

from ..core import backend
from .collate import default_collate_fn, to_tensors
from .dataset import IterableDataset
from .sampler import BatchSampler, fleet_world
from .workers import WorkerPool


def _count(name, value, low):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, not {value!r}")
    return int(value)


class DataLoader:
    """Iterate ``dataset`` in batches. The batches come from ``batch_sampler`` (a
    ``DistributedBatchSampler`` gives each rank its own), or from ``batch_size``,
    ``shuffle`` and ``drop_last`` over the whole dataset. ``collate_fn`` turns a list of
    samples into a batch on the host (``default_collate_fn`` stacks them); the loader then
    moves every array of it to the device as a Tensor (``return_list``: a list for a tuple
    or list batch, as Paddle's dygraph loader returns). ``num_workers`` worker processes
    load ``prefetch_factor`` batches each ahead of the loop (``workers.py``);
    ``worker_init_fn(worker_id)`` runs first in each; ``timeout`` (seconds, 0 for none)
    bounds the wait for one batch. Workers start for each pass over the data.
    ``feed_list``, ``places``, ``use_buffer_reader``, ``use_shared_memory`` and
    ``persistent_workers`` are taken for Paddle's signature and change nothing here."""

    def __init__(self, dataset, feed_list=None, places=None, return_list=True,
                 batch_sampler=None, batch_size=1, shuffle=False, drop_last=False,
                 collate_fn=None, num_workers=0, use_buffer_reader=True, prefetch_factor=2,
                 use_shared_memory=True, timeout=0, worker_init_fn=None,
                 persistent_workers=False):
        if not return_list:
            raise ValueError("return_list=False is Paddle's static-graph form; fleetmpi is "
                             "dygraph only: leave return_list=True")
        self.dataset = dataset
        self.iterable = isinstance(dataset, IterableDataset)
        self.batch_size = None if batch_size is None else _count("batch_size", batch_size, 1)
        self.drop_last = bool(drop_last)
        if self.iterable:
            if batch_sampler is not None or shuffle:
                raise ValueError("an IterableDataset has no indices: it takes neither a "
                                 "batch_sampler nor shuffle")
            self.batch_sampler = None
        elif batch_sampler is not None:
            if batch_size != 1 or shuffle or drop_last:
                raise ValueError("batch_sampler sets the batches: give it without batch_size, "
                                 "shuffle or drop_last")
            self.batch_sampler = batch_sampler
        else:
            self.batch_sampler = BatchSampler(dataset, shuffle=shuffle,
                                              batch_size=self.batch_size or 1,
                                              drop_last=drop_last)
        self.collate_fn = collate_fn or default_collate_fn
        self.num_workers = _count("num_workers", num_workers, 0)
        self.prefetch_factor = _count("prefetch_factor", prefetch_factor, 1)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout < 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, not {timeout!r}")
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self._epochs = 0

    def __len__(self):
        if self.iterable:
            raise TypeError("the length of a DataLoader over an IterableDataset is unknown")
        return len(self.batch_sampler)

    def _fetch(self, indices):
        return self.collate_fn([self.dataset[i] for i in indices])

    def _stream(self):
        batch = []
        for sample in self.dataset:
            batch.append(sample)
            if len(batch) == self.batch_size:
                yield self.collate_fn(batch)
                batch = []
        if batch and not self.drop_last:
            yield self.collate_fn(batch)

    def _host_batches(self):
        if self.num_workers == 0:
            return self._stream() if self.iterable else map(self._fetch, self.batch_sampler)
        self._epochs += 1
        pool = WorkerPool(self.num_workers, self.dataset,
                          self._stream if self.iterable else self._fetch,
                          _worker_seed(self._epochs), self.worker_init_fn, self.timeout)
        return _closing(pool, pool.stream() if self.iterable else pool.run(
            self.batch_sampler, self.num_workers * self.prefetch_factor))

    def __iter__(self):
        for batch in self._host_batches():
            yield to_tensors(batch)

    def __call__(self):
        return self.__iter__()


def _worker_seed(epoch):
    """The first worker's NumPy seed for this pass over the data (worker ``i`` adds ``i``):
    from ``fleet.seed``, the rank and the pass, so workers of different ranks and epochs draw
    differently, and a rerun draws the same."""
    sequence = np.random.SeedSequence([backend.get_seed(), fleet_world()[1], epoch])
    return int(sequence.generate_state(1)[0])


def _closing(pool, batches):
    """``batches``, with ``pool`` closed when they end or the loop leaves early."""
    try:
        yield from batches
    finally:
        pool.close()

"""``fleetmpi.io``: Paddle's datasets, samplers and DataLoader, its worker processes included."""
import multiprocessing
import os
import time

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.io import (BatchSampler, DataLoader, Dataset, DistributedBatchSampler,
                         IterableDataset, TensorDataset, WorkerError, default_collate_fn,
                         get_worker_info)

from comm_support import equal, ok


def _shards(size, ranks, batch, shuffle=False, drop_last=False, epoch=0):
    samplers = [DistributedBatchSampler(range(size), batch, num_replicas=ranks, rank=r,
                                        shuffle=shuffle, drop_last=drop_last)
                for r in range(ranks)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    return [list(s) for s in samplers], samplers


def test_distributed_batch_sampler_deals_batches_as_paddle_does():
    """10 samples, 3 ranks, batches of 3: the order padded by its head to 12 (0..9, 0, 1),
    each rank a run of 3 from the first group of 9, then one each of the last 3."""
    batches, samplers = _shards(10, 3, 3)
    assert batches == [[[0, 1, 2], [9]], [[3, 4, 5], [0]], [[6, 7, 8], [1]]]
    assert [len(s) for s in samplers] == [2, 2, 2]
    dropped, samplers = _shards(10, 3, 3, drop_last=True)
    assert dropped == [[[0, 1, 2]], [[3, 4, 5]], [[6, 7, 8]]]
    assert [len(s) for s in samplers] == [1, 1, 1]


@pytest.mark.parametrize("size, ranks, batch", [(10, 4, 2), (17, 3, 4), (8, 2, 8), (5, 4, 1),
                                                (3, 4, 2), (100, 3, 7)])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_rank_has_as_many_batches_and_all_ranks_cover_the_data(size, ranks, batch,
                                                                      shuffle, drop_last):
    batches, samplers = _shards(size, ranks, batch, shuffle, drop_last, epoch=3)
    assert len({len(b) for b in batches}) == 1
    assert all(len(b) == len(s) for b, s in zip(batches, samplers))
    for step in zip(*batches):  # every step has one batch size on every rank
        assert len({len(b) for b in step}) == 1
    if not drop_last:
        dealt = sorted(i for rank in batches for b in rank for i in b)
        padded = -(-size // ranks) * ranks
        assert len(dealt) == padded and set(dealt) == set(range(size))
        assert all(dealt.count(i) <= -(-padded // size) for i in range(size))


def test_set_epoch_reshuffles_the_same_way_on_every_rank():
    first, _ = _shards(40, 2, 4, shuffle=True, epoch=0)
    again, _ = _shards(40, 2, 4, shuffle=True, epoch=0)
    second, _ = _shards(40, 2, 4, shuffle=True, epoch=1)
    assert first == again and first != second
    for batches in (first, second):
        assert sorted(i for rank in batches for b in rank for i in b) == list(range(40))


class Squares(Dataset):
    """Sample i: (a float32 row of i, i squared); a sample named in ``fail`` raises, one in
    ``die`` ends its worker, one in ``slow`` sleeps first (30 s), one in ``late`` 0.5 s."""

    def __init__(self, size=23, fail=(), die=(), slow=(), late=()):
        self.size, self.fail, self.die, self.slow, self.late = size, fail, die, slow, late

    def __getitem__(self, index):
        if index in self.late:
            time.sleep(0.5)
        if index in self.fail:
            raise KeyError(f"sample {index} is damaged")
        if index in self.die and get_worker_info() is not None:
            os._exit(3)
        if index in self.slow:
            time.sleep(30)
        return np.full(3, index, np.float32), index * index

    def __len__(self):
        return self.size


def _host(loader):
    return [[t.numpy() for t in batch] for batch in loader]


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_workers_give_the_batches_of_the_main_process_in_order(num_workers):
    sampler = DistributedBatchSampler(Squares(), 4, num_replicas=2, rank=1, shuffle=True)
    want = _host(DataLoader(Squares(), batch_sampler=sampler))
    got = _host(DataLoader(Squares(), batch_sampler=sampler, num_workers=num_workers,
                           prefetch_factor=1))
    assert len(got) == len(want) == len(sampler) == 3
    for got_batch, want_batch in zip(got, want):
        for g, w in zip(got_batch, want_batch):
            np.testing.assert_array_equal(g, w)
    x, y = got[0]
    assert x.dtype == np.float32 and x.shape == (4, 3) and y.dtype == np.int64
    np.testing.assert_array_equal(y, x[:, 0].astype(np.int64) ** 2)


def test_a_worker_that_raises_ends_the_loop_with_its_traceback():
    """Batch 2 (worker 0) fails while batch 1 (worker 1) is still being made: the loop hands
    out batch 1 first, then raises."""
    loader = DataLoader(Squares(fail={9}, late={4}), batch_size=4, num_workers=2)
    seen = []
    with pytest.raises(WorkerError) as error:
        for x, _ in loader:
            seen.append(x.numpy()[0, 0])
    text = str(error.value)
    assert "DataLoader worker 0" in text and "KeyError: 'sample 9 is damaged'" in text
    assert "__getitem__" in text  # the worker's traceback, down to the user's code
    assert seen == [0, 4]  # the batches before the damaged one came through, in order
    assert not multiprocessing.active_children()


def test_a_worker_that_dies_ends_the_loop_naming_it():
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"worker 1 \(pid \d+\) died with exit code 3"):
        list(DataLoader(Squares(die={5}), batch_size=4, num_workers=2))
    assert time.monotonic() - start < 20
    assert not multiprocessing.active_children()


def test_timeout_bounds_the_wait_for_a_batch():
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"within timeout=1 s"):
        list(DataLoader(Squares(slow={2}), batch_size=4, num_workers=1, timeout=1))
    assert time.monotonic() - start < 20
    assert not multiprocessing.active_children()


def test_leaving_the_loop_early_stops_the_workers():
    loader = DataLoader(Squares(), batch_size=2, num_workers=2)
    for _ in loader:
        break
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not multiprocessing.active_children()


class Stream(IterableDataset):
    """0 .. size-1, split between the workers by ``get_worker_info``."""

    def __init__(self, size):
        self.size = size

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.size, step):
            yield np.int64(i)


@pytest.mark.parametrize("num_workers", [0, 1, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_an_iterable_dataset_is_batched_in_order_by_each_worker(num_workers, drop_last):
    batches = [b.numpy().tolist() for b in DataLoader(Stream(14), batch_size=3,
                                                      num_workers=num_workers,
                                                      drop_last=drop_last)]
    samples = sorted(i for b in batches for i in b)
    if num_workers <= 1:
        want = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]] + ([] if drop_last else [[12, 13]])
        assert batches == want
    else:  # workers' streams 0,3,6,9,12 | 1,4,7,10,13 | 2,5,8,11, taken in turn
        assert batches[:3] == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
        assert samples == list(range(14 if not drop_last else 9))  # each drops its own tail
    with pytest.raises(TypeError, match="length of a DataLoader over an IterableDataset"):
        len(DataLoader(Stream(3)))


def test_default_collate_batches_each_field():
    samples = [{"x": np.ones(2) * i, "label": i, "name": f"s{i}"} for i in range(3)]
    batch = default_collate_fn(samples)
    assert batch["x"].shape == (3, 2) and batch["label"].tolist() == [0, 1, 2]
    assert batch["name"] == ["s0", "s1", "s2"]
    loaded = next(iter(DataLoader(samples_dataset(samples), batch_size=3)))
    assert isinstance(loaded["x"], fleet.Tensor) and loaded["name"] == ["s0", "s1", "s2"]
    with pytest.raises(ValueError, match="same number of fields"):
        default_collate_fn([(1, 2), (1,)])
    with pytest.raises(TypeError, match="cannot batch samples of type object"):
        default_collate_fn([object()])


def samples_dataset(samples):
    class Listed(Dataset):
        def __getitem__(self, index):
            return samples[index]

        def __len__(self):
            return len(samples)
    return Listed()


def test_tensor_dataset_and_batch_sampler():
    x, y = np.arange(12.0).reshape(6, 2), fleet.to_tensor(np.arange(6))
    dataset = TensorDataset([x, y])
    assert len(dataset) == 6 and dataset[4][1] == 4
    sampler = BatchSampler(dataset, batch_size=4)
    assert list(sampler) == [[0, 1, 2, 3], [4, 5]] and len(sampler) == 2
    assert len(BatchSampler(dataset, batch_size=4, drop_last=True)) == 1
    with pytest.raises(ValueError, match="share their first dimension"):
        TensorDataset([x, np.arange(5)])


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch_size=0), "batch_size must be an integer >= 1, not 0"),
    (dict(num_workers=-1), "num_workers must be an integer >= 0, not -1"),
    (dict(timeout=-2), "timeout must be a number of seconds >= 0, not -2"),
    (dict(return_list=False), "return_list=False is Paddle's static-graph form"),
    (dict(batch_sampler=BatchSampler(range(3)), batch_size=2), "batch_sampler sets the batches"),
])
def test_bad_arguments_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DataLoader(Squares(), **kwargs)


def test_bad_sampler_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="rank 2 must be below num_replicas 2"):
        DistributedBatchSampler(range(4), 2, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, not 1.5"):
        DistributedBatchSampler(range(4), 1.5)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_ranks_read_their_own_shards_of_uneven_data_in_equal_steps(drop_last, num_workers):
    """23 samples over the world in batches of 4: every rank runs the same number of steps,
    each rank's batches are the sampler's, and together the ranks read every sample."""
    from mpi4py import MPI

    fleet.init(is_collective=True)
    world = MPI.COMM_WORLD
    sampler = DistributedBatchSampler(Squares(), 4, shuffle=True, drop_last=drop_last)
    sampler.set_epoch(2)
    loader = DataLoader(Squares(), batch_sampler=sampler, num_workers=num_workers)
    labels = [y.numpy() for _, y in loader]
    steps = world.allgather(len(labels))
    ok(len(set(steps)) == 1 and steps[0] == len(sampler), f"steps per rank: {steps}")
    mine = np.concatenate(labels) if labels else np.zeros(0, np.int64)
    equal(mine, np.array([i * i for b in sampler for i in b]))
    read = sorted(set(int(round(np.sqrt(v))) for part in world.allgather(mine) for v in part))
    if not drop_last:
        ok(read == list(range(23)), f"samples read: {read}")


def test_subset_random_split_compose_and_chain():
    from fleetmpi import io

    data = io.TensorDataset([np.arange(10.0)])
    subset = io.Subset(data, [3, 1])
    assert len(subset) == 2 and subset[0][0] == 3.0
    np.random.seed(0)
    parts = io.random_split(data, [6, 4])
    taken = sorted(int(p[i][0]) for p in parts for i in range(len(p)))
    assert [len(p) for p in parts] == [6, 4] and taken == list(range(10))
    assert [len(p) for p in io.random_split(data, [0.5, 0.3, 0.2])] == [5, 3, 2]
    with pytest.raises(ValueError, match=r"lengths \[6, 5\] must be integers >= 0 summing to "
                                         "the dataset's length 10"):
        io.random_split(data, [6, 5])
    composed = io.ComposeDataset([data, io.TensorDataset([np.arange(10) * 2, -np.arange(10)])])
    assert composed[4] == (4.0, 8, -4) and len(composed) == 10
    with pytest.raises(ValueError, match=r"one length, got \[10, 2\]"):
        io.ComposeDataset([data, subset])

    class Stream(io.IterableDataset):
        def __init__(self, values):
            self.values = values

        def __iter__(self):
            return iter(self.values)

    assert list(io.ChainDataset([Stream([1, 2]), Stream([3])])) == [1, 2, 3]


def test_subset_random_and_weighted_samplers():
    from fleetmpi import io

    np.random.seed(1)
    drawn = list(io.SubsetRandomSampler([5, 7, 9]))
    assert sorted(drawn) == [5, 7, 9]
    weighted = io.WeightedRandomSampler([0.0, 1.0, 3.0], num_samples=2000)
    counts = np.bincount(list(weighted), minlength=3)
    assert len(weighted) == 2000 and counts[0] == 0 and 2.5 < counts[2] / counts[1] < 3.5
    assert sorted(io.WeightedRandomSampler([1, 1, 1], 3, replacement=False)) == [0, 1, 2]
    short = io.WeightedRandomSampler([0.0, 2.0], 2, replacement=False)  # checked when drawing
    with pytest.raises(io.SamplerArgumentError, match="without replacement needs as many "
                                                      "indices of weight > 0, and there are 1"):
        list(short)


def test_samplers_take_paddles_arguments():
    """RandomSampler's replacement, num_samples and Paddle's generator (an iterator of the
    indices); a BatchSampler given a sampler and shuffle raises what Paddle's assert raises."""
    from fleetmpi import io

    drawn = list(io.RandomSampler(range(10), replacement=True, num_samples=30))
    assert len(drawn) == 30 and set(drawn) <= set(range(10))
    assert list(io.RandomSampler(range(10), generator=iter([3, 1, 2]))) == [3, 1, 2]
    with pytest.raises(ValueError, match="num_samples=5 is for drawing with replacement"):
        io.RandomSampler(range(10), num_samples=5)
    with pytest.raises(AssertionError, match="shuffle applies to a dataset"):
        io.BatchSampler(sampler=io.SequenceSampler(range(4)), shuffle=True)
    with pytest.raises(ValueError, match="replacement must be True or False, not 5"):
        io.WeightedRandomSampler([1.0, 2.0], 5, 5)

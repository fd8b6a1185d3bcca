"""The distributed sampler and the datasets."""
import numpy as np
import pytest

from fleetmpi.training import data


@pytest.mark.parametrize("num_samples, ranks, batch", [(10, 4, 2), (17, 3, 4), (8, 2, 8),
                                                       (5, 4, 1)])
def test_shards_are_disjoint_cover_everything_and_have_equal_batches(num_samples, ranks, batch):
    samplers = [data.DistributedSampler(num_samples, batch, num_replicas=ranks, rank=r, seed=3)
                for r in range(ranks)]
    shards = [s.indices() for s in samplers]
    sizes = {len(s) for s in shards}
    assert len(sizes) == 1
    everything = np.concatenate(shards)
    assert set(everything.tolist()) == set(range(num_samples))
    assert len(everything) == -(-num_samples // ranks) * ranks
    assert len(set(everything.tolist())) == num_samples
    first = np.concatenate([s.global_order()[:num_samples] for s in samplers[:1]])
    assert sorted(first.tolist()) == list(range(num_samples))
    batches = [list(s) for s in samplers]
    assert len({len(b) for b in batches}) == 1 == len({len(s) for s in samplers})
    assert len(batches[0]) == samplers[0].num_batches
    for rank_batches in zip(*batches):
        assert len({len(b) for b in rank_batches}) == 1


def test_epochs_reshuffle_and_seed_fixes_order():
    a = data.DistributedSampler(50, 5, num_replicas=2, rank=0, seed=1)
    b = data.DistributedSampler(50, 5, num_replicas=2, rank=0, seed=1)
    first = a.indices()
    np.testing.assert_array_equal(first, b.indices())
    a.set_epoch(1)
    assert not np.array_equal(first, a.indices())
    ordered = data.DistributedSampler(6, 2, num_replicas=2, rank=1, shuffle=False)
    np.testing.assert_array_equal(ordered.indices(), [1, 3, 5])


def test_drop_last():
    sampler = data.DistributedSampler(11, 2, num_replicas=2, rank=0, drop_last=True)
    assert len(sampler) == 3
    assert all(len(b) == 2 for b in sampler)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_samples=0, batch_size=1), "num_samples must be an integer >= 1, not 0"),
    (dict(num_samples=4, batch_size=1, num_replicas=2, rank=2), "rank 2 is not below"),
    (dict(num_samples=3, batch_size=4, num_replicas=1, rank=0, drop_last=True), "no batch"),
])
def test_bad_sampler_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        data.DistributedSampler(**kwargs)


def test_digits_split_and_batches():
    train, test = data.load_digits()
    assert len(train) + len(test) == 1797
    assert train.features.shape[1] == 64 and train.features.dtype == np.float32
    assert 0.0 <= train.features.min() and train.features.max() <= 1.0
    assert set(np.unique(train.labels)) == set(range(10))
    sampler = data.DistributedSampler(len(train), 32, num_replicas=2, rank=1)
    x, y = next(train.batches(sampler))
    assert x.shape == (32, 64) and y.shape == (32,)


def test_synthetic_images():
    images = data.synthetic_images(6, shape=(1, 4, 4), num_classes=3)
    x, y = images.batch(np.arange(4))
    assert x.shape == (4, 1, 4, 4) and x.dtype == np.float32
    assert y.min() >= 0 and y.max() < 3
    with pytest.raises(ValueError, match="3 feature rows but 2 labels"):
        data.ArrayDataset(np.zeros((3, 2)), np.zeros(2))

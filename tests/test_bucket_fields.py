"""The bucket plan's fields beyond the bucket size: ``last_comm_group_size_MB`` bounds the last
bucket (the one reduced after backward), and ``find_unused_parameters`` decides whether a
parameter that got no gradient is warned about; N ranks still equal one process."""
import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.core import backend, knobs
from fleetmpi import nn, optimizer
from fleetmpi.comm import Extent, plan_buckets
from fleetmpi.strategies.gradient_allreduce import plan_gradient_buckets
from test_data_parallel import GLOBAL_BATCH, STEPS, global_batch, make_model, world_gather

# make_model's float64 parameters in buffer order (last layer first): fc2.bias, fc2.weight,
# fc1.bias, fc1.weight, fc0.bias, fc0.weight
SIZES = [32, 384, 96, 1536, 128, 768]


def test_the_last_bucket_is_cut_to_its_bound_and_the_rest_stays():
    arrays = [Extent(n, np.dtype("float64")) for n in SIZES]
    assert plan_buckets(arrays, 1 << 20) == [[0, 1, 2, 3, 4, 5]]
    assert plan_buckets(arrays, 1 << 20, last_bucket_bytes=1000) == [[0, 1, 2, 3], [4, 5]]
    # a parameter larger than the bound is the last bucket alone
    assert plan_buckets(arrays, 1 << 20, last_bucket_bytes=500) == [[0, 1, 2, 3, 4], [5]]
    # a last bucket already within the bound, and buckets before it, are as without it
    assert plan_buckets(arrays, 2000, last_bucket_bytes=1000) == plan_buckets(arrays, 2000) \
        == [[0, 1, 2], [3, 4], [5]]
    assert plan_buckets(arrays, None, last_bucket_bytes=1) == [[i] for i in range(6)]


def test_the_gradient_plan_bounds_only_the_last_bucket():
    model = make_model()
    opt = optimizer.SGD(parameters=model.parameters())
    whole = plan_gradient_buckets(opt.runs, 1 << 20)
    cut = plan_gradient_buckets(opt.runs, 1 << 20, last_bucket_bytes=1000)
    assert [int(b.grad.nbytes) for b in whole] == [sum(SIZES)]
    assert [int(b.grad.nbytes) for b in cut] == [sum(SIZES[:4]), sum(SIZES[4:])]
    assert [p.name for p in cut[-1].parameters] == ["fc0.bias", "fc0.weight"]


def _train(strategy, rank, size, build=make_model):
    backend.manual_seed(0)
    model = fleet.distributed_model(build())
    opt = fleet.distributed_optimizer(optimizer.SGD(learning_rate=0.1,
                                                    parameters=model.parameters()), strategy)
    share = GLOBAL_BATCH // size
    for step in range(STEPS):
        x, y = global_batch(step)
        opt.minimize(model, nn.CrossEntropyLoss(), x[rank * share:(rank + 1) * share],
                     y[rank * share:(rank + 1) * share])
    return model, opt


def _reference():
    backend.manual_seed(0)
    model = make_model()
    opt = optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    for step in range(STEPS):
        opt.minimize(model, nn.CrossEntropyLoss(), *global_batch(step))
    return model.state_dict()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("overlap", ["0", "1"])
@pytest.mark.parametrize("megabytes, last", [(1000 / 2 ** 20, [128, 768]),
                                             (500 / 2 ** 20, [768])])
def test_last_comm_group_size_mb_bounds_the_last_bucket_at_n_ranks(megabytes, last, overlap,
                                                                   monkeypatch):
    monkeypatch.setenv(knobs.OVERLAP_ALLREDUCE.name, overlap)
    fleet.init(is_collective=True)
    size, rank = fleet.worker_num(), fleet.worker_index()
    strategy = fleet.DistributedStrategy()
    strategy.last_comm_group_size_MB = megabytes
    model, opt = _train(strategy, rank, size)
    buckets = opt.strategies["gradient_allreduce"].buckets
    assert [p.size * 8 for p in buckets[-1].parameters] == last, f"rank {rank}"
    assert sum(int(b.grad.nbytes) for b in buckets) == sum(SIZES)
    assert fleet.applied_strategy().not_applied.get("last_comm_group_size_MB") is None
    expected = _reference()
    for name, value in model.state_dict().items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-10, atol=1e-12,
                                   err_msg=f"{name} on rank {rank} of {size}")
        everywhere = world_gather(value)
        assert all(np.array_equal(everywhere[0], other) for other in everywhere[1:]), name


class Unused(nn.Layer):
    """make_model's layers and a branch no rank takes."""

    def __init__(self):
        super().__init__()
        self.body = make_model()
        nn.set_default_dtype("float64")
        try:
            self.spare = nn.Linear(4, 4)
        finally:
            nn.set_default_dtype("float32")

    def forward(self, x):
        return self.body(x)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("find_unused", [False, True])
def test_find_unused_parameters_off_warns_once_naming_them(find_unused, fleetmpi_warnings):
    size, rank = fleet.worker_num(), fleet.worker_index()
    strategy = fleet.DistributedStrategy()
    strategy.find_unused_parameters = find_unused
    model, _ = _train(strategy, rank, size, Unused)
    warned = [m for m in fleetmpi_warnings() if "got no gradient" in m]
    if find_unused:
        assert warned == [], f"rank {rank}: {warned}"
    else:
        assert len(warned) == 1, f"rank {rank}: {warned}"
        assert "spare.weight" in warned[0] and "spare.bias" in warned[0]
        assert "body." not in warned[0] and "find_unused_parameters" in warned[0]
    expected = _reference()
    for name, value in model.body.state_dict().items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-10, atol=1e-12,
                                   err_msg=f"{name} on rank {rank} of {size}")
    flags = world_gather(np.array([len(warned)]))
    assert all(int(f[0]) == (0 if find_unused else 1) for f in flags)

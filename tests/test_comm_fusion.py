"""allreduce_many / broadcast_many: buckets, views of one flat buffer, mixed dtypes, nccl_comm_num."""
import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.comm import Communicator
from fleetmpi.comm.fusion import Bucket, flat_view, plan_buckets

from comm_support import close, equal, ok, rank_data, world

SHAPES = [(3, 4), (5,), (), (0,), (7, 2), (1000,), (9,)]


def arrays_for(rank, dtype=np.float64, case=0):
    return [rank_data(rank, int(np.prod(s)), dtype, case=case + i).reshape(s)
            for i, s in enumerate(SHAPES)]


def test_buckets_respect_size_and_dtype():
    arrays = [np.zeros(10, np.float32), np.zeros(10, np.float32), np.zeros(30, np.float32),
              np.zeros(2, np.float64), np.zeros(100, np.float64), np.zeros(1, np.float64)]
    ok(plan_buckets(arrays, 80) == [[0, 1], [2], [3], [4], [5]])
    ok(plan_buckets(arrays, 1000) == [[0, 1, 2], [3, 4, 5]])
    ok(plan_buckets([], 1000) == [])


def test_views_of_one_flat_buffer_need_no_packing():
    flat = np.arange(20, dtype=np.float32)
    views = [flat[0:6].reshape(2, 3), flat[6:7], flat[7:7], flat[7:20]]
    whole = flat_view(views)
    ok(whole is not None and np.shares_memory(whole, flat) and whole.size == 20)
    bucket = Bucket(views)
    ok(not bucket.packed and bucket.load() is bucket.flat)
    ok(flat_view([flat[0:6], flat[7:10]]) is None)  # a gap
    ok(flat_view([flat[6:10], flat[0:6]]) is None)  # out of order
    ok(flat_view([np.zeros(3, np.float32), np.zeros(3, np.float32)]) is None)
    ok(flat_view([flat[0:10:2]]) is None)  # not contiguous


def test_packed_bucket_round_trips_any_layout():
    base = np.arange(24.0).reshape(4, 6)
    arrays = [base[:, 1], base[1:3, 2:5], np.arange(3.0)]
    bucket = Bucket(arrays)
    ok(bucket.packed)
    flat = bucket.load()
    equal(flat, np.concatenate([a.reshape(-1) for a in arrays]))
    flat *= -1
    bucket.store()
    equal(arrays[2], -np.arange(3.0))
    equal(base[1:3, 2:5], -np.arange(24.0).reshape(4, 6)[1:3, 2:5])


@pytest.mark.mpi
@pytest.mark.parametrize("fuse_mb", [32, 0.0001])
@pytest.mark.parametrize("algorithm", [None, "ring", "hierarchical", "native"])
def test_allreduce_many_matches_allreduce_of_each(algorithm, fuse_mb):
    comm = world()
    arrays = arrays_for(comm.rank) + [rank_data(comm.rank, 6, np.int32).reshape(2, 3)]
    before = [a.copy() for a in arrays]
    comm.allreduce_many(arrays, op="mean", algorithm=algorithm, fuse_grad_size_in_MB=fuse_mb)
    for got, x, r in zip(arrays, before, range(len(arrays))):
        everyone = [(arrays_for(q) + [rank_data(q, 6, np.int32).reshape(2, 3)])[r]
                    for q in range(comm.size)]
        if x.dtype.kind == "f":
            close(got, np.mean(everyone, axis=0), rtol=1e-13, atol=1e-13)
        else:
            equal(got, np.sum(everyone, axis=0) // comm.size)
        ok(got.shape == x.shape)


@pytest.mark.mpi
def test_allreduce_many_on_views_of_a_flat_gradient_buffer():
    comm = world()
    flat = rank_data(comm.rank, 1 + 12 + 30 + 5, np.float32, case=4)
    views = [flat[0:1], flat[1:13].reshape(3, 4), flat[13:43].reshape(5, 6), flat[43:48]]
    expected = np.sum([rank_data(r, 48, np.float32, case=4) for r in range(comm.size)], axis=0)
    comm.allreduce_many(views, algorithm="ring", fuse_grad_size_in_MB=1)
    close(flat, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.mpi
def test_buckets_spread_over_several_communicators():
    fleet.init()
    comm = Communicator(fleet.world.topology(), nccl_comm_num=3, fuse_grad_size_in_MB=0.00005)
    try:
        ok(len({t.comm.py2f() for t in comm.transports}) == 3)
        used = []
        for i, transport in enumerate(comm.transports):
            def counted(*args, _i=i, _inner=transport.sendrecv):
                used.append(_i)
                return _inner(*args)
            transport.sendrecv = counted
        arrays = arrays_for(comm.rank, np.float32, case=20)
        ok(len(plan_buckets(arrays, int(0.00005 * (1 << 20)))) > 3)
        comm.allreduce_many(arrays, algorithm="ring", compression="fp16")
        if comm.size > 1:
            ok(set(used) == {0, 1, 2})
        for r, got in enumerate(arrays):
            everyone = np.array([arrays_for(q, np.float32, case=20)[r] for q in range(comm.size)])
            close(got, everyone.sum(axis=0), rtol=2e-3 * comm.size,
                                       atol=1e-2)
        params = arrays_for(comm.rank, np.float64, case=30)
        comm.broadcast_many(params, root=comm.size - 1)
        for got, want in zip(params, arrays_for(comm.size - 1, np.float64, case=30)):
            equal(got, want)
    finally:
        comm.free()


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", [None, "tree", "chain", "native"])
def test_broadcast_many_in_place(algorithm):
    comm = world()
    for root in range(comm.size):
        params = arrays_for(comm.rank, case=root) + [np.full(4, comm.rank, np.int64)]
        comm.broadcast_many(params, root=root, algorithm=algorithm, fuse_broadcast_MB=0.001)
        for got, want in zip(params, arrays_for(root, case=root) + [np.full(4, root)]):
            equal(got, want)

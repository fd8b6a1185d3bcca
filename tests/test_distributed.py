"""fleetmpi.distributed: Paddle's collectives on tensors, in place, against NumPy on every
rank, over every rank and over groups of some ranks; DataParallel equals one process on the
global batch; the tensor functions hybrid scripts use."""
import numpy as np
import pytest

import fleetmpi as fleet
import fleetmpi.distributed as dist
from fleetmpi.core import backend
from fleetmpi import nn, optimizer
from fleetmpi.autograd import Tensor
from fleetmpi.nn.initializer import Assign

from comm_support import ok, raises
from strategy_support import global_batch, make_mlp, shard, world_gather

SHAPE = (2, 3)
NUMPY_OPS = {dist.ReduceOp.SUM: lambda a: a.sum(axis=0), dist.ReduceOp.MAX: lambda a: a.max(0),
             dist.ReduceOp.MIN: lambda a: a.min(0), dist.ReduceOp.PROD: lambda a: a.prod(0),
             dist.ReduceOp.AVG: lambda a: a.mean(0)}


def value(rank, salt=0):
    """Rank ``rank``'s values: distinct per rank and per ``salt``, exact in float64 sums."""
    return (np.arange(6.0).reshape(SHAPE) + 1) * (rank + 2) + salt * 10 - 3 * rank


def tensor(array):
    return Tensor(backend.asarray(np.array(array, dtype=np.float64)))


def host(t):
    return backend.to_numpy(t.data)


def groups():
    """(None: every rank), and a group of the ranks but the first (every rank calls
    new_group); each as ``(group, its global ranks)``."""
    size = dist.get_world_size()
    return [(None, list(range(size))),
            (dist.new_group(list(range(1, size))), list(range(1, size)))]


# -- one process -----------------------------------------------------------------------

def test_alone_every_collective_is_the_identity():
    dist.init_parallel_env()
    assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
    t = tensor(value(0))
    for op in NUMPY_OPS:
        dist.all_reduce(t, op=op)
        np.testing.assert_array_equal(host(t), value(0))
    gathered = []
    dist.all_gather(gathered, t)
    assert len(gathered) == 1 and np.array_equal(host(gathered[0]), value(0))
    dist.broadcast(t, src=0)
    out = tensor(np.zeros(SHAPE))
    dist.scatter(out, [tensor(value(0, 1))], src=0)
    np.testing.assert_array_equal(host(out), value(0, 1))
    received = []
    dist.alltoall([tensor(value(0, 2))], received)
    np.testing.assert_array_equal(host(received[0]), value(0, 2))
    task = dist.all_reduce(t, sync_op=False)
    assert task.wait() and task.is_completed()
    dist.barrier()


@pytest.mark.parametrize("call, error, words", [
    (lambda: dist.all_reduce(tensor(value(0)), op="sum"), ValueError, "op='sum' is not a "
     "ReduceOp"),
    (lambda: dist.all_reduce(value(0)), TypeError, "must be a fleetmpi Tensor, not ndarray"),
    (lambda: dist.broadcast(tensor(value(0)), src=3), ValueError, "src=3 is not a rank of the "
     "group; its ranks: [0]"),
    (lambda: dist.new_group([0, 0]), ValueError, "distinct global ranks in [0, 1)"),
    (lambda: dist.new_group([5]), ValueError, "new_group ranks=[5]"),
    (lambda: dist.new_group([0], backend="bkcl"), ValueError, "backend='bkcl'"),
    (lambda: dist.all_reduce(tensor(value(0)), group="world"), TypeError,
     "group must be None, a Group"),
    (lambda: dist.get_group(42), ValueError, "no group has id 42"),
    (lambda: dist.all_gather([tensor(value(0))] * 2, tensor(value(0))), ValueError,
     "holds 2 tensors; the group has 1 ranks"),
    (lambda: dist.DataParallel("model"), TypeError, "wraps a fleetmpi.nn.Layer, not str"),
    (lambda: fleet.gather(tensor(value(0)), [[0]]), ValueError, "1-d tensor of integers"),
    (lambda: fleet.gather(tensor(value(0)), [0], axis=2), ValueError, "axis=2 is out of range"),
])
def test_bad_arguments_are_refused(call, error, words):
    fleet.init(is_collective=True)
    with pytest.raises(error) as refused:
        call()
    assert words in str(refused.value)


def test_tensor_functions_with_paddles_signatures():
    fleet.seed(3)
    a = fleet.randn([2, 3])
    fleet.seed(3)
    assert np.array_equal(host(fleet.randn([2, 3])), host(a)) and a.dtype == np.float32
    u = fleet.rand((4,), dtype="float64")
    assert u.dtype == np.float64 and ((0 <= host(u)) & (host(u) < 1)).all()
    x = Tensor(backend.asarray(np.arange(12.0).reshape(3, 4)), stop_gradient=False)
    picked = fleet.gather(x, Tensor(backend.asarray(np.array([2, 0, 2]))), axis=0)
    np.testing.assert_array_equal(host(picked), np.arange(12.0).reshape(3, 4)[[2, 0, 2]])
    picked.sum().backward()
    np.testing.assert_array_equal(host(x.grad), np.array([[1.0] * 4, [0] * 4, [2] * 4]))
    np.testing.assert_array_equal(host(fleet.gather(x, [3, 1], axis=1)),
                                  np.arange(12.0).reshape(3, 4)[:, [3, 1]])
    parts = fleet.split(fleet.concat([x, x], axis=1, name="c"), 2, axis=1, name="s")
    assert [p.shape for p in parts] == [[3, 4], [3, 4]]
    assert fleet.matmul(x, x, transpose_y=True, name="m").shape == [3, 3]
    p = fleet.create_parameter([2, 2], "float32", name="w",
                               default_initializer=Assign(np.eye(2)))
    assert p.name == "w" and p.dtype == np.float32 and np.array_equal(host(p), np.eye(2))
    assert fleet.framework.ParamAttr is fleet.ParamAttr
    layer = nn.Linear(2, 2, weight_attr=fleet.ParamAttr(initializer=Assign([[1, 2], [3, 4]])))
    np.testing.assert_array_equal(host(layer.weight), [[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="Assign holds a value of shape \\(2, 2\\)"):
        nn.Linear(3, 2, weight_attr=fleet.ParamAttr(initializer=Assign(np.eye(2))))


# -- several ranks ---------------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", sorted(NUMPY_OPS))
def test_all_reduce_and_reduce_on_every_rank_and_on_a_group(op):
    fleet.init(is_collective=True)
    rank = dist.get_rank()
    for group, members in groups():
        t = tensor(value(rank))
        dist.all_reduce(t, op=op, group=group)
        want = NUMPY_OPS[op](np.stack([value(r) for r in members]))
        ok(np.allclose(host(t), want if rank in members else value(rank), rtol=1e-12),
           f"rank {rank} all_reduce op {op} over {members}")
        dst = members[-1]
        t = tensor(value(rank))
        dist.reduce(t, dst=dst, op=op, group=group)
        ok(np.allclose(host(t), want if rank == dst else value(rank), rtol=1e-12),
           f"rank {rank} reduce op {op} to {dst} over {members}")


@pytest.mark.mpi(min_size=2)
def test_all_gather_broadcast_scatter_alltoall_on_every_rank_and_on_a_group():
    fleet.init(is_collective=True)
    rank = dist.get_rank()
    for group, members in groups():
        inside = rank in members
        ok(dist.get_rank(group) == (members.index(rank) if inside else -1))
        ok(dist.get_world_size(group) == len(members))
        gathered = []
        dist.all_gather(gathered, tensor(value(rank)), group=group)
        ok(len(gathered) == (len(members) if inside else 0)
           and all(np.array_equal(host(t), value(r)) for t, r in zip(gathered, members)),
           f"rank {rank}: all_gather over {members}")
        into = [tensor(np.zeros(SHAPE)) for _ in members]
        dist.all_gather(into, tensor(value(rank, 1)), group=group)
        ok(all(np.array_equal(host(t), value(r, 1) if inside else np.zeros(SHAPE))
               for t, r in zip(into, members)))
        src = members[-1]
        t = tensor(value(rank))
        dist.broadcast(t, src=src, group=group)
        ok(np.array_equal(host(t), value(src if inside else rank)), f"rank {rank} broadcast")
        out = tensor(np.zeros(SHAPE))
        parts = [tensor(value(src, 5 + i)) for i in range(len(members))] if rank == src \
            else None
        dist.scatter(out, parts, src=src, group=group)
        ok(np.array_equal(host(out), value(src, 5 + members.index(rank)) if inside
                          else np.zeros(SHAPE)), f"rank {rank} scatter")
        sent = [tensor(value(rank, 20 + j)) for j in range(len(members))]
        received = []
        dist.alltoall(sent, received, group=group)
        if inside:
            me = members.index(rank)
            ok(all(np.array_equal(host(t), value(r, 20 + me))
                   for t, r in zip(received, members)), f"rank {rank} alltoall")
        else:
            ok(received == [])
        dist.barrier(group)


@pytest.mark.mpi(min_size=2)
def test_send_and_recv_between_global_ranks_and_within_a_group():
    fleet.init(is_collective=True)
    rank, size = dist.get_rank(), dist.get_world_size()
    last = size - 1
    t = tensor(value(rank, 7))
    if rank == 0:
        dist.send(t, dst=last)
    elif rank == last:
        dist.recv(t, src=0)
    ok(np.array_equal(host(t), value(0 if rank == last else rank, 7)), f"rank {rank}")
    group = dist.new_group([0, last])
    t = tensor(value(rank, 8))
    if rank == last:
        dist.send(t, dst=0, group=group)
    elif rank == 0:
        dist.recv(t, src=last, group=group)
    ok(np.array_equal(host(t), value(last if rank == 0 else rank, 8)), f"rank {rank}")
    ok(group.ranks == [0, last] and group.is_member() == (rank in (0, last)))


@pytest.mark.mpi(min_size=2)
def test_new_group_with_different_ranks_is_refused_on_every_rank():
    fleet.init(is_collective=True)
    rank = dist.get_rank()
    with raises(ValueError, match="different ranks on ranks"):
        dist.new_group([0] if rank == 0 else [0, 1])


@pytest.mark.mpi(min_size=2)
def test_a_hybrid_axis_communicator_is_a_group():
    fleet.init(is_collective=True)
    size, rank = dist.get_world_size(), dist.get_rank()
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": size, "pp_degree": 1}
    fleet.init(is_collective=True, strategy=strategy)
    mp = fleet.get_hybrid_communicate_group().get_model_parallel_group()
    t = tensor(value(rank))
    dist.all_reduce(t, group=mp)
    ok(np.array_equal(host(t), sum(value(r) for r in range(size))))
    ok(dist.get_rank(mp) == rank and dist.get_world_size(mp) == size)


def mlp32():
    return make_mlp(dtype="float32")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("with_group", [False, True], ids=["world", "group"])
def test_data_parallel_equals_one_process_on_the_global_batch(with_group):
    fleet.init(is_collective=True)
    size, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(size))) if with_group else None

    def run(parallel):
        backend.manual_seed(rank if parallel else 0)      # ranks start apart: DataParallel
        model = mlp32()                                   # gives them rank 0's parameters
        if parallel:
            model = dist.DataParallel(model, group=group)
        opt = optimizer.Momentum(learning_rate=0.1, momentum=0.9,
                                 parameters=model.parameters())
        for step in range(4):
            x, y = global_batch(step)
            if parallel:
                x, y = shard(x, rank, size), shard(y, rank, size)
            loss = nn.CrossEntropyLoss()(model(x.astype(np.float32)), y)
            loss.backward()
            opt.step()
            opt.clear_grad()
        return model.state_dict()

    got = run(True)
    backend.manual_seed(0)
    want = run(False)
    for name, array in want.items():
        ok(np.allclose(got[name], array, rtol=1e-5, atol=1e-6), f"rank {rank}: {name}")
    flat = np.concatenate([v.ravel() for v in got.values()])
    every = world_gather(flat)
    ok(all(np.array_equal(every[0], row) for row in every), "ranks differ")


@pytest.mark.mpi(min_size=2)
def test_data_parallel_no_sync_accumulates_each_ranks_own_gradient():
    fleet.init(is_collective=True)
    size, rank = dist.get_world_size(), dist.get_rank()
    backend.manual_seed(0)
    model = dist.DataParallel(mlp32())
    x, y = global_batch(0)
    x, y = shard(x, rank, size), shard(y, rank, size)
    with model.no_sync():
        nn.CrossEntropyLoss()(model(x.astype(np.float32)), y).backward()
    own = np.concatenate([p.grad.numpy().ravel() for p in model.parameters()])
    every = world_gather(own)
    ok(not np.allclose(every[0], every[-1]), "no_sync averaged the gradients")
    nn.CrossEntropyLoss()(model(x.astype(np.float32)), y).backward()
    synced = np.concatenate([p.grad.numpy().ravel() for p in model.parameters()])
    ok(np.allclose(synced, 2 * every.mean(axis=0), rtol=1e-5, atol=1e-7))
    ok(list(model.state_dict()) == list(model._layers.state_dict()))


@pytest.mark.mpi(min_size=2)
def test_a_0_d_loss_is_reduced_in_place():
    fleet.init(is_collective=True)
    size, rank = dist.get_world_size(), dist.get_rank()
    loss = Tensor(np.float64(rank + 1))          # a reduction's 0-d result: a NumPy scalar
    dist.all_reduce(loss, op=dist.ReduceOp.MAX)
    ok(loss.shape == [] and float(loss) == size, f"rank {rank}: {float(loss)}")

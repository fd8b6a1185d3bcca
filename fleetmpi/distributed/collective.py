"""Paddle's collectives on tensors (``paddle.distributed.all_reduce`` and the others), over
this library's ``Communicator``.

Each works in place as Paddle's does: the result is written into the Tensor given (or into
the tensors of the list given; an empty list is filled with new tensors). A rank outside
``group`` returns at once, as in Paddle. ``src`` and ``dst`` are global ranks.
"""
import numpy as np

from ..core import backend
from ..autograd import Tensor
from ..nn.functional import copy_to_model_parallel
from .group import ReduceOp, reduce_op, resolve


class CompletedTask:
    """What a collective called with ``sync_op=False`` returns: it has already finished (the
    collectives here return when their result is written), so ``wait()`` returns at once."""

    def wait(self):
        return True

    def is_completed(self):
        return True


def _task(sync_op):
    return None if sync_op else CompletedTask()


def _array(tensor, what):
    """``tensor``'s array, which a collective may write into (a 0-d result of a reduction,
    held as a NumPy scalar, becomes a 0-d array first)."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{what} must be a fleetmpi Tensor, not {type(tensor).__name__}")
    if isinstance(tensor.data, np.generic):
        tensor.data = backend.asarray(np.asarray(tensor.data))
    return tensor.data


def _write(tensor, array):
    tensor.data[...] = array.reshape(tensor.shape)


def _place(group, rank, what):
    """The place in ``group`` of global ``rank`` (``what`` names it), or a ValueError."""
    place = group.get_group_rank(rank)
    if place < 0:
        raise ValueError(f"{what}={rank!r} is not a rank of the group; its ranks: "
                         f"{group.ranks}")
    return place


def _member(group):
    comm, g = resolve(group)
    return (comm, g) if g.is_member() else (None, g)


def _fill(tensor_list, arrays, what):
    """Write ``arrays`` into the tensors of ``tensor_list``, or append new tensors of them to
    an empty list."""
    if not isinstance(tensor_list, list):
        raise TypeError(f"{what} must be a list, not {type(tensor_list).__name__}")
    if not tensor_list:
        tensor_list.extend(Tensor(array.copy()) for array in arrays)
        return
    if len(tensor_list) != len(arrays):
        raise ValueError(f"{what} holds {len(tensor_list)} tensors; the group has "
                         f"{len(arrays)} ranks: pass an empty list or one of {len(arrays)}")
    for tensor, array in zip(tensor_list, arrays):
        _write(tensor, array)


def _reduced(comm, x, op):
    name = reduce_op(op)
    if name == "prod":
        return comm.allgather(x, stack=True).prod(axis=0, dtype=x.dtype)
    return comm.allreduce(x, op=name)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, sync_op=True):
    """``tensor`` becomes the reduction (``ReduceOp``, SUM by default) of every rank's."""
    x = _array(tensor, "all_reduce tensor")
    comm, _ = _member(group)
    if comm is not None:
        _write(tensor, _reduced(comm, x, op))
    return _task(sync_op)


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, sync_op=True):
    """On rank ``dst`` ``tensor`` becomes the reduction of every rank's; elsewhere it stays."""
    x = _array(tensor, "reduce tensor")
    comm, g = _member(group)
    if comm is None:
        return _task(sync_op)
    place = _place(g, dst, "dst")
    result = _reduced(comm, x, op)
    if g.rank == place:
        _write(tensor, result)
    return _task(sync_op)


def all_gather(tensor_list, tensor, group=None, sync_op=True):
    """``tensor_list`` gets every rank's ``tensor``, in group rank order."""
    x = _array(tensor, "all_gather tensor")
    comm, g = _member(group)
    if comm is not None:
        _fill(tensor_list, list(comm.allgather(x, stack=True)), "all_gather tensor_list")
    return _task(sync_op)


def broadcast(tensor, src, group=None, sync_op=True):
    """``tensor`` becomes rank ``src``'s on every rank."""
    x = _array(tensor, "broadcast tensor")
    comm, g = _member(group)
    if comm is not None:
        _write(tensor, comm.broadcast(x, root=_place(g, src, "src")))
    return _task(sync_op)


def scatter(tensor, tensor_list=None, src=0, group=None, sync_op=True):
    """``tensor`` becomes ``tensor_list[i]`` of rank ``src``, where ``i`` is this rank's
    place in the group; ``tensor_list`` is read on ``src`` only."""
    x = _array(tensor, "scatter tensor")
    comm, g = _member(group)
    if comm is None:
        return _task(sync_op)
    root = _place(g, src, "src")
    if g.rank == root:
        if not isinstance(tensor_list, list) or len(tensor_list) != g.nranks:
            raise ValueError(f"scatter on src {src} needs tensor_list, a list of {g.nranks} "
                             f"tensors (one per rank of the group), not {tensor_list!r}")
        xp = backend.array_module()
        parts = xp.stack([_array(t, "scatter tensor_list[i]") for t in tensor_list])
    else:
        parts = x[None]
    _write(tensor, comm.scatter(parts, root=root))
    return _task(sync_op)


def alltoall(in_tensor_list, out_tensor_list, group=None, sync_op=True):
    """Rank ``i`` sends ``in_tensor_list[j]`` to rank ``j``, which receives it as
    ``out_tensor_list[i]``."""
    comm, g = _member(group)
    if comm is None:
        return _task(sync_op)
    if not isinstance(in_tensor_list, list) or len(in_tensor_list) != g.nranks:
        raise ValueError(f"alltoall in_tensor_list must be a list of {g.nranks} tensors (one "
                         f"per rank of the group), not {in_tensor_list!r}")
    xp = backend.array_module()
    sent = xp.stack([_array(t, "alltoall in_tensor_list[i]") for t in in_tensor_list])
    received, _ = comm.alltoall(sent)
    _fill(out_tensor_list, list(received), "alltoall out_tensor_list")
    return _task(sync_op)


def send(tensor, dst=0, group=None, sync_op=True):
    """Send ``tensor`` to global rank ``dst``, whose ``recv`` takes it."""
    x = _array(tensor, "send tensor")
    comm, g = _member(group)
    if comm is not None:
        comm.send(x, dest=_place(g, dst, "dst"))
    return _task(sync_op)


def recv(tensor, src=0, group=None, sync_op=True):
    """Receive global rank ``src``'s ``send`` into ``tensor``."""
    x = _array(tensor, "recv tensor")
    comm, g = _member(group)
    if comm is not None:
        comm.recv(x, source=_place(g, src, "src"))
    return _task(sync_op)


def _c_identity(tensor, group=None):
    """Paddle's ``paddle.distributed.collective._c_identity``, which PaddleNLP's
    ``parallel_matmul`` calls before the product with a weight split over the model-parallel
    ``group``: ``tensor`` unchanged, its gradient summed over ``group`` in backward
    (``F.copy_to_model_parallel``)."""
    communicator, _ = _member(group)
    return copy_to_model_parallel(tensor, communicator)

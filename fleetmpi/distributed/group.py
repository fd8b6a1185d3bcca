"""Paddle's process groups of ``paddle.distributed``: ``Group``, ``new_group``, ``ReduceOp``,
``init_parallel_env``, ``get_rank``, ``get_world_size`` and ``barrier``.

A ``Group`` holds the global ranks it joins, in increasing order as Paddle's ``new_group``
sorts them, and on its members a ``Communicator`` split from the world's
(``Communicator.split``: the job's knobs, this library's algorithms).
``group=None`` anywhere means every rank. The communicator of a hybrid axis
(``fleet.get_hybrid_communicate_group().get_model_parallel_group()``) is accepted as a group
too. Ranks given to the collectives (``src``, ``dst``) are global ranks, as in Paddle.
"""
import zlib

import numpy as np
from mpi4py import MPI

from .. import world
from fleetmpi.comm import Communicator, get_communicator


class ReduceOp:
    """Paddle's reduction names."""

    SUM = 0
    MAX = 1
    MIN = 2
    PROD = 3
    AVG = 4


# What each ReduceOp is to the communicator ("prod" is computed from an allgather).
REDUCE_OPS = {ReduceOp.SUM: "sum", ReduceOp.MAX: "max", ReduceOp.MIN: "min",
              ReduceOp.PROD: "prod", ReduceOp.AVG: "mean"}


def reduce_op(op):
    """The communicator's name of ``op`` (a ``ReduceOp``), or a ValueError naming it."""
    if isinstance(op, bool) or op not in REDUCE_OPS:
        raise ValueError(f"op={op!r} is not a ReduceOp; allowed: ReduceOp.SUM, MAX, MIN, PROD "
                         "or AVG")
    return REDUCE_OPS[op]


class Group:
    """Paddle's ``Group``: ``ranks`` (global, sorted), ``nranks``, ``rank`` (this rank's place
    in it, -1 outside), ``id``, and ``communicator`` (None outside, or alone)."""

    def __init__(self, ranks, communicator, group_id):
        self.ranks = list(ranks)
        self.nranks = len(self.ranks)
        self.id = group_id
        self.communicator = communicator
        mine = world.worker_index()
        self.rank = self.ranks.index(mine) if mine in self.ranks else -1

    world_size = property(lambda self: self.nranks)

    def is_member(self):
        return self.rank >= 0

    def get_group_rank(self, rank):
        """The place of global ``rank`` in the group, or -1."""
        return self.ranks.index(rank) if rank in self.ranks else -1

    def __repr__(self):
        return f"Group(id={self.id}, ranks={self.ranks}, rank={self.rank})"


_groups = {}


def init_parallel_env():
    """Paddle's ``init_parallel_env``: join the job (``fleet.init(is_collective=True)``);
    nothing more when it was joined already."""
    world.init(is_collective=True)


def _world_size():
    return world.worker_num()


def new_group(ranks=None, backend=None):
    """Paddle's ``new_group``: a ``Group`` of the global ``ranks`` (every rank when None).
    Collective: every rank of the job calls it, with the same ranks (checked: a rank given
    other ranks than the others is named on every rank). ``backend`` is the transport's,
    chosen by ``FLEETMPI_TRANSPORT``; Paddle's names are taken and change nothing."""
    if backend not in (None, "nccl", "gloo", "mpi", "auto"):
        raise ValueError(f"new_group backend={backend!r}; allowed: None, 'nccl', 'gloo', "
                         "'mpi' (the transport is FLEETMPI_TRANSPORT's)")
    size = _world_size()
    ranks = list(range(size)) if ranks is None else ranks
    if not isinstance(ranks, (list, tuple, range)) or not ranks:
        raise ValueError(f"new_group ranks={ranks!r}; allowed: a non-empty list of global "
                         f"ranks in [0, {size})")
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, (int, np.integer))
           or not 0 <= r < size]
    if bad or len(set(ranks)) != len(ranks):
        raise ValueError(f"new_group ranks={list(ranks)!r}; allowed: distinct global ranks in "
                         f"[0, {size})")
    ranks = sorted(int(r) for r in ranks)
    comm = get_communicator()
    _check_same_ranks(comm, ranks)
    mine = comm.rank in ranks
    sub = comm.split(0 if mine else None, comm.rank)
    group = Group(ranks, sub, len(_groups) + 1)
    _groups[group.id] = group
    return group


def _check_same_ranks(comm, ranks):
    """Raise on every rank when the ranks were not given the same ``ranks``."""
    code = zlib.crc32(np.asarray(ranks, dtype=np.int64).tobytes())
    table = comm.allgather(np.array([len(ranks), code], dtype=np.int64), stack=True)
    if not (table == table[0]).all():
        differing = [r for r in range(len(table)) if not (table[r] == table[0]).all()]
        raise ValueError(f"new_group was called with different ranks on ranks "
                         f"{differing} than on rank 0; every rank passes the same ranks")


def get_group(group_id=0):
    """The ``Group`` ``new_group`` returned with ``group_id``; 0: every rank."""
    if group_id == 0:
        return world_group()
    if group_id not in _groups:
        raise ValueError(f"no group has id {group_id!r}; ids: {sorted(_groups)}")
    return _groups[group_id]


def world_group():
    """Every rank, as a ``Group`` of id 0."""
    return Group(range(_world_size()), get_communicator(), 0)


def resolve(group):
    """``(communicator, Group)`` of ``group``: None (every rank), a ``Group``, or a
    ``Communicator`` (a hybrid axis's). The communicator is None on a rank outside it."""
    if group is None:
        return get_communicator(), world_group()
    if isinstance(group, Group):
        return group.communicator, group
    if isinstance(group, Communicator):
        return group, _group_of(group)
    raise TypeError(f"group must be None, a Group from new_group or a communicator of "
                    f"get_hybrid_communicate_group(), not {type(group).__name__}")


def _group_of(communicator):
    """The ``Group`` of a ``Communicator``'s ranks (their global ranks, by MPI's group
    translation)."""
    mine = communicator.topology.world.Get_group()
    everyone = world.topology().world.Get_group()
    ranks = MPI.Group.Translate_ranks(mine, list(range(communicator.size)), everyone)
    return Group(ranks, communicator, -1)


def get_rank(group=None):
    """This rank's global rank, or its place in ``group`` (-1 outside)."""
    return world.worker_index() if group is None else resolve(group)[1].rank


def get_world_size(group=None):
    """The number of ranks of the job, or of ``group``."""
    return _world_size() if group is None else resolve(group)[1].nranks


def barrier(group=None):
    """Return once every rank of ``group`` has called ``barrier``."""
    comm, g = resolve(group)
    if g.is_member() and comm is not None:
        comm.barrier()

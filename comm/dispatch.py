"""Running a call's algorithm on the communicator's transports: a lookup in ``registry`` of
the algorithm the call names, or of the one ``algorithm_choice``'s table chooses, which then
runs itself; plus the flat allreduce, broadcast and allgather that many calls come down to,
and the runners a repeated ``allreduce`` goes straight to.

Each function takes the communicator's ``AlgorithmContext`` first; whether a call may run is
``call_checks``'.
"""
import functools

from . import registry
from .algorithm_choice import TIMED, choose, time_ring_against_shm
from .ops import array_module


def chosen(ctx, collective, name=None, nbytes=0, compression=None):
    """The registered algorithm ``name`` of ``collective`` or, for None, the table's for a
    flat buffer of ``nbytes``; noted for the call's timeline event. (An allreduce's choice
    may be timed: ``allreduce_algorithm``.)"""
    if name is None:
        name = choose(collective, nbytes, ctx.transport_name, ctx.world_topology,
                      compression).algorithm
    ctx.note(name)
    return registry.lookup(collective, name)


def allreduce_algorithm(ctx, nbytes, compression=None):
    """The allreduce algorithm for a flat buffer of ``nbytes`` (``Communicator
    .allreduce_algorithm``): the table's row, a ``TIMED`` one resolved by timing ring against
    shm the first time (a collective: every rank comes here at the same call)."""
    name = choose("allreduce", nbytes, ctx.transport_name, ctx.world_topology, compression,
                  ctx.use_hierarchical_allreduce).algorithm
    if name == TIMED:
        name = ctx.resource("timed allreduce", lambda: _time_ring_against_shm(ctx))
    return name


def _time_ring_against_shm(ctx):
    noted, ctx.noted = ctx.noted, None  # the probe is not the call's
    try:
        return time_ring_against_shm(functools.partial(allreduce_flat, ctx), ctx.control)
    finally:
        ctx.noted = noted


def allreduce_flat(ctx, buf, op, algorithm, compression, index, sendbuf=None):
    """Allreduce the flat ``buf`` in place on transport ``index``, or reduce the flat
    ``sendbuf`` into it (MPI's separate send buffer)."""
    name = algorithm or allreduce_algorithm(ctx, buf.nbytes, compression)
    ctx.note(name)
    registry.lookup("allreduce", name).run(ctx, buf, op, compression, index, sendbuf)


def broadcast_flat(ctx, buf, root, algorithm, index):
    chosen(ctx, "broadcast", algorithm, buf.nbytes).run(ctx, buf, root, index)


def allgather_flat(ctx, flat, offsets, algorithm=None):
    """Every rank's 1-d ``flat`` (part ``offsets[r]:offsets[r + 1]`` of the result on rank
    ``r``) joined in rank order."""
    xp = array_module(flat)
    out = xp.empty(offsets[-1], flat.dtype)
    out[offsets[ctx.rank]:offsets[ctx.rank + 1]] = flat
    chosen(ctx, "allgather", algorithm, out.nbytes).run(ctx, out, offsets)
    return out


def allreduce_runner(ctx, x, op, algorithm, compression, out):
    """A function ``(x, out) -> result`` (None: the result is ``out``) that repeats this
    agreed ``allreduce`` on arrays like ``x`` and ``out``, with the algorithm picked once:
    the algorithm's own ``runner`` where it has one for these arrays (a native or ring
    reduction of host arrays goes straight to the transport, reducing ``x`` into the result
    without a copy, as MPI_Allreduce with a separate receive buffer does), else
    ``allreduce_into``."""
    name = algorithm or allreduce_algorithm(ctx, x.nbytes, compression)
    run = registry.lookup("allreduce", name).runner(ctx, x, op, compression, out)
    if run is not None:
        return run
    return lambda x, out: allreduce_into(ctx, x, op, name, compression, out)


def allreduce_into(ctx, x, op, algorithm, compression, out):
    """The reduction of ``x`` into ``out`` (a new array when None, ``x`` itself in place),
    ``x`` read where it is (a strided ``x`` is copied first, and so is an ``x`` that
    overlaps ``out``)."""
    xp = array_module(x)
    result = xp.empty(x.shape, x.dtype) if out is None else out
    src = None if result is x else xp.ascontiguousarray(x).reshape(-1)
    if src is not None and xp.may_share_memory(result, x):
        xp.copyto(result, x)
        src = None
    allreduce_flat(ctx, result.reshape(-1), op, algorithm, compression, 0, src)
    return result

"""Running a chosen algorithm on the communicator's transports: the flat allreduce, broadcast
and allgather that every collective of ``Communicator`` comes down to, and the runners a
repeated ``allreduce`` goes straight to.

Each function takes the ``Communicator`` first and uses its transports and its state
(the hierarchical levels, the shared-memory window, the ring layouts); which algorithm runs is
``algorithm_choice``'s, and whether a call may run is ``call_checks``'.
"""
import numpy as np

from .algorithm_choice import choose
from .broadcast import broadcast_chain, broadcast_tree
from .hierarchical import allreduce_hierarchical
from .ops import array_module, finish_mean, is_device_array
from .ring import RingAllreduce, allgather_ring, allreduce_ring


def run_on(comm, index, fn, *bufs):
    """Call ``fn(*bufs)`` on transport ``index``; device arrays go through host memory
    when the transport is MPI."""
    transport = comm.transports[index]
    if bufs and is_device_array(bufs[0]) and not transport.device:
        host = [b.get() for b in bufs]
        fn(*host)
        for b, h in zip(bufs, host):
            b.set(h)
        return
    with transport.activate():
        fn(*bufs)


def level_transports(comm, index):
    """The (intra-group, inter-group) transports of the hierarchical algorithm for one comm."""
    if index not in comm._levels:
        k = comm.hierarchical_allreduce_inter_nranks
        if k is None:
            local, cross = comm.topology.local.Dup(), comm.topology.cross.Dup()
        else:
            world = comm.topology.world
            local = world.Split(comm.rank // k, comm.rank)
            cross = world.Split(comm.rank % k, comm.rank)
        stream = getattr(comm.transports[index], "stream", None)
        comm._levels[index] = (comm._make_transport(local, stream),
                               comm._make_transport(cross, stream))
    return comm._levels[index]


def shared_memory(comm):
    """The communicator's shared-memory allreduce (one node), made on first use."""
    if comm._shm is None:
        from .shm import SharedMemoryAllreduce
        comm._shm = SharedMemoryAllreduce(comm.topology.world.Dup())
    return comm._shm


def allreduce_flat(comm, buf, op, algorithm, compression, index, sendbuf=None):
    """Allreduce the flat ``buf`` in place on transport ``index``, or reduce the flat
    ``sendbuf`` into it (MPI's separate send buffer: native, ring and shm read it where it
    is; hierarchical copies it into ``buf`` first)."""
    algorithm = algorithm or comm.allreduce_algorithm(buf.nbytes, compression)
    comm._note(algorithm)
    transport = comm.transports[index]
    if algorithm == "hierarchical":
        local, cross = level_transports(comm, index)
        if sendbuf is not None:
            array_module(buf).copyto(buf, sendbuf)

        def fn(b):
            allreduce_hierarchical(local, cross, b, op, compression, comm.chunk_bytes)
        run_on(comm, index, fn, buf)
        return
    if algorithm == "ring":
        def fn(b, s=None):
            allreduce_ring(transport, b, op, compression, comm.chunk_bytes, sendbuf=s)
    elif algorithm == "shm":
        shm = shared_memory(comm)

        def fn(b, s=None):
            shm.allreduce(b if s is None else s, b, op)
    else:
        def fn(b, s=None):
            transport.native_allreduce(b, op, s)
            finish_mean(b, op, comm.size)
    if sendbuf is None:
        run_on(comm, index, fn, buf)
    else:
        run_on(comm, index, fn, buf, sendbuf)


def broadcast_flat(comm, buf, root, algorithm, index):
    transport = comm.transports[index]
    if algorithm == "native":
        def fn(b):
            transport.native_bcast(b, root)
    else:
        if algorithm is None:
            algorithm = choose("broadcast", buf.nbytes, comm.transport_name,
                               comm._world_topology).algorithm
        algo = broadcast_tree if algorithm == "tree" else broadcast_chain

        def fn(b):
            if comm.size > 1 and b.size:
                algo(transport, b, root)
    comm._note(algorithm)
    run_on(comm, index, fn, buf)


def allgather_flat(comm, flat, offsets, algorithm=None):
    """Every rank's 1-d ``flat`` (part ``offsets[r]:offsets[r + 1]`` of the result on rank
    ``r``) joined in rank order; ``"native"`` needs equal parts."""
    xp = array_module(flat)
    out = xp.empty(offsets[-1], flat.dtype)
    out[offsets[comm.rank]:offsets[comm.rank + 1]] = flat
    transport = comm.transports[0]
    comm._note(algorithm or "ring")
    if algorithm == "native":
        run_on(comm, 0, transport.native_allgather, out)
    else:
        run_on(comm, 0, lambda b: allgather_ring(transport, b, offsets), out)
    return out


def allreduce_runner(comm, x, op, algorithm, compression, out):
    """A function ``(x, out) -> result`` (None: the result is ``out``) that repeats this
    agreed ``allreduce`` on arrays like ``x`` and ``out``, with the algorithm picked once.
    A native or ring reduction of host arrays goes straight to the transport, reducing
    ``x`` into the result without a copy (what MPI_Allreduce with a separate receive
    buffer costs)."""
    algorithm = algorithm or comm.allreduce_algorithm(x.nbytes, compression)
    transport = comm.transports[0]
    if algorithm == "native" and not transport.device and x.flags.c_contiguous:
        return native_runner(comm, x, op, out)
    if algorithm == "ring" and not transport.device and x.flags.c_contiguous:
        layout = (x.size, x.dtype, op, compression)
        if layout not in comm._rings:  # shared by the repeats of one layout
            comm._rings[layout] = RingAllreduce(transport, *layout, comm.chunk_bytes)
        ring, shape, dtype = comm._rings[layout], x.shape, x.dtype
        if out is not None and out is not x and x.ndim == 1:
            return lambda x, out: ring(out, x)

        def run(x, out):
            result = np.empty(shape, dtype) if out is None else out
            ring(result.reshape(-1), None if result is x else x.reshape(-1))
            return result
        return run
    return lambda x, out: allreduce_into(comm, x, op, algorithm, compression, out)


def native_runner(comm, x, op, out):
    """``allreduce_runner``'s native reduction of host arrays, one form per kind of
    ``out``: a small call's cost is mostly Python, so each form does only what it needs,
    and a sum or extremum into a separate ``out`` is the MPI call itself."""
    transport, shape, dtype, size = comm.transports[0], x.shape, x.dtype, comm.size
    if op != "mean" and out is not None and out is not x:
        return transport.bound_allreduce(op)
    reduce = transport.native_allreduce
    if op == "mean":
        def run(x, out):
            result = np.empty(shape, dtype) if out is None else out
            reduce(result, op, None if result is x else x)
            finish_mean(result, op, size)
            return result
    elif out is None:
        def run(x, out):
            result = np.empty(shape, dtype)
            reduce(result, op, x)
            return result
    else:
        def run(x, out):
            reduce(x, op)
    return run


def allreduce_into(comm, x, op, algorithm, compression, out):
    """The reduction of ``x`` into ``out`` (a new array when None, ``x`` itself in place),
    ``x`` read where it is (a strided ``x`` is copied first, and so is an ``x`` that
    overlaps ``out``)."""
    xp = array_module(x)
    result = xp.empty(x.shape, x.dtype) if out is None else out
    src = None if result is x else xp.ascontiguousarray(x).reshape(-1)
    if src is not None and xp.may_share_memory(result, x):
        xp.copyto(result, x)
        src = None
    allreduce_flat(comm, result.reshape(-1), op, algorithm, compression, 0, src)
    return result

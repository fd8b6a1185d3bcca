"""The one communicator the layers above see: collectives by name over a chosen transport.

Single-array collectives (``allreduce``, ``broadcast``, ``allgather``, ``reduce_scatter``)
return a new array and leave their input alone; ``allreduce_many`` and ``broadcast_many`` work
in place on many arrays, fused into buckets. A collective first checks that all ranks
called it with the same arguments (``call_checks``, ``agreement``), so a mismatch raises on
every rank instead of hanging; by default only a call whose arguments have not been agreed
before makes that exchange (``call_checks.agree``). With ``algorithm=None`` the algorithm
comes from the table in ``algorithm_choice``; each algorithm, registered in ``registry``,
runs itself (``dispatch``). Behind this facade, the checks, the dispatch and the algorithms see
the communicator only through its ``context`` (``AlgorithmContext``).

Each collective is one event of the timeline (``fleetmpi.core.timeline``, lane ``comm``) with the
algorithm it ran and its bytes (this rank's payload as it travels, as ``payload_bytes`` counts
it; an array's bytes for ``send``/``recv``).

Knobs, each an argument and (where it makes sense per job) an environment variable:
``transport`` / ``FLEETMPI_TRANSPORT`` (``"auto"``, the default: NCCL when every rank's arrays
live on a GPU of its own, MPI otherwise, see ``transport_choice``; ``"mpi"`` or ``"nccl"``;
when ``"auto"`` chose NCCL and it cannot start, MPI with a warning naming each rank's reason,
where an explicit ``"nccl"`` is an error), ``check`` /
``FLEETMPI_CHECK_COLLECTIVES`` (``0`` skips the agreement step, ``1``: once per distinct call,
``always``: on every call; see ``call_checks.agree``), ``nccl_comm_num``,
``fuse_grad_size_in_MB``, ``fuse_broadcast_MB``, ``use_hierarchical_allreduce``,
``hierarchical_allreduce_inter_nranks``, ``chunk_bytes``.
"""
import functools
import numbers
import os
import weakref

import numpy as np
from mpi4py import MPI

from fleetmpi.core import capture_checks, timeline
from fleetmpi.core.knobs import (ALWAYS, AUTO_TRANSPORT, CHECK_COLLECTIVES, CUDA_GRAPH, TRANSPORT,
                                 TRANSPORTS)
from fleetmpi.core.log import logger
from . import dispatch
from .agreement import HISTORY_MASK, HISTORY_PRIME, dtype_name
from .algorithm_choice import choose
from .call_checks import (CallAgreement, capture, check_algorithm, check_array, check_arrays,
                          check_counts, check_parts, check_peer, check_positive,
                          check_reduction, check_root)
from .context import AlgorithmContext
from .bucketing import megabytes
from .fusion import buckets_for
from .handles import CommThread
from .ops import array_module, is_device_array
from .ring import DEFAULT_CHUNK_BYTES, count_offsets, split_offsets
from .stall import CollectiveMismatchError, gather_rows
from .stall_report import call_text
from .topology import Topology
from .transport_choice import device_identity, pick_transport
from .transport_nccl import NCCLUnavailableError
from .watchdog import unwatch, watch_of

HEADER_DIMS = 32
P2P_TAG = 7
_NDARRAY = np.ndarray  # one global lookup on allreduce's repeated path


def _repeat_key(x, op, algorithm, compression, out):
    """What must be equal for an ``allreduce`` to repeat an agreed one after the same previous
    call: the arguments and every property of host arrays ``x`` and ``out`` that the checks
    look at; None for a call that is never repeated that way (device arrays, ``x`` and
    ``out`` views of one array, which may overlap and are copied by the checked path)."""
    if x.__class__ is not _NDARRAY:
        return None
    if out is None or out is x:
        flags = x.flags
        return (x.dtype, x.shape, flags.c_contiguous, flags.writeable, op, algorithm,
                compression, out is x)
    if out.__class__ is not _NDARRAY:
        return None
    x_base, out_base = x.base, out.base
    if (x if x_base is None else x_base) is (out if out_base is None else out_base):
        return None
    out_flags = out.flags
    return (x.dtype, x.shape, x.flags.c_contiguous, op, algorithm, compression, out.dtype,
            out.shape, out_flags.c_contiguous, out_flags.writeable)


def check_mode(check, environ=os.environ):
    """The argument check a communicator makes: ``False`` (none), ``True`` (a call whose
    arguments this rank has seen agreed before skips the exchange) or ``"always"``; from
    ``check`` when given, else from ``FLEETMPI_CHECK_COLLECTIVES`` (``0``, ``1``, ``always``;
    unset: ``1``)."""
    if check is None:
        return CHECK_COLLECTIVES.value(environ)
    if check not in (False, True, ALWAYS):
        raise ValueError(f"check={check!r} must be False, True or {ALWAYS!r}")
    return check


def _refuse_host_transport_in_capture(comm, collective):
    """Inside a CUDA graph capture, raise ``CaptureError`` for ``collective`` over the MPI
    transport: at the call, or for an asynchronous one when it is submitted, so that nothing
    is left queued to run after the capture has ended on one rank and not on another."""
    if capture_checks.current is not None and not comm.transports[0].device:
        capture_checks.refuse(
            f"the collective {collective!r} over the {comm.transport_name} transport",
            "MPI moves host memory through blocking host calls, which a CUDA graph cannot "
            "record (NCCL collectives can); use transport='nccl' (FLEETMPI_TRANSPORT=nccl) "
            f"with the arrays on the GPU, or run this step without a graph ({CUDA_GRAPH.name}=0, "
            "or graphed_step(..., enabled=False))")


def _recorded(collective, nbytes=False, watched=True):
    """Wrap a collective so that it is a call of the communicator's stall ``Watch`` (unless
    ``watched`` is False: point-to-point, which notes itself in the watch's ``peers``) and, while the timeline records, one ``comm`` event
    named ``collective`` with the algorithm(s) its flat operations noted and its bytes: the
    payload it added, or (``nbytes``) the bytes of its array ``x``."""
    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            _refuse_host_transport_in_capture(self, collective)
            if self._comm_thread.blocks_caller():
                self._comm_thread.drain()  # keep the order of the operations already started
            if not watched:
                return timed(self, *args, **kwargs)
            watch = self._watch
            entered = watch.enter((collective, args, kwargs))
            try:
                return timed(self, *args, **kwargs)
            finally:
                if entered:
                    watch.leave()

        def timed(self, *args, **kwargs):
            event = timeline.span(collective, "comm")
            if not event:
                return method(self, *args, **kwargs)
            ctx = self.context
            outer, ctx.noted = ctx.noted, []
            before = self.payload_bytes
            try:
                with event:
                    result = method(self, *args, **kwargs)
                    event.args["algorithm"] = "+".join(dict.fromkeys(ctx.noted))
                    event.args["bytes"] = (int((args[0] if args else kwargs["x"]).nbytes)
                                           if nbytes else self.payload_bytes - before)
            finally:
                ctx.noted = outer
            return result
        return call
    return wrap


class Communicator:
    """Collectives over the world of a ``Topology``; see the module docstring for the knobs.

    ``context``: the ``AlgorithmContext`` through which the argument checks, the dispatch and
    the algorithms read this communicator's transports and settings and keep their state."""

    def __init__(self, topology, transport=None, nccl_comm_num=1, fuse_grad_size_in_MB=32,
                 fuse_broadcast_MB=32, use_hierarchical_allreduce=False,
                 hierarchical_allreduce_inter_nranks=None, chunk_bytes=DEFAULT_CHUNK_BYTES,
                 check=None):
        transport = transport or TRANSPORT.value()
        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r} is not known; allowed: "
                             f"{', '.join(TRANSPORTS)}")
        check_positive("nccl_comm_num", nccl_comm_num, numbers.Integral)
        check_positive("fuse_grad_size_in_MB", fuse_grad_size_in_MB)
        check_positive("fuse_broadcast_MB", fuse_broadcast_MB)
        check_positive("chunk_bytes", chunk_bytes, numbers.Integral)
        inter = hierarchical_allreduce_inter_nranks
        if inter is not None:
            check_positive("hierarchical_allreduce_inter_nranks", inter, numbers.Integral)
            if topology.size % inter:
                raise ValueError(f"hierarchical_allreduce_inter_nranks={inter} must divide the "
                                 f"world size {topology.size}")
        self.topology = topology
        self.rank = topology.rank
        self.size = topology.size
        self.requested_transport = transport
        self.transport_name = (pick_transport(topology.world, device_identity())
                               if transport == AUTO_TRANSPORT else transport)
        self.nccl_comm_num = int(nccl_comm_num)
        self.fuse_grad_size_in_MB = fuse_grad_size_in_MB
        self.fuse_broadcast_MB = fuse_broadcast_MB
        self.use_hierarchical_allreduce = bool(use_hierarchical_allreduce)
        self.hierarchical_allreduce_inter_nranks = inter
        self.chunk_bytes = int(chunk_bytes)
        self.check = check_mode(check)
        self._repeatable = self.check is not ALWAYS  # allreduce's repeats skip the checks
        world = topology.world
        self._control = world.Dup()
        self._watch = watch_of(self._control)  # the stall watchdog's view of every call
        self.transports = self._start_transports(world)
        self.context = AlgorithmContext(
            topology, self.transport_name, self.transports, self._make_transport,
            self._control, self.chunk_bytes, self.use_hierarchical_allreduce, inter)
        self.payload_bytes = 0
        self._calls = CallAgreement(self._control, self.check)
        self._repeats = {}  # allreduce's repeats by previous call and key (see allreduce)
        self._same_arrays = {}  # by previous call: the arrays of its last repeat, weakly
        self._comm_thread = CommThread(f"fleetmpi-comm-{id(self):x}")
        self._watch.comm_thread = self._comm_thread
        self._async_stream = None
        self._derived = {}  # what split and with_options made, by what every rank asked

    # derived communicators

    def settings(self):
        """The settings this communicator was made with (the transport as chosen), as
        keyword arguments of ``Communicator``: what ``split`` and ``with_options`` inherit."""
        return {"transport": self.transport_name, "nccl_comm_num": self.nccl_comm_num,
                "fuse_grad_size_in_MB": self.fuse_grad_size_in_MB,
                "fuse_broadcast_MB": self.fuse_broadcast_MB,
                "use_hierarchical_allreduce": self.use_hierarchical_allreduce,
                "hierarchical_allreduce_inter_nranks": self.hierarchical_allreduce_inter_nranks,
                "chunk_bytes": self.chunk_bytes, "check": self.check}

    def _inherited(self, overrides, size):
        unknown = sorted(set(overrides) - set(self.settings()))
        if unknown:
            raise TypeError(f"unknown communicator setting(s) {unknown}; allowed: "
                            f"{', '.join(sorted(self.settings()))}")
        settings = dict(self.settings(), **overrides)
        inter = settings["hierarchical_allreduce_inter_nranks"]
        if "hierarchical_allreduce_inter_nranks" not in overrides and inter is not None \
                and size % inter:
            settings["hierarchical_allreduce_inter_nranks"] = None  # ranks per node instead
        return settings

    def _derive(self, request, make):
        """The communicator ``make()`` builds for ``request``, made once: every rank's
        request is exchanged first, so that all ranks take the one made before, or all make a
        new one (a collective), never some of each."""
        everyone = tuple(self._control.allgather(request))
        if everyone not in self._derived:
            self._derived[everyone] = make()
        return self._derived[everyone]

    def with_options(self, **overrides):
        """A communicator over the same ranks with every setting of this one (``settings``)
        but ``overrides``; this one when nothing changes. Asked again with the same overrides
        it returns the same communicator (no new MPI communicators). Every rank calls it."""
        settings = self._inherited(overrides, self.size)
        if settings == self.settings():
            return self
        request = ("with_options", tuple(sorted(settings.items(), key=lambda kv: kv[0])))
        return self._derive(request, lambda: Communicator(self.topology, **settings))

    def split(self, color, key=None, **overrides):
        """A communicator over the ranks that pass the same ``color`` (MPI's
        ``Comm.Split``), ranked by ``key`` (default: the rank here), with every setting of
        this one but ``overrides`` (a two-level allreduce's group size that does not divide
        the new size falls back to ranks per node); None for a ``color`` of None (the rank
        joins none). The same split asked again returns the same communicator. Every rank
        calls it."""
        key = self.rank if key is None else int(key)
        request = ("split", color, key, tuple(sorted(overrides.items(), key=lambda kv: kv[0])))

        def make():
            comm = self.topology.world.Split(MPI.UNDEFINED if color is None else color, key)
            if comm == MPI.COMM_NULL:
                return None
            return Communicator(Topology(comm), **self._inherited(overrides, comm.Get_size()))
        return self._derive(request, make)

    # construction helpers

    def _start_transports(self, world):
        """The ``nccl_comm_num`` transports. When ``"auto"`` chose NCCL and NCCL cannot start
        (the error names every rank's reason, on every rank), MPI instead, with one warning."""
        transports = []
        try:
            for _ in range(self.nccl_comm_num):
                comm = world.Dup()
                try:
                    transports.append(self._make_transport(comm))
                except NCCLUnavailableError:
                    comm.Free()
                    raise
        except NCCLUnavailableError as exc:
            if self.requested_transport != AUTO_TRANSPORT:
                raise
            for transport in transports:
                transport.free()
            if self.rank == 0:
                logger.warning("transport 'auto' chose NCCL, which could not start, so the "
                               "job uses MPI: %s", exc)
            self.transport_name = "mpi"
            return self._start_transports(world)
        return transports

    def _make_transport(self, comm, stream=None):
        if self.transport_name == "nccl":
            from .transport_nccl import NCCLTransport
            return NCCLTransport(comm, stream)
        from .transport_mpi import MPITransport
        return MPITransport(comm)

    def _agree(self, collective, arrays, problem, layout=None, described=None, **fields):
        """Count the call's payload (unless its arguments were rejected) and check that every
        rank called ``collective`` alike (``CallAgreement.agree``); ``described``: what a
        mismatch report prints, when ``arrays`` stand for it (``x[:0]`` for ``x``)."""
        if problem is None:
            self._count_payload(arrays, fields.get("compression"))
        self._calls.agree(collective, arrays, problem, layout, fields, described)

    def _count_payload(self, arrays, compression):
        """Add the bytes of ``arrays`` as they travel (float16 under compression) to
        ``payload_bytes``: what this rank contributes to a collective, before the algorithm's
        own forwarding, so strategies that send less can be compared by it."""
        for a in arrays:
            itemsize = 2 if compression == "fp16" else a.dtype.itemsize
            self.payload_bytes += int(a.size) * itemsize

    # what the layers above ask of the algorithms

    def allreduce_algorithm(self, nbytes, compression=None):
        """The algorithm ``allreduce``/``allreduce_many`` run with ``algorithm=None`` on a flat
        buffer of ``nbytes`` bytes: this communicator's row of ``algorithm_choice.CHOICES``.
        Collective the first time it comes to a ``TIMED`` row (ring and shm are timed then):
        call it on every rank."""
        return dispatch.allreduce_algorithm(self.context, nbytes, compression)

    def prefers_native(self, nbytes, compression=None):
        """Whether a reduction of ``nbytes`` bytes is small enough that the library's own
        collective is the cheapest here: where the table (``algorithm_choice``) runs the
        native allreduce without ``use_hierarchical_allreduce`` (a call's fixed cost outweighs
        the transfer). Sharding's reduce-scatters follow it."""
        return choose("allreduce", nbytes, self.transport_name, self.context.world_topology,
                      compression).algorithm == "native"

    def reduce_scatter_offsets(self, n):
        """Where ``reduce_scatter`` without ``counts`` cuts a flat array of ``n`` elements:
        rank ``r`` gets ``offsets[r]:offsets[r + 1]``, the lengths differing by at most one
        (the first ``n % size`` ranks get one more), as ``numpy.array_split``."""
        return split_offsets(n, self.size)

    # collectives

    def allreduce(self, x, op="sum", algorithm=None, compression=None, out=None):
        """The elementwise reduction of ``x`` over all ranks, as a new array (or in ``out``).

        ``op``: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` (integer means round down).
        ``algorithm``: ``"ring"``, ``"hierarchical"``, ``"native"`` (the MPI/NCCL library's
        own), ``"shm"`` (shared memory, one node only) or None to choose by size, transport
        and topology (``algorithm_choice``).
        ``compression="fp16"``: float16 on the wire, see ``fleetmpi.comm.compression``.
        ``out``: a C-contiguous array of ``x``'s shape and dtype to write the result into
        (``x`` itself for an in-place reduction); saves allocating the result on every call.

        A call on host arrays that repeats an agreed call right after the same call as before
        (a training loop's calls repeat every step) goes straight to the transfer, which
        matters for small messages. Two lookups find such a repeat. First, the ``x`` and
        ``out`` objects of the last repeat after that same previous call, their dtype and
        ``out``'s writability unchanged: a loop that reuses its buffers builds no key. Their
        size cannot have changed: NumPy refuses to resize an array that has a weak reference.
        (A shape set in place, keeping the size, reduces the same bytes; it goes unseen there,
        as do strides set in place, deprecated since NumPy 2.4.) Else a key that holds the
        code of the previous call (as ``call_checks.agree`` counts it), the arguments and
        every property of the arrays that the checks look at. ``check="always"`` and device
        arrays take the checked path.
        """
        calls = self._calls
        last = self._same_arrays.get(calls.previous)
        if (last is not None and out is not None and x is not None and last[0]() is x
                and last[1]() is out and op is last[2] and algorithm is last[3]
                and compression is last[4] and x.dtype is last[5] and out.dtype is last[5]
                and out.flags.writeable):
            repeat = last[6]
        else:
            key = _repeat_key(x, op, algorithm, compression, out) if self._repeatable else None
            try:
                repeat = self._repeats.get((calls.previous, key))
            except TypeError:  # an unhashable argument: the checks name it
                key = repeat = None
            if repeat is None:
                return self._allreduce_checked(x, op, algorithm, compression, out, key)
            if out is not None:
                self._same_arrays[calls.previous] = (weakref.ref(x), weakref.ref(out), op,
                                                     algorithm, compression, x.dtype,
                                                     repeat)
        if (timeline.active_recorder is not None or capture_checks.current is not None
                or self._comm_thread.pending_count and self._comm_thread.blocks_caller()):
            return self._allreduce_checked(x, op, algorithm, compression, out, None)
        code, payload, run, what = repeat
        self.payload_bytes += payload
        # CallAgreement.skip, written out: this path is a small call's whole cost
        if self.check:
            calls.unchecked += 1
            calls.history = (calls.history * HISTORY_PRIME + code) & HISTORY_MASK
            calls.previous = code
        watch = self._watch  # Watch.enter, written out: no call is in flight here
        watch.what = what
        watch.started += 1
        try:
            result = run(x, out)
        finally:
            watch.ended += 1
        return out if result is None else result

    @_recorded("allreduce")
    def _allreduce_checked(self, x, op, algorithm, compression, out, key):
        ctx = self.context

        def check():
            check_array(ctx, x)
            check_reduction(ctx, "allreduce", [x.dtype], op, algorithm, compression)
            if out is not None:
                check_array(ctx, out, "out", writable=True)
                if out.shape != x.shape or out.dtype != x.dtype or not out.flags.c_contiguous:
                    raise ValueError(f"out must be a C-contiguous {x.dtype} array of shape "
                                     f"{x.shape}, not {out.dtype} {out.shape}"
                                     f"{'' if out.flags.c_contiguous else ' (strided)'}")
        problem = capture(check)
        before, previous = self.payload_bytes, self._calls.previous
        self._agree("allreduce", [x], problem, op=op, algorithm=algorithm,
                    compression=compression)
        if key is None:
            return dispatch.allreduce_into(ctx, x, op, algorithm, compression, out)
        run = dispatch.allreduce_runner(ctx, x, op, algorithm, compression, out)
        what = ("allreduce", call_text(("allreduce", (x,), {})))
        self._repeats[previous, key] = (self._calls.previous, self.payload_bytes - before, run,
                                        what)
        result = run(x, out)
        return out if result is None else result

    @_recorded("allreduce_many")
    def allreduce_many(self, arrays, op="sum", algorithm=None, compression=None,
                       fuse_grad_size_in_MB=None):
        """Allreduce every array of ``arrays`` in place, fused into buckets.

        Buckets hold at most ``fuse_grad_size_in_MB`` (default: the communicator's) of
        consecutive same-dtype arrays and are spread round-robin over the ``nccl_comm_num``
        communicators. Arrays that are adjacent views of one flat buffer are reduced without
        a packing copy.
        """
        mb = self.fuse_grad_size_in_MB if fuse_grad_size_in_MB is None else fuse_grad_size_in_MB
        ctx = self.context

        def check():
            check_arrays(ctx, arrays)
            check_positive("fuse_grad_size_in_MB", mb)
            check_reduction(ctx, "allreduce", {a.dtype for a in arrays}, op, algorithm,
                            compression)
        problem = capture(check)
        self._agree("allreduce_many", arrays, problem, op=op, algorithm=algorithm,
                    compression=compression)
        for i, bucket in enumerate(buckets_for(arrays, megabytes(mb))):
            flat = bucket.load()
            dispatch.allreduce_flat(ctx, flat, op, algorithm, compression,
                                    i % self.nccl_comm_num)
            bucket.store()

    # asynchronous forms

    def allreduce_async(self, x, op="sum", algorithm=None, compression=None, out=None):
        """``allreduce`` started on this communicator's background thread; returns a
        ``Handle`` whose ``wait()`` gives the result. ``x`` (and ``out``) must stay unchanged
        until then. See ``fleetmpi.comm.handles`` for order, errors and threads."""
        return self.submit("allreduce", lambda: self.allreduce(
            x, op=op, algorithm=algorithm, compression=compression, out=out), x)

    def allreduce_many_async(self, arrays, op="sum", algorithm=None, compression=None,
                             fuse_grad_size_in_MB=None):
        """``allreduce_many`` (in place) started on the background thread; returns a
        ``Handle``: the arrays hold the reduction once its ``wait()`` returns."""
        return self.submit("allreduce_many", lambda: self.allreduce_many(
            arrays, op=op, algorithm=algorithm, compression=compression,
            fuse_grad_size_in_MB=fuse_grad_size_in_MB), *arrays[:1])

    def broadcast_async(self, x, root=0, algorithm=None):
        """``broadcast`` started on the background thread; ``wait()`` gives the root's array."""
        return self.submit("broadcast", lambda: self.broadcast(x, root, algorithm), x)

    def allgather_async(self, x, algorithm=None, stack=False):
        """``allgather`` started on the background thread; ``wait()`` gives the joined array."""
        return self.submit("allgather", lambda: self.allgather(x, algorithm, stack), x)

    def allgatherv_async(self, x, counts):
        """``allgatherv`` started on the background thread; ``wait()`` gives the joined
        array (sharding stage 3 prefetches the next unit's parameters with it)."""
        return self.submit("allgatherv", lambda: self.allgatherv(x, counts), x)

    def reduce_scatter_async(self, x, op="sum", algorithm=None, compression=None, counts=None):
        """``reduce_scatter`` started on the background thread; ``wait()`` gives this rank's
        block."""
        return self.submit("reduce_scatter", lambda: self.reduce_scatter(
            x, op=op, algorithm=algorithm, compression=compression, counts=counts), x)

    def alltoall_async(self, x, splits=None):
        """``alltoall`` started on the background thread; ``wait()`` gives ``(received,
        received_splits)``."""
        return self.submit("alltoall", lambda: self.alltoall(x, splits), x)

    def barrier_async(self):
        """``barrier`` started on the background thread; ``wait()`` returns once every rank
        has reached it (Horovod's ``join``-free way to wait without blocking the caller)."""
        return self.submit("barrier", self.barrier)

    def pending(self):
        """How many asynchronous operations of this communicator have not finished."""
        return self._comm_thread.pending_count

    def submit(self, collective, call, *arrays):
        """Run ``call()`` (blocking collectives of this communicator only) on the background
        thread after the operations started before it; returns its ``Handle``, named
        ``collective``. ``arrays``: the arrays ``call`` reads, one is enough to tell whether
        they live on a device (none, as for a barrier: whether the transport moves device
        arrays). Device arrays: the operation runs on this communicator's own stream, on the
        caller's device, ordered after the work the caller's current stream has queued so far
        by an event recorded now (the gradient's producer), and its handle gets the event
        recorded after it (see ``Handle.wait``)."""
        _refuse_host_transport_in_capture(self, collective)
        on_device = is_device_array(arrays[0]) if arrays else self.transports[0].device
        if not on_device:
            return self._comm_thread.submit(collective, lambda handle: call())
        import cupy

        producer = cupy.cuda.get_current_stream().record()
        device = cupy.cuda.Device()

        def operation(handle):
            with device:
                if self._async_stream is None:
                    self._async_stream = cupy.cuda.Stream(non_blocking=True)
                stream = self._async_stream
                stream.wait_event(producer)
                with stream:
                    result = call()
                handle.device_event = stream.record()
            return result
        return self._comm_thread.submit(collective, operation)

    @_recorded("broadcast")
    def broadcast(self, x, root=0, algorithm=None):
        """``root``'s ``x``, as a new array on every rank (``x`` gives shape and dtype elsewhere).

        ``algorithm``: ``"tree"`` (binomial), ``"chain"`` (pipelined), ``"native"``, or None
        (by size, ``algorithm_choice``: the tree for small buffers, the chain for large).
        """
        ctx = self.context

        def check():
            check_array(ctx, x)
            check_root(ctx, root)
            check_algorithm(ctx, "broadcast", algorithm)
        problem = capture(check)
        self._agree("broadcast", [x], problem, root=root, algorithm=algorithm)
        xp = array_module(x)
        buf = xp.array(x, order="C", copy=True).reshape(-1)
        dispatch.broadcast_flat(ctx, buf, root, algorithm, 0)
        return buf.reshape(x.shape)

    @_recorded("broadcast_many")
    def broadcast_many(self, arrays, root=0, algorithm=None, fuse_broadcast_MB=None):
        """Overwrite every array of ``arrays`` with ``root``'s, in place, fused into buckets
        of at most ``fuse_broadcast_MB``."""
        mb = self.fuse_broadcast_MB if fuse_broadcast_MB is None else fuse_broadcast_MB
        ctx = self.context

        def check():
            check_arrays(ctx, arrays)
            check_root(ctx, root)
            check_positive("fuse_broadcast_MB", mb)
            check_algorithm(ctx, "broadcast", algorithm)
        problem = capture(check)
        self._agree("broadcast_many", arrays, problem, root=root, algorithm=algorithm)
        for i, bucket in enumerate(buckets_for(arrays, megabytes(mb))):
            flat = bucket.load()
            dispatch.broadcast_flat(ctx, flat, root, algorithm, i % self.nccl_comm_num)
            bucket.store()

    @_recorded("allgather")
    def allgather(self, x, algorithm=None, stack=False):
        """Every rank's ``x`` joined along the first axis in rank order, as Horovod's
        allgather: the first dimension may differ between ranks (zero too), the rest of the
        shape and the dtype may not. ``stack=True``: equal shapes stacked along a new first
        axis, shape ``(size,) + x.shape``.

        ``algorithm``: ``"ring"`` or ``"native"`` (the library's, for equal shapes), or None
        (``algorithm_choice``: the ring).
        """
        ctx = self.context

        def check():
            check_array(ctx, x)
            if not stack and x.ndim == 0:
                raise ValueError("allgather joins along the first axis and needs an array with "
                                 "at least one dimension (or stack=True)")
            check_algorithm(ctx, "allgather", algorithm)
        problem = capture(check)
        if stack:
            self._agree("allgather", [x], problem, algorithm=algorithm)
            offsets = count_offsets([x.size] * self.size)
            shape = (self.size,) + x.shape
        else:
            self._agree("allgather", [] if problem else [x[:0]], problem, algorithm=algorithm,
                        described=[] if problem else [x])
            rows = [int(v) for v in self._exchange_rows([x.shape[0]], "allgather")[:, 0]]
            check_parts(check_algorithm(ctx, "allgather", algorithm), rows)
            offsets = count_offsets(rows, int(np.prod(x.shape[1:], dtype=np.int64)))
            shape = (sum(rows),) + x.shape[1:]
        return dispatch.allgather_flat(ctx, x.reshape(-1), offsets, algorithm).reshape(shape)

    def _exchange_rows(self, values, collective):
        """Every rank's ``values`` (integers, as many on every rank) as a table, one row per
        rank: one small exchange that reports ranks that do not arrive."""
        try:
            return gather_rows(self._control, np.asarray(values, dtype=np.int64), collective)
        except CollectiveMismatchError:
            self._calls.forget()  # as every other rank, which raised in its agreement
            raise

    def _splits(self, splits, rows, what):
        """``splits`` checked against ``rows``, or equal splits (``rows`` divisible)."""
        if splits is None:
            if rows % self.size:
                raise ValueError(f"{what} splits the first dimension {rows} equally over "
                                 f"{self.size} ranks, which does not divide it; pass splits")
            return [rows // self.size] * self.size
        check_counts(self.context, list(splits) if isinstance(splits, (list, tuple)) else splits,
                     rows, "the first dimension of x")
        return [int(v) for v in splits]

    @_recorded("alltoall")
    def alltoall(self, x, splits=None):
        """Send rows ``splits[r]`` of ``x`` (its first axis cut in order; equal parts when
        None) to rank ``r``, and receive every rank's part for this rank. Returns
        ``(received, received_splits)``: the parts joined in rank order along the first axis,
        and how many rows came from each rank (Horovod's alltoall)."""
        ctx = self.context

        def check():
            check_array(ctx, x)
            if x.ndim == 0:
                raise ValueError("alltoall needs an array with at least one dimension")
            self._splits(splits, x.shape[0], "alltoall")
        problem = capture(check)
        self._agree("alltoall", [] if problem else [x[:0]], problem,
                    described=[] if problem else [x])
        mine = self._splits(splits, x.shape[0], "alltoall")
        received = [int(v) for v in self._exchange_rows(mine, "alltoall")[:, self.rank]]
        xp = array_module(x)
        row = int(np.prod(x.shape[1:], dtype=np.int64))
        send = xp.ascontiguousarray(x).reshape(-1)
        send_offsets, recv_offsets = count_offsets(mine, row), count_offsets(received, row)
        out = xp.empty(recv_offsets[-1], x.dtype)
        self._count_payload([x], None)
        dispatch.chosen(ctx, "alltoall", None, send.nbytes).run(ctx, send, send_offsets, out,
                                                                recv_offsets)
        return out.reshape((sum(received),) + x.shape[1:]), received

    @_recorded("gather")
    def gather(self, x, root=0):
        """Every rank's ``x`` joined along the first axis in rank order on ``root`` (the first
        dimension may differ between ranks); None on the other ranks."""
        ctx = self.context

        def check():
            check_array(ctx, x)
            check_root(ctx, root)
            if x.ndim == 0:
                raise ValueError("gather joins along the first axis and needs an array with at "
                                 "least one dimension")
        problem = capture(check)
        self._agree("gather", [] if problem else [x[:0]], problem, root=root,
                    described=[] if problem else [x])
        rows = [int(v) for v in self._exchange_rows([x.shape[0]], "gather")[:, 0]]
        xp = array_module(x)
        offsets = count_offsets(rows, int(np.prod(x.shape[1:], dtype=np.int64)))
        buf = xp.empty(offsets[-1] if self.rank == root else x.size, x.dtype)
        lo = offsets[self.rank] if self.rank == root else 0
        buf[lo:lo + x.size] = x.reshape(-1)
        local = offsets if self.rank == root else [o - offsets[self.rank] for o in offsets]
        dispatch.chosen(ctx, "gather", None, buf.nbytes).run(ctx, buf, local, root)
        return buf.reshape((sum(rows),) + x.shape[1:]) if self.rank == root else None

    @_recorded("scatter")
    def scatter(self, x, root=0, splits=None):
        """Rank ``r``'s part of the root's ``x``: rows ``splits[r]`` of its first axis (equal
        parts when None). The other ranks pass an array of the same dtype, whose shape and
        values are not used (the root's shape and splits reach them first)."""
        ctx = self.context

        def check():
            check_array(ctx, x)
            check_root(ctx, root)
            if x.ndim == 0:
                raise ValueError("scatter cuts the first axis and needs an array with at least "
                                 "one dimension")
            if self.rank == root:
                self._splits(splits, x.shape[0], "scatter")
            if x.ndim > HEADER_DIMS:
                raise ValueError(f"scatter supports arrays of up to {HEADER_DIMS} dimensions, "
                                 f"not {x.ndim}")
        problem = capture(check)
        # Only the dtype must agree: the root's shape and splits travel in the header.
        self._agree("scatter", [] if problem else [x.reshape(-1)[:0]], problem, root=root)
        header = np.zeros(self.size + 1 + HEADER_DIMS, dtype=np.int64)
        if self.rank == root:
            header[:self.size] = self._splits(splits, x.shape[0], "scatter")
            header[self.size] = x.ndim - 1
            header[self.size + 1:self.size + x.ndim] = x.shape[1:]
        table = self._exchange_rows(header, "scatter")[root]
        parts = [int(v) for v in table[:self.size]]
        tail = tuple(int(v) for v in table[self.size + 1:self.size + 1 + table[self.size]])
        xp = array_module(x)
        row = int(np.prod(tail, dtype=np.int64))
        offsets = count_offsets(parts, row)
        part = xp.empty(parts[self.rank] * row, x.dtype)
        send = xp.ascontiguousarray(x).reshape(-1) if self.rank == root else part[:0]
        dispatch.chosen(ctx, "scatter", None, send.nbytes).run(ctx, send, offsets, part, root)
        return part.reshape((parts[self.rank],) + tail)

    @_recorded("allgatherv")
    def allgatherv(self, x, counts):
        """Every rank's 1-d ``x`` (``counts[r]`` elements on rank ``r``, zero allowed)
        joined in rank order, as MPI's ``Allgatherv``; every rank passes the same ``counts``."""
        ctx = self.context

        def check():
            check_array(ctx, x)
            if x.ndim != 1:
                raise ValueError(f"allgatherv takes a 1-d array, not shape {tuple(x.shape)}")
            check_counts(ctx, counts)
            if x.size != counts[self.rank]:
                raise ValueError(f"allgatherv got {x.size} elements on rank {self.rank}, "
                                 f"but counts[{self.rank}]={counts[self.rank]}")
        problem = capture(check)
        # The element count differs per rank by design; the counts themselves must agree.
        self._agree("allgatherv", [] if problem else [x[:0]], problem,
                    layout=None if problem else tuple(int(c) for c in counts),
                    described=[] if problem else [x])
        self._count_payload([x], None)
        return dispatch.allgather_flat(ctx, x, count_offsets(counts))

    @_recorded("reduce_scatter")
    def reduce_scatter(self, x, op="sum", algorithm=None, compression=None, counts=None,
                       overwrite_input=False):
        """This rank's block of the reduction of ``x``: blocks split ``x`` along its first axis
        as ``numpy.array_split(reduced, size)`` does, so any length works; or, as MPI's
        ``Reduce_scatter``, ``counts[r]`` rows for rank ``r`` (zero allowed).

        ``algorithm``: ``"ring"`` or ``"native"``, or None (``algorithm_choice``: the ring);
        ``compression`` as for allreduce.
        ``overwrite_input``: the ring may reduce in ``x`` itself, leaving partial sums there,
        instead of in a copy, and return a view of ``x`` (for a caller that drops ``x``
        afterwards).
        """
        ctx = self.context

        def check():
            check_array(ctx, x)
            if x.ndim == 0:
                raise ValueError("reduce_scatter needs an array with at least one dimension")
            if counts is not None:
                check_counts(ctx, counts, x.shape[0], "the length of x")
            check_reduction(ctx, "reduce_scatter", [x.dtype], op, algorithm, compression)
        problem = capture(check)
        self._agree("reduce_scatter", [x], problem, op=op, algorithm=algorithm,
                    compression=compression,
                    layout=None if counts is None or problem else tuple(map(int, counts)))
        row = int(np.prod(x.shape[1:], dtype=np.int64))
        rows = (split_offsets(x.shape[0], self.size) if counts is None
                else count_offsets(counts))
        offsets = [r * row for r in rows]
        shape = (rows[self.rank + 1] - rows[self.rank],) + x.shape[1:]
        block = dispatch.chosen(ctx, "reduce_scatter", algorithm, x.nbytes, compression).run(
            ctx, x, op, compression, offsets, overwrite_input)
        return block.reshape(shape)

    @_recorded("send", nbytes=True, watched=False)
    def send(self, x, dest):
        """Send ``x`` to rank ``dest``; the matching ``recv`` checks dtype and shape."""
        ctx = self.context
        check_array(ctx, x)
        check_peer(ctx, dest, "dest")
        if x.ndim > HEADER_DIMS:
            raise ValueError(f"send supports arrays of up to {HEADER_DIMS} dimensions, "
                             f"not {x.ndim}")
        header = np.zeros(4 + HEADER_DIMS, dtype=np.int64)
        header[:4] = (x.dtype.num, x.size, x.nbytes, x.ndim)
        header[4:4 + x.ndim] = x.shape
        peers = self._watch.peers
        peers.enter_send(dest, x)
        try:
            self._control.Send(header, dest=dest, tag=P2P_TAG)
            buf = array_module(x).ascontiguousarray(x)
            dispatch.chosen(ctx, "send", None, buf.nbytes).run(ctx, buf, dest)
        finally:
            peers.ended += 1

    @_recorded("recv", nbytes=True, watched=False)
    def recv(self, x, source):
        """Receive rank ``source``'s ``send`` into ``x`` in place and return ``x``.

        If the sender's dtype or shape differ from ``x``'s, the message is drained and a
        ``ValueError`` names both.
        """
        ctx = self.context
        check_array(ctx, x, writable=True)
        check_peer(ctx, source, "source")
        header = np.empty(4 + HEADER_DIMS, dtype=np.int64)
        peers = self._watch.peers
        peers.enter_recv(source, x)
        try:
            self._control.Recv(header, source=source, tag=P2P_TAG)
            self._recv_body(x, source, header)
        finally:
            peers.ended += 1
        return x

    def _recv_body(self, x, source, header):
        """``recv`` once its header has come: the array, or the message drained and an
        error naming both dtypes and shapes."""
        ctx = self.context
        num, _, nbytes, ndim = (int(v) for v in header[:4])
        shape = tuple(int(v) for v in header[4:4 + ndim])
        xp = array_module(x)
        receive = dispatch.chosen(ctx, "recv", None, nbytes)
        if num != x.dtype.num or shape != x.shape:
            receive.run(ctx, xp.empty(nbytes, np.uint8), source)
            raise ValueError(f"recv from rank {source}: expected a {x.dtype} array of shape "
                             f"{x.shape}, but rank {source} sent {dtype_name(num)} "
                             f"of shape {shape}")
        buf = x if x.flags.c_contiguous else xp.empty(x.shape, x.dtype)
        receive.run(ctx, buf, source)
        if buf is not x:
            x[...] = buf

    @_recorded("barrier")
    def barrier(self):
        """Return once every rank has called ``barrier``."""
        self._agree("barrier", [], None)
        dispatch.chosen(self.context, "barrier").run(self.context)

    def free(self):
        """Finish the asynchronous operations started, then release this communicator's MPI
        communicators, windows and NCCL communicators, and those of every communicator
        ``split`` and ``with_options`` made from it. Every rank calls it."""
        derived = [c for c in self._derived.values() if c is not None]
        self._derived.clear()
        for communicator in derived:
            communicator.free()
        self._comm_thread.stop()
        self.context.free()
        for transport in self.transports:
            transport.free()
        unwatch(self._control)
        self._control.Free()


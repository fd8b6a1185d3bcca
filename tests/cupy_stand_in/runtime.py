"""The CUDA side of the CuPy stand-in (what ``cupy.cuda`` gives): one device, streams that
capture, events, graphs, memory pools and the process's allocator, the errors CuPy raises,
and the counts of what the host asked of the device.

Work reaches the device through ``Runtime.enqueue(name, run)``: on a stream that is not
capturing ``run()`` is a kernel that runs at once; a capturing stream records it instead, and
a ``Graph`` made by ``end_capture`` runs what it recorded at every ``launch``. What CUDA and
CuPy 14 refuse while a stream captures is refused here with their error types and messages
(``CUDARuntimeError`` and ``CUDADriverError`` print as CuPy prints them; the plain
``RuntimeError`` messages are CuPy's own checks, from ``cupy/cuda/memory.pyx`` and
``cupy_backends/cuda/api/runtime.pyx`` of v14.2.0), and an error that CUDA answers by
invalidating the capture invalidates it here too: later work on it raises, and ``end_capture``
raises ``cudaErrorStreamCaptureInvalidated``.

Memory: a pool hands out host buffers (``numpy.uint8``, zeroed when first taken from the
"device") rounded up to CuPy's 512-byte unit, and takes a buffer back when the last array on it
is gone; the next allocation of the same rounded size gets it again, so freed memory is reused
as CuPy's pool reuses it (CuPy also splits and merges blocks and keeps them per stream, which
this pool does not). A graph's recorded work holds the buffers it writes, not their ownership:
memory freed during a capture goes back to the pool current then, and eager work given it
is overwritten by the next replay, as on a GPU.
"""
import collections
import contextlib
import dataclasses
import itertools
import threading
import weakref

import numpy as np

ROUND_SIZE = 512  # CuPy's MemoryPool allocation unit
DEVICE_MEMORY = 16 << 30  # what the stand-in device says it has
RELAXED = 2
_CUDA_ERRORS = {
    400: ("cudaErrorInvalidResourceHandle", "invalid resource handle"),
    401: ("cudaErrorIllegalState", "the operation cannot be performed in the present state"),
    900: ("cudaErrorStreamCaptureUnsupported", "operation not permitted when stream is capturing"),
    901: ("cudaErrorStreamCaptureInvalidated",
          "operation failed due to a previous error during capture"),
    905: ("cudaErrorStreamCaptureIsolation",
          "dependency created on uncaptured work in another stream"),
    907: ("cudaErrorCapturedEvent",
          "operation not permitted on an event last recorded in a capturing stream"),
}
INVALIDATED = "the stream was capturing, but an error has invalidated the capture sequence"
_pointers = itertools.count(0x7F0000001000, 0x100)


class CUDARuntimeError(RuntimeError):
    """``cupy.cuda.runtime.CUDARuntimeError``: ``status`` and ``"name: description"``."""

    def __init__(self, status):
        self.status = status
        name, text = _CUDA_ERRORS[status]
        super().__init__(f"{name}: {text}")


class CUDADriverError(RuntimeError):
    """``cupy.cuda.driver.CUDADriverError``, as a kernel launch into an invalidated capture
    raises it (CuPy launches its kernels through the driver API)."""


@dataclasses.dataclass
class Counts:
    """What the host asked of the device while a ``Runtime.counting()`` block ran.

    ``launches``: kernels queued from the host (each elementwise operation, reduction, copy
    kernel, memset and RawKernel launch; ``kernels`` by name); ``library_calls``: calls into
    a library that queues its own kernels, by library (``cublas``: products through CuPy's
    wrappers; ``nccl``: the one-rank NCCL; ``cublasLt``, ``cudnn``: stand-ins of theirs
    through ``cupy_stand_in.library_call``);
    ``graph_launches``: graphs launched (one host call each, whatever they hold);
    ``allocations`` and ``allocated_bytes``: requests to the current allocator;
    ``new_memory``: bytes a pool took from the device because it had no free block of the
    size; ``syncs``: host waits for the device (a copy to the host, a synchronize);
    ``host_to_device``: copies from host memory."""

    launches: int = 0
    kernels: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    library_calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    graph_launches: int = 0
    allocations: int = 0
    allocated_bytes: int = 0
    new_memory: int = 0
    syncs: int = 0
    host_to_device: int = 0


class Capture:
    """One capture sequence: the work it recorded, the streams that joined it, whether an
    error invalidated it."""

    def __init__(self, origin, mode):
        self.origin, self.mode = origin, mode
        self.work = []
        self.streams = [origin]
        self.invalidated = False
        self.active = True

    def check_open(self):
        """What launching into an invalidated capture raises."""
        if self.invalidated:
            raise CUDADriverError("CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: operation failed "
                                  "due to a previous error during capture")

    def refuse(self, status):
        """Invalidate the capture and raise CUDA's ``status``."""
        self.invalidated = True
        raise CUDARuntimeError(status)


class Runtime:
    """One device's state: the current stream of each thread, the allocator, the captures
    under way, the counts and a ``log`` of the calls a test of ``CUDAGraph`` checks
    (device synchronize, set_allocator, begin_capture, end_capture, graph launch).
    ``in_using_allocator``: a test's say that a thread-local allocator
    (``cupy.cuda.using_allocator``) is in force, inside which CuPy refuses
    ``set_allocator``."""

    def __init__(self, device=0):
        self.device = device
        self.log = []
        self.in_using_allocator = False
        self._local = threading.local()
        self._records = []
        self._streams = weakref.WeakValueDictionary()
        self.null = Stream(self, null=True)
        self.default_pool = MemoryPool(self)
        self.allocator = self.default_pool.malloc
        self.captures = []

    # -- streams and captures ------------------------------------------------------------
    def _stack(self):
        if not hasattr(self._local, "streams"):
            self._local.streams = [self.null]
        return self._local.streams

    def current_stream(self):
        return self._stack()[-1]

    def capturing(self):
        """Whether the current stream captures: CuPy's ``streamIsCapturing``, which raises
        for an invalidated capture."""
        return self.current_stream().is_capturing()

    # -- work --------------------------------------------------------------------------------
    def stream_of(self, ptr):
        """The ``Stream`` whose handle is ``ptr`` (what libraries are handed)."""
        return self._streams[ptr]

    def enqueue(self, name, run, done=False, library=None, stream=None):
        """Queue kernel ``name`` (``run()``) on ``stream`` (the current stream by default):
        run now, or recorded by a capture. ``done``: ``run`` already ran, writing only memory
        it allocated (an operation that made its output to learn its shape); it is then only
        recorded. ``library``: the work is a call into that library, counted as such, not as
        a launch."""
        capture = (self.current_stream() if stream is None else stream).capture
        if capture is not None:
            capture.check_open()
            capture.work.append(run)
        elif not done:
            run()
        if library is None:
            self.count("launches")
            self.count("kernels", key=name)
        else:
            self.count("library_calls", key=library)

    def library_call(self, library, name, run):
        """What ``cupy_stand_in.library_call`` does for stand-ins of the libraries that queue
        their own kernels (``"cublasLt"``, ``"cudnn"``): ``run()`` queued as ``library``'s
        call ``name`` on the current stream, counted as one call of it."""
        self.enqueue(name, run, library=library)

    def check_cublas(self):
        """What CuPy 14's cuBLAS wrappers do before each call (``cublas.setStream``, from
        ``cupy_backends/cuda/libs/cublas.pyx``): refuse a capturing stream."""
        if self.capturing():
            raise NotImplementedError("calling cuBLAS API during stream capture is currently "
                                      "unsupported")

    def check_transfer(self, direction):
        """CuPy's check before a copy between host and device on the current stream
        (``memory.pyx``'s ``copy_to_host_async``/``copy_from_host_async``)."""
        if self.capturing():
            raise RuntimeError(f"the current stream is capturing, so {direction} transfers "
                               "are disallowed")

    # -- memory ------------------------------------------------------------------------------
    def alloc(self, nbytes):
        """A ``MemoryPointer`` of ``nbytes`` from the current allocator (``cupy.cuda.alloc``)."""
        self.count("allocations")
        self.count("allocated_bytes", nbytes)
        return self.allocator(nbytes)

    def get_allocator(self):
        return self.allocator

    def set_allocator(self, allocator=None):
        if self.in_using_allocator:
            raise ValueError("Can't change the global allocator inside `using_allocator` "
                             "context manager")
        allocator = self.default_pool.malloc if allocator is None else allocator
        self.log.append(("set_allocator", allocator))
        self.allocator = allocator

    # -- counts ------------------------------------------------------------------------------
    def count(self, field, amount=1, key=None):
        for record in self._records:
            if key is None:
                setattr(record, field, getattr(record, field) + amount)
            else:
                getattr(record, field)[key] += amount

    @contextlib.contextmanager
    def counting(self):
        """A ``Counts`` of what the block asks of the device (blocks may nest)."""
        record = Counts()
        self._records.append(record)
        try:
            yield record
        finally:
            self._records.remove(record)

    def synchronized(self):
        """A host wait for the device, counted."""
        self.count("syncs")


class Device:
    """``cupy.cuda.Device``: the stand-in has one device, 0."""

    pci_bus_id = "0000:00:00.0"

    def __init__(self, runtime, id=None):
        self._runtime = runtime
        self.id = runtime.device if id is None else int(id)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def use(self):
        if self.id != self._runtime.device:
            raise CUDARuntimeError(400)

    def synchronize(self):
        """``cudaDeviceSynchronize``: refused while any stream captures (CUDA invalidates
        those captures)."""
        active = [c for c in self._runtime.captures if c.active]
        if active:
            for capture in active:
                capture.invalidated = True
            raise CUDARuntimeError(900)
        self._runtime.log.append(("synchronize", self.id))
        self._runtime.synchronized()


class Stream:
    """``cupy.cuda.Stream``: current (per thread) inside ``with``; ``begin_capture`` and
    ``end_capture`` as CuPy's."""

    def __init__(self, runtime, null=False, non_blocking=False):
        self._runtime = runtime
        self.null = null
        self.non_blocking = non_blocking
        self.ptr = 0 if null else next(_pointers)
        self.capture = None
        runtime._streams[self.ptr] = self

    def __repr__(self):
        return f"<stand-in Stream {self.ptr:#x}>"

    def __enter__(self):
        self._runtime._stack().append(self)
        return self

    def __exit__(self, *exc):
        stack = self._runtime._stack()
        assert stack.pop() is self, "streams left out of order"
        return False

    def is_capturing(self):
        if self.capture is not None and self.capture.invalidated:
            raise RuntimeError(INVALIDATED)
        return self.capture is not None

    def begin_capture(self, mode=None):
        if self.null:
            raise RuntimeError("cannot capture on the default (legacy) stream")
        if self.capture is not None:
            raise CUDARuntimeError(401)
        mode = RELAXED if mode is None else mode
        self._runtime.log.append(("begin_capture", self, mode, self._runtime.allocator))
        self.capture = Capture(self, mode)
        self._runtime.captures.append(self.capture)

    def end_capture(self):
        capture = self.capture
        if capture is None or capture.origin is not self:
            raise CUDARuntimeError(401)
        capture.active = False
        self._runtime.captures.remove(capture)
        for stream in capture.streams:
            stream.capture = None
        self._runtime.log.append(("end_capture", self))
        if capture.invalidated:
            raise CUDARuntimeError(901)
        return Graph(self._runtime, capture.work)

    def synchronize(self):
        if self.capture is not None:
            self.capture.refuse(900)
        self._runtime.synchronized()

    def record(self, event=None):
        event = Event(self._runtime) if event is None else event
        event.record(self)
        return event

    def wait_event(self, event):
        """Work queued here after this waits for ``event``. A capturing stream may wait only
        for an event recorded in its own capture (CUDA's programming guide: waiting on a
        non-captured event from a capturing stream is invalid without
        ``cudaEventWaitExternal``, which CuPy does not pass); a stream that is not capturing
        joins the capture whose event it waits for, as in CUDA's fork."""
        if self.capture is not None:
            if event.capture is not self.capture:
                self.capture.refuse(905)
        elif event.capture is not None and event.capture.active:
            self.capture = event.capture
            event.capture.streams.append(self)


class Event:
    """``cupy.cuda.Event``."""

    def __init__(self, runtime, block=False, disable_timing=False, interprocess=False):
        self._runtime = runtime
        self.ptr = next(_pointers)
        self.capture = None

    def record(self, stream=None):
        stream = self._runtime.current_stream() if stream is None else stream
        if stream.capture is not None:
            stream.capture.check_open()
        self.capture = stream.capture

    def _refuse_captured(self):
        """A wait on an event recorded in a capture that is under way; the capture itself is
        left as it was (the event, not the stream, is what was asked)."""
        if self.capture is not None and self.capture.active:
            raise CUDARuntimeError(907)

    def synchronize(self):
        self._refuse_captured()
        self._runtime.synchronized()


class Graph:
    """``cupy.cuda.Graph``: ``launch`` runs the recorded work in order (recorded in turn when
    the stream it is launched on captures)."""

    def __init__(self, runtime, work):
        self._runtime = runtime
        self.work = work

    def launch(self, stream=None):
        runtime = self._runtime
        runtime.log.append(("launch", stream))
        runtime.count("graph_launches")
        stream = runtime.current_stream() if stream is None else stream
        if stream.capture is not None:
            stream.capture.check_open()
            stream.capture.work.extend(self.work)
            return
        for run in self.work:
            run()

    def debug_dot_str(self, flags=0):
        return f"digraph captured {{ // {len(self.work)} kernels, flags {flags}\n}}\n"


class Memory:
    """Device memory: a host buffer, its address ``ptr`` and ``size``."""

    def __init__(self, buffer, size, device_id):
        self.buffer, self.size, self.device_id = buffer, size, device_id
        self.ptr = buffer.ctypes.data if buffer.size else 0


class MemoryPointer:
    """``cupy.cuda.MemoryPointer``: ``mem`` and a byte ``offset`` into it."""

    def __init__(self, mem, offset=0):
        self.mem, self.offset = mem, offset
        self.ptr = mem.ptr + offset
        self.device_id = mem.device_id


def _aligned(nbytes):
    """``nbytes`` of zeroed host memory at an address that is a multiple of ``ROUND_SIZE``, as
    the device memory CuPy's pool hands out is (cudaMalloc's blocks are 256-byte aligned, the
    pool's chunks 512): an address's alignment is part of a cuBLASLt plan's key, so memory
    aligned as NumPy's allocator happens to leave it would make plans a GPU never makes."""
    raw = np.zeros(nbytes + ROUND_SIZE, np.uint8)
    start = -raw.ctypes.data % ROUND_SIZE
    return raw[start:start + nbytes]


class MemoryPool:
    """``cupy.cuda.MemoryPool`` (module docstring: reuse by rounded size, no splitting)."""

    def __init__(self, runtime):
        self._runtime = runtime
        self._free = collections.defaultdict(list)
        self._used = self._total = 0
        self._limit = 0

    def malloc(self, size):
        rounded = -(-int(size) // ROUND_SIZE) * ROUND_SIZE
        if rounded == 0:
            return MemoryPointer(Memory(np.zeros(0, np.uint8), 0, self._runtime.device))
        free = self._free[rounded]
        if free:
            buffer = free.pop()
        else:
            if self._limit and self._total + rounded > self._limit:
                raise MemoryError(f"Out of memory allocating {rounded:,} bytes (the pool's "
                                  f"limit is {self._limit:,} bytes)")
            buffer = _aligned(rounded)
            self._total += rounded
            self._runtime.count("new_memory", rounded)
        self._used += rounded
        memory = Memory(buffer, int(size), self._runtime.device)
        weakref.finalize(memory, self._release, buffer)
        return MemoryPointer(memory)

    def _release(self, buffer):
        self._used -= buffer.size
        self._free[buffer.size].append(buffer)

    def used_bytes(self):
        return self._used

    def free_all_blocks(self, stream=None):
        self._total = self._used
        self._free.clear()

    def set_limit(self, size=None, fraction=None):
        self._limit = int(size if fraction is None else fraction * DEVICE_MEMORY)

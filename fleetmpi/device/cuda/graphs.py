"""Paddle's ``paddle.device.cuda.graphs``: ``CUDAGraph`` records the device work queued between
``capture_begin()`` and ``capture_end()`` and ``replay()`` queues all of it again at once, through
CuPy's stream capture (``cupy.cuda.Stream.begin_capture`` / ``end_capture``, which return a
``cupy.cuda.Graph``).

    graph = CUDAGraph()
    graph.capture_begin()
    y = x * 2 + 1          # queued into the graph, not run
    graph.capture_end()
    graph.replay()         # runs it: y holds x * 2 + 1 for what x holds now

The capture runs on a stream of the graph's own (not the default stream, which cannot be
captured), on the current device, after the device has finished the work queued before it.
What the captured work allocates comes from a memory pool of the graph's own (a CuPy
``MemoryPool`` made the allocator of the whole process for the capture, so the communicator's
thread allocates from it too, and kept alive with the graph): an array freed during the
capture is memory the graph's replays still use, and in CuPy's default pool eager work would
be handed that memory and overwritten by the next replay. Graphs made with one ``pool_id``
share one pool, as in Paddle, and must then be replayed in the order they were captured.

Inside a capture, what a graph cannot hold is refused by ``fleetmpi.core.capture_checks`` with a
``CaptureError`` naming it; ``fleetmpi.graphed_step`` captures a whole training step.

One difference from Paddle: ``mode`` (the CUDA stream capture mode) defaults to
``"relaxed"``, where Paddle's is ``"thread_local"``. CuPy's pool grows with ``cudaMalloc``
while a graph captures, which the stricter modes forbid on the capturing thread; CuPy's own
``begin_capture`` defaults to relaxed for the same reason.
"""
import contextlib
import itertools
import os
import weakref

from ...core import backend, capture_checks

MODES = ("global", "thread_local", "relaxed")
_CUPY_MODES = {"global": "streamCaptureModeGlobal", "thread_local": "streamCaptureModeThreadLocal",
               "relaxed": "streamCaptureModeRelaxed"}
_dot_files = itertools.count()


def _cupy():
    return backend.array_module()


def is_cuda_graph_supported():
    """Whether CUDA graphs can be captured here: the arrays are CuPy's, on a CUDA device
    (not ROCm). Where not, ``fleetmpi.graphed_step`` runs on a host stand-in."""
    return backend.on_gpu() and not _cupy().cuda.runtime.is_hip


class _SharedPool:
    """The ``MemoryPool`` of the graphs of one ``pool_id`` (a holder a weak reference can
    point to), alive while one of them is."""

    def __init__(self, cupy):
        self.memory = cupy.cuda.MemoryPool()


_shared_pools = weakref.WeakValueDictionary()


def _pool_for(pool_id, cupy):
    if pool_id is None:
        return _SharedPool(cupy)
    pool = _shared_pools.get(pool_id)
    if pool is None:
        pool = _shared_pools[pool_id] = _SharedPool(cupy)
    return pool


@contextlib.contextmanager
def _allocating_from(pool, cupy):
    """Every CuPy allocation of the process comes from ``pool`` inside the block."""
    previous = cupy.cuda.get_allocator()
    try:
        cupy.cuda.set_allocator(pool.malloc)
    except ValueError:
        raise RuntimeError("a CUDA graph cannot capture inside cupy.cuda.using_allocator(): "
                           "its memory must come from the graph's own pool; capture outside "
                           "that block") from None
    try:
        yield
    finally:
        cupy.cuda.set_allocator(previous)


class CUDAGraph:
    """Paddle's ``CUDAGraph(place=None, mode="relaxed", pool_id=None)``: ``place`` is None or
    the id of the current device (one rank drives one device), ``mode`` one of ``MODES``,
    ``pool_id`` None (a pool of this graph's own) or any hashable id whose graphs share a pool.
    ``captured`` says whether it holds a graph to replay."""

    capture_runs_the_work = False

    def __init__(self, place=None, mode="relaxed", pool_id=None):
        if not is_cuda_graph_supported():
            raise RuntimeError("CUDAGraph needs CuPy and a CUDA device, and the arrays here are "
                               "NumPy's (is_cuda_graph_supported() is False); "
                               "fleetmpi.graphed_step runs a step on a host stand-in instead")
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} must be one of {', '.join(MODES)}")
        cupy = _cupy()
        device = cupy.cuda.Device().id
        if place is not None and place != device:
            raise ValueError(f"place={place!r}: this rank drives device {device}; pass None or "
                             f"{device}")
        self._device, self._mode, self._pool_id = device, mode, pool_id
        self._pool = self._graph = self._stream = self._open = None

    @property
    def captured(self):
        return self._graph is not None

    def __repr__(self):
        state = "captured" if self.captured else "capturing" if self._open else "empty"
        return f"CUDAGraph(device {self._device}, mode {self._mode!r}, {state})"

    def capture_begin(self):
        """Start capturing the work queued on the current device, on the graph's own stream
        (current until ``capture_end``), with memory from the graph's own pool."""
        if self._graph is not None:
            raise RuntimeError("this CUDAGraph holds a captured graph; reset() it before "
                               "capturing another")
        cupy = _cupy()
        stack = contextlib.ExitStack()
        with stack:
            stack.enter_context(capture_checks.capturing(self))
            stack.enter_context(cupy.cuda.Device(self._device))
            cupy.cuda.Device(self._device).synchronize()
            self._pool = self._pool or _pool_for(self._pool_id, cupy)
            stack.enter_context(_allocating_from(self._pool.memory, cupy))
            self._stream = self._stream or cupy.cuda.Stream(non_blocking=True)
            stack.enter_context(self._stream)
            self._stream.begin_capture(mode=getattr(cupy.cuda.runtime, _CUPY_MODES[self._mode]))
            self._open = stack.pop_all()

    def capture_end(self):
        """End the capture and keep the graph it made."""
        if self._open is None:
            raise RuntimeError("capture_end() without capture_begin()")
        stack, self._open = self._open, None
        with stack:
            self._graph = self._stream.end_capture()

    def capture(self, fn):
        """``fn()`` between ``capture_begin()`` and ``capture_end()``; returns what it returns.
        Where ``fn`` raises, the capture is ended, nothing is kept, and its error raised."""
        self.capture_begin()
        try:
            result = fn()
        except BaseException:
            stack, self._open = self._open, None
            with stack, contextlib.suppress(Exception):
                # A capture that CUDA invalidated has no graph to end; fn's error says why.
                self._stream.end_capture()
            raise
        self.capture_end()
        return result

    def replay(self):
        """Queue the captured work on the current stream."""
        if self._graph is None:
            raise RuntimeError("replay() needs a captured graph: capture_begin() and "
                               "capture_end() first (reset() drops the graph)")
        self._graph.launch(stream=_cupy().cuda.get_current_stream())

    def reset(self):
        """Drop the graph and this graph's hold on its memory pool."""
        if self._open is not None:
            raise RuntimeError("reset() while capturing: capture_end() first")
        self._graph = self._pool = None

    def print_to_dot_files(self, dirname, flags=None):
        """Write the captured graph in Graphviz's dot language into folder ``dirname``;
        ``flags``: CUDA's ``cudaGraphDebugDotFlags`` (None: all of them, as Paddle)."""
        if self._graph is None:
            raise RuntimeError("print_to_dot_files() needs a captured graph")
        if not isinstance(dirname, (str, bytes, os.PathLike)):
            dirname = dirname.name  # a tempfile.TemporaryDirectory, as Paddle takes
        os.makedirs(dirname, exist_ok=True)
        path = os.path.join(dirname, f"cuda_graph_{os.getpid()}_{next(_dot_files)}.dot")
        with open(path, "w") as f:
            f.write(self._graph.debug_dot_str(2047 if flags is None else flags))
        return path

"""A stand-in for the part of CuPy that ``fleetmpi.device.cuda.graphs`` uses: devices, streams
with ``begin_capture``/``end_capture``, graphs, memory pools and the process's allocator.

A "kernel" is a Python callable handed to ``launch``: it runs at once on a stream that is not
capturing, and is recorded by a capturing one; a ``Graph`` runs what its capture recorded each
time it is launched. So a test sees which work a ``CUDAGraph`` captured, when it ran, and on
which stream, with which allocator current. ``log`` lists the calls that matter, in order.
"""
import types


class StandInCuPy:
    """One stand-in CuPy module: ``cupy`` (what the graphs module reaches through ``.cuda``),
    ``launch(kernel)``, ``log`` and ``allocations`` (``(pool, nbytes)`` of each malloc)."""

    def __init__(self, device=0):
        self.log = []
        self.allocations = []
        self.device = device
        self.in_using_allocator = False
        self.allocator = "default allocator"
        self.null = Stream(self, null=True)
        self.streams = [self.null]
        runtime = types.SimpleNamespace(is_hip=False, streamCaptureModeGlobal=0,
                                        streamCaptureModeThreadLocal=1,
                                        streamCaptureModeRelaxed=2)
        cuda = types.SimpleNamespace(
            runtime=runtime, Device=lambda id=None: Device(self, id),
            Stream=lambda non_blocking=False: Stream(self, non_blocking=non_blocking),
            MemoryPool=lambda: MemoryPool(self), get_allocator=self.get_allocator,
            set_allocator=self.set_allocator, get_current_stream=self.current_stream)
        self.cupy = types.SimpleNamespace(cuda=cuda)

    def current_stream(self):
        return self.streams[-1]

    def launch(self, kernel):
        stream = self.current_stream()
        if stream.capture is not None:
            stream.capture.append(kernel)
        else:
            kernel()

    def get_allocator(self):
        return self.allocator

    def set_allocator(self, allocator):
        if self.in_using_allocator:
            raise ValueError("Can't change the global allocator inside `using_allocator` "
                             "context manager")
        self.log.append(("set_allocator", allocator))
        self.allocator = allocator

    def malloc(self, nbytes):
        """What CuPy's ``alloc`` does: ask the current allocator."""
        return self.allocator(nbytes)


class Device:
    def __init__(self, cupy, id):
        self._cupy = cupy
        self.id = cupy.device if id is None else id

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        self._cupy.log.append(("synchronize", self.id))


class Stream:
    def __init__(self, cupy, null=False, non_blocking=False):
        self._cupy = cupy
        self.null = null
        self.non_blocking = non_blocking
        self.capture = None
        self.mode = None

    def __enter__(self):
        self._cupy.streams.append(self)
        return self

    def __exit__(self, *exc):
        assert self._cupy.streams.pop() is self
        return False

    def begin_capture(self, mode=2):
        if self.null:
            raise RuntimeError("cannot capture on the default (legacy) stream")
        self._cupy.log.append(("begin_capture", self, mode, self._cupy.allocator))
        self.capture, self.mode = [], mode

    def end_capture(self):
        recorded, self.capture = self.capture, None
        self._cupy.log.append(("end_capture", self))
        return Graph(self._cupy, recorded)


class Graph:
    def __init__(self, cupy, work):
        self._cupy = cupy
        self.work = work

    def launch(self, stream=None):
        self._cupy.log.append(("launch", stream))
        for kernel in self.work:
            kernel()

    def debug_dot_str(self, flags=0):
        return f"digraph captured {{ // {len(self.work)} kernels, flags {flags}\n}}\n"


class MemoryPool:
    def __init__(self, cupy):
        self._cupy = cupy

    def malloc(self, nbytes):
        self._cupy.allocations.append((self, nbytes))
        return bytearray(nbytes)

"""Asynchronous collectives: a handle per operation, and the one background thread per
communicator that runs them, in the order they were started (Horovod's design).

Why a thread and not MPI's nonblocking collectives. The library's algorithms (ring,
hierarchical, shm) are sequences of blocking point-to-point steps written once against the
transport, so MPI's ``Iallreduce`` would only cover ``"native"``; and MPICH moves a nonblocking
collective forward only inside MPI calls (it has no progress thread unless asked), so a bucket
started during backward would wait for the next MPI call. ``benchmarks/overlap.py`` prints the
three side by side (blocking, this thread, ``Iallreduce`` polled at every layer).

Order. Operations run one after another in the order they were submitted, and a blocking
collective of the same communicator first waits until the thread is idle (``drain``), so every
rank issues the same collectives in the same order. The argument agreement and the stall
inspector (``fleetmpi.comm.agreement``, ``fleetmpi.comm.stall``) run on the thread as the
first step of each operation, as they do for a blocking call: a rank that never starts the
operation is reported by the ranks that did, after ``FLEETMPI_STALL_TIMEOUT``.

Errors. An exception of an operation (a mismatch, which the agreement raises on every rank,
or bad arguments) is raised by its handle's ``wait()``; the operations after it still run.

Threads and MPI. The thread calls MPI while the training thread may call MPI on other
communicators (a sub-communicator, sync batch norm, the timeline), so mpi4py initialises MPI
with ``MPI_THREAD_MULTIPLE`` (``fleetmpi/__init__.py``).
"""
import atexit
import queue
import threading


class Handle:
    """One asynchronous collective. ``wait()`` returns its result (or raises its error);
    ``test()`` says whether it has finished, without waiting.

    On a device transport the operation's transfers are queued on the transport's stream;
    ``wait()`` then makes the caller's current stream wait on the event recorded after them
    (``device_event``), so the update that follows is ordered on the device, not on the host.
    """

    __slots__ = ("collective", "_done", "_result", "_error", "device_event", "_thread")

    def __init__(self, collective, thread):
        self.collective = collective
        self._thread = thread
        self._done = threading.Event()
        self._result = None
        self._error = None
        self.device_event = None

    def test(self):
        """True once the operation has finished (its device work queued, on a device)."""
        return self._done.is_set()

    def wait(self):
        """Wait for the operation; return its result or raise its error."""
        if not self._done.is_set():
            self._thread.waiting += 1  # the stall watchdog's sign that a caller is blocked
            try:
                self._done.wait()
            finally:
                self._thread.waiting -= 1
        if self._error is not None:
            raise self._error
        if self.device_event is not None:
            import cupy

            cupy.cuda.get_current_stream().wait_event(self.device_event)
        return self._result

    def _finish(self, result=None, error=None):
        self._result, self._error = result, error
        self._done.set()


class CommThread:
    """The background thread of one communicator: runs submitted operations in order."""

    def __init__(self, name):
        self.name = name
        self._queue = queue.SimpleQueue()
        self._thread = None
        self.pending_count = 0  # submitted operations that have not finished
        self.waiting = 0  # callers blocked in a handle's wait()
        self._idle = threading.Condition()

    def on_thread(self):
        """Whether the caller is this thread (an operation it runs calls the blocking form)."""
        return self._thread is not None and threading.current_thread() is self._thread

    def blocks_caller(self):
        """Whether a blocking collective called now must first wait for the thread: it has
        operations pending, and the caller is not the thread itself."""
        return bool(self.pending_count) and not self.on_thread()

    def submit(self, collective, operation):
        """Run ``operation()`` on the thread after everything submitted before; returns its
        ``Handle``."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()
            atexit.register(self.stop)
        handle = Handle(collective, self)
        with self._idle:
            self.pending_count += 1
        self._queue.put((handle, operation))
        return handle

    def drain(self):
        """Wait until every submitted operation has finished."""
        with self._idle:
            self.waiting += 1
            while self.pending_count:
                self._idle.wait()
            self.waiting -= 1

    def stop(self):
        """Finish the submitted operations and end the thread (also at interpreter exit, before
        mpi4py finalises MPI: ``atexit`` runs the later registration first)."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join()
        self._thread = None
        atexit.unregister(self.stop)

    def _loop(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            handle, operation = item
            try:
                result, error = operation(handle), None
            except BaseException as exc:  # delivered by handle.wait(), on the caller's thread
                result, error = None, exc
            handle._finish(result, error)
            # Not kept until the next operation arrives: the result may be a large array that
            # its caller has already dropped (a prefetched unit of sharding stage 3).
            del item, handle, operation, result, error
            with self._idle:
                self.pending_count -= 1
                self._idle.notify_all()

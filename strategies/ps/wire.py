"""Messages between workers and servers: one MPI message of bytes each, on the PS communicator.

A message is a fixed header (kind, step, version, extra, learning rate, number of arrays), one
``(dtype, length)`` descriptor per array, then the arrays' bytes, each padded to 8 bytes.
Requests go to servers with ``TAG_REQUEST``, answers come back with ``TAG_REPLY``; a receiver
probes for the size first, so no side has to know the other's lengths in advance. Waiting
polls with a growing pause (up to a millisecond) rather than spinning, so servers and workers
sharing cores leave them to the ones computing, and every wait can end at a deadline.
"""
import enum
import time

import numpy as np

TAG_REQUEST = 71
TAG_REPLY = 72

_DTYPES = [np.dtype(name) for name in ("uint8", "int64", "float16", "float32", "float64")]
_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
_HEADER_INTS = 5  # kind, step, version, extra, number of arrays; then the float64 rate


class Kind(enum.IntEnum):
    PULL = 1        # worker -> server: send me your dense blocks (and check the model)
    PUSH = 2        # worker -> server: gradients or deltas of a step; answered with blocks
    PULL_ROWS = 3   # worker -> server: send me these rows of a sparse table
    STOP = 4        # worker -> server: stop_worker
    LEFT = 5        # worker -> server: this worker is exiting without stop_worker
    SAVE = 6        # worker -> server: save your shards into a directory; answered
    REPLY = 7       # server -> worker: the answer to a request
    ERROR = 8       # server -> worker: the server stopped; the text says why


class Message:
    """A decoded message: its header fields and its arrays (read-only views of the bytes)."""

    def __init__(self, kind, step=0, version=0, extra=0, lr=0.0, arrays=(), source=-1):
        self.kind = Kind(kind)
        self.step = step
        self.version = version
        self.extra = extra
        self.lr = lr
        self.arrays = list(arrays)
        self.source = source

    def text(self):
        """The first array read as UTF-8 text (file names, error messages)."""
        return bytes(self.arrays[0]).decode("utf-8")


def text_array(text):
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def _padded(nbytes):
    return (nbytes + 7) // 8 * 8


def encode(kind, arrays=(), step=0, version=0, extra=0, lr=0.0):
    """The bytes of one message (a uint8 array)."""
    arrays = [np.ascontiguousarray(a).reshape(-1) for a in arrays]
    for a in arrays:
        if a.dtype not in _CODES:
            raise TypeError(f"a parameter-server message cannot carry dtype {a.dtype}; "
                            f"allowed: {[str(d) for d in _DTYPES]}")
    head = np.array([int(kind), step, version, extra, len(arrays)], dtype=np.int64)
    descriptors = np.array([[_CODES[a.dtype], a.size] for a in arrays],
                           dtype=np.int64).reshape(-1)
    total = head.nbytes + 8 + descriptors.nbytes + sum(_padded(a.nbytes) for a in arrays)
    out = np.zeros(total, dtype=np.uint8)
    at = 0
    for part in (head, np.array([lr], dtype=np.float64), descriptors):
        out[at:at + part.nbytes] = part.view(np.uint8)
        at += part.nbytes
    for a in arrays:
        out[at:at + a.nbytes] = a.view(np.uint8)
        at += _padded(a.nbytes)
    return out


def decode(data, source=-1):
    """The ``Message`` in ``data`` (a uint8 array from ``encode``)."""
    head = data[:_HEADER_INTS * 8].view(np.int64)
    kind, step, version, extra, count = (int(v) for v in head)
    at = _HEADER_INTS * 8
    lr = float(data[at:at + 8].view(np.float64)[0])
    at += 8
    descriptors = data[at:at + 16 * count].view(np.int64).reshape(count, 2)
    at += 16 * count
    arrays = []
    for code, length in descriptors:
        dtype = _DTYPES[int(code)]
        nbytes = int(length) * dtype.itemsize
        arrays.append(data[at:at + nbytes].view(dtype))
        at += _padded(nbytes)
    return Message(kind, step, version, extra, lr, arrays, source)


def send(comm, message_bytes, dest, tag):
    """Start sending; the caller keeps the returned request (and so the bytes) until done."""
    from mpi4py import MPI

    return comm.Isend([message_bytes, MPI.BYTE], dest=dest, tag=tag)


class Poller:
    """Waits for a message with a pause that grows from nothing to a millisecond."""

    SPINS = 50
    LONGEST_PAUSE = 1e-3

    def __init__(self):
        self.polls = 0

    def pause(self):
        self.polls += 1
        if self.polls <= self.SPINS:
            time.sleep(0)
        else:
            time.sleep(min(self.LONGEST_PAUSE, 1e-5 * 2 ** min(self.polls - self.SPINS, 10)))


def probe(comm, source, tag):
    """``(source, size)`` of a waiting message, or None when there is none."""
    from mpi4py import MPI

    status = MPI.Status()
    if not comm.Iprobe(source=source, tag=tag, status=status):
        return None
    return status.Get_source(), status.Get_count(MPI.BYTE)


def receive_probed(comm, source, size, tag):
    from mpi4py import MPI

    data = np.empty(size, dtype=np.uint8)
    comm.Recv([data, MPI.BYTE], source=source, tag=tag)
    return decode(data, source)


def receive(comm, source, tag, deadline=None, on_poll=None):
    """The next message from ``source`` (``MPI.ANY_SOURCE`` for any) with ``tag``, or None
    when ``deadline`` (a ``time.monotonic()`` value) passes first. ``on_poll`` runs between
    polls (servers use it to notice timeouts)."""
    poller = Poller()
    while True:
        found = probe(comm, source, tag)
        if found is not None:
            return receive_probed(comm, found[0], found[1], tag)
        if deadline is not None and time.monotonic() > deadline:
            return None
        if on_poll is not None:
            on_poll()
        poller.pause()

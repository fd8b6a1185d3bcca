"""What a CUDA graph capture cannot hold, refused while one is under way.

A graph records the device work queued while it captures and replays only that work: the
Python that queued it does not run again. Whatever the host reads from the device inside the
captured region (a loss printed, a branch on a value, an inf/nan verdict) is read once, at
capture, and every replay keeps what that read decided; whatever moves data through the host
(MPI's transfers) is not recorded at all. So the trainer routes each place where it reads a
device value or waits for the device through ``check_host_read``, and each part of a step that
decides on the host from step to step declares why in a ``capture_refusal``; inside a capture
both raise ``CaptureError`` naming the part, instead of a graph that replays something else.

``current`` is the graph capturing now (a ``CUDAGraph``, or the host stand-in of
``fleetmpi.device.cuda.host_graph``), None outside a capture. It is one for the process, not
per thread: the communicator's thread works for the step being captured.
"""
import contextlib
import os
import sys

current = None

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The modules whose reads are routed here: the place worth naming is the code that called them.
_READERS = frozenset(os.path.join(_PACKAGE, *name) for name in (
    ("core", "capture_checks.py"), ("core", "backend.py"), ("autograd", "tensor.py")))


class CaptureError(RuntimeError):
    """Something that a CUDA graph cannot capture ran inside a capture."""


def _caller():
    """`` (at path:line in function)`` of the code that made the refused call, or ``""``."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if os.path.abspath(code.co_filename) not in _READERS:
            return f" (at {code.co_filename}:{frame.f_lineno} in {code.co_name})"
        frame = frame.f_back
    return ""


def refuse(what, why, where=""):
    """Inside a capture, raise ``CaptureError``: ``what`` (run at ``where``) cannot be
    captured, because ``why``."""
    if current is not None:
        raise CaptureError(f"{what} cannot run inside a CUDA graph capture{where}: {why}")


def check_host_read(what):
    """Inside a capture, raise ``CaptureError`` for ``what``, a read of a device value on the
    host or a wait for the device."""
    if current is not None:
        refuse(what, "it waits on the host for the device, and a graph replays device work "
                     "only, so the read (and any Python decision on its result) would keep "
                     "what it saw at capture. Read values after the graphed step returns (its "
                     "loss is a static output), or keep the decision on the device", _caller())


@contextlib.contextmanager
def capturing(graph):
    """Mark ``graph`` as capturing for the block; captures do not nest."""
    global current
    if current is not None:
        raise CaptureError(f"a CUDA graph capture is already under way ({current!r}); "
                           "captures do not nest: end it with capture_end() first")
    current = graph
    try:
        yield
    finally:
        current = None

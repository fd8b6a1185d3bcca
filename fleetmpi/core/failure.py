"""No hangs on failure: an unhandled exception on one rank ends the whole job.

Without this, a rank that dies of an exception leaves the others blocked in their next
collective until someone kills the job by hand. ``install`` (called by ``fleet.init``) sets
``sys.excepthook`` and ``threading.excepthook`` so that an exception nobody caught, in the main
thread or any other thread, writes ``rank r/N on node k failed:`` and the traceback to stderr,
flushes, and calls ``MPI.COMM_WORLD.Abort(1)``: the MPI launcher then ends every rank and exits
non-zero, whichever launcher started the job.

A hook is installed only where Python's default (or ``fleetmpi.core.extras``'s) is still in
place, so handlers someone else installed (pytest, which reports thread exceptions itself,
IPython, the application) keep working. ``FLEETMPI_ABORT_ON_ERROR=0`` installs nothing. A
missing optional package (``extras.MissingExtra``) is the exception to aborting: it is written
in one line by the first rank of each node, and each rank ends its script.

A rank whose failure the others can train through (an asynchronous or GEO parameter-server
worker) registers ``leave_instead(notify)``: an exception in its main thread then writes the
same report, calls ``notify(report)`` (which tells the servers) and ends only this process,
with status 1, after finalizing MPI normally. The launcher does not end the other ranks for
that; the job's status is still non-zero at its end.
"""
import os
import sys
import threading
import time
import traceback

from . import extras
from .knobs import ABORT_ON_ERROR

# Seconds between writing a report and aborting: Hydra's proxy forwards a rank's output
# asynchronously, and an abort that comes first can lose the report (seen in about 1 job of 40).
REPORT_LINGER = 0.2


def abort_on_error_enabled(environ=os.environ):
    """The value of ``FLEETMPI_ABORT_ON_ERROR`` (``1``, the default, or ``0``)."""
    return ABORT_ON_ERROR.value(environ)


def abort(message, code=1, linger=0.0):
    """Write ``message`` (unless None: written before) to stderr, flush both streams, wait
    ``linger`` seconds (for other ranks to write their own reports), and end the whole MPI
    job."""
    try:
        sys.stdout.flush()
    except Exception:  # a closed or broken stream must not stop the abort
        pass
    try:
        if message is not None:
            sys.stderr.write(message if message.endswith("\n") else message + "\n")
        sys.stderr.flush()
    except Exception:
        pass
    if linger > 0:
        time.sleep(linger)
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(code)
    os._exit(code)  # MPICH's Abort can return while the launcher takes the job down


_leave = None


def leave_instead(notify):
    """From now on an uncaught exception in the main thread ends this rank alone, after
    ``notify(report)``; None restores aborting the job."""
    global _leave
    _leave = notify


def leaves_alone():
    """Whether an uncaught exception ends this rank alone (``leave_instead``)."""
    return _leave is not None


def _report(place, exc_type, exc_value, exc_tb, thread_name=None):
    where = "" if thread_name is None else f" (in thread {thread_name})"
    text = "".join(traceback.format_exception(exc_type, exc_value, exc_tb))
    return f"[fleetmpi] {place} failed{where}:\n{text}"


def install(rank, size, node):
    """Make an uncaught exception abort the job, naming this rank; see the module docstring.

    Returns the names of the hooks installed (``"sys"``, ``"threading"``).
    """
    if not abort_on_error_enabled():
        return []
    place = f"rank {rank}/{size} on node {node}"
    installed = []

    if sys.excepthook in (sys.__excepthook__, extras.excepthook):
        def excepthook(exc_type, exc_value, exc_tb):
            if isinstance(exc_value, extras.MissingExtra):
                extras.report(exc_value)  # every rank lacks it alike: each ends its script
                return
            report = _report(place, exc_type, exc_value, exc_tb)
            if _leave is None:
                abort(report, linger=REPORT_LINGER)
            sys.stderr.write(report)
            sys.stderr.flush()
            _leave(report)  # then Python exits with status 1, finalizing MPI on the way

        sys.excepthook = excepthook
        installed.append("sys")

    if threading.excepthook is threading.__excepthook__:
        def thread_excepthook(args):
            if args.exc_type is SystemExit:
                return
            name = None if args.thread is None else args.thread.name
            abort(_report(place, args.exc_type, args.exc_value, args.exc_traceback, name),
                  linger=REPORT_LINGER)

        threading.excepthook = thread_excepthook
        installed.append("threading")
    return installed

"""A missing optional package, said in one line that names the ``pip install`` bringing it.

``MissingExtra`` is the ImportError a feature raises when a package of one of setup.cfg's
extras is not installed (scikit-learn for the digits, matplotlib for the planner's PNG, the
MPI library itself). Where nobody catches it, the script ends with status 1 and that line
alone, ``... needs ...: pip install 'fleetmpi[extra]'``, without the traceback: ``install``
(at ``import fleetmpi``) sets ``sys.excepthook`` where Python's own is still in place, and
``fleetmpi.core.failure``'s hook (from ``fleet.init``) does the same. Every rank of a node
shares its packages, so only the first rank of each node writes the line, and every rank ends
its script without aborting the job (a rank that ends while others wait is reported as such,
docs/reliability.md). pytest, IPython and handlers of the application keep their own reports.

Imports nothing of fleetmpi but the launcher's variables: it runs where importing fleetmpi
failed (no MPI library).
"""
import sys

from .launcher_env import LOCAL_RANKS, launcher_number


class MissingExtra(ImportError):
    """``what`` needs ``package``, which ``pip install 'fleetmpi[extra]'`` brings; ``also``
    (optional) ends the message with another way."""

    def __init__(self, what, package, extra, also=""):
        self.extra = extra
        super().__init__(f"{what} needs {package}: pip install 'fleetmpi[{extra}]'{also}")


def report(error, stream=None):
    """Write ``error``'s one line, on the first rank of this node only."""
    if launcher_number(LOCAL_RANKS, 0) != 0:
        return
    stream = sys.stderr if stream is None else stream
    stream.write(f"{error}\n")
    stream.flush()


def excepthook(exc_type, exc_value, exc_tb):
    """``MissingExtra`` in one line; anything else as Python reports it."""
    if isinstance(exc_value, MissingExtra):
        report(exc_value)
        return
    sys.__excepthook__(exc_type, exc_value, exc_tb)


def install():
    """Report an uncaught ``MissingExtra`` in one line, where no one else has set the hook."""
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = excepthook

"""The ``fleetmpi`` logger: every line names the rank (and node) it comes from.

``FLEETMPI_LOG_LEVEL`` (DEBUG, INFO, WARNING, ...) sets the level; the default is WARNING.
"""
import logging
import sys
import time

from .knobs import LOG_LEVEL


logger = logging.getLogger("fleetmpi")


class _RankFilter(logging.Filter):
    """Stamps each record with the rank, world size and node of this process."""

    def __init__(self, rank, size, node):
        super().__init__()
        self.place = f"rank {rank}/{size} node {node}"

    def filter(self, record):
        record.place = self.place
        return True


def configure(rank, size, node):
    """Attach a stderr handler whose lines carry this process's place in the job."""
    level = logging.getLevelName(LOG_LEVEL.value())
    for handler in list(logger.handlers):
        if getattr(handler, "fleetmpi_rank_handler", False):
            logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.fleetmpi_rank_handler = True
    handler.addFilter(_RankFilter(rank, size, node))
    handler.setFormatter(logging.Formatter("[fleetmpi %(place)s] %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


class RateLimited:
    """Writes a warning per occurrence of something that may repeat every step, at most one
    line per ``seconds``: an occurrence inside that time is counted, and the next line written
    says how many were not. ``clock``: seconds, ``time.monotonic`` by default."""

    def __init__(self, seconds, clock=time.monotonic):
        self.seconds = seconds
        self.clock = clock
        self._last = None
        self._held = 0

    def warning(self, message, *args):
        now = self.clock()
        if self._last is not None and now - self._last < self.seconds:
            self._held += 1
            return
        if self._held:
            message += f" ({self._held} more since the last such line, not written)"
        self._last, self._held = now, 0
        logger.warning(message, *args)

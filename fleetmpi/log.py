"""The ``fleetmpi`` logger: every line names the rank (and node) it comes from.

``FLEETMPI_LOG_LEVEL`` (DEBUG, INFO, WARNING, ...) sets the level; the default is WARNING.
"""
import logging
import os
import sys

LOG_LEVEL_ENV = "FLEETMPI_LOG_LEVEL"

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
    level_name = os.environ.get(LOG_LEVEL_ENV, "WARNING").upper()
    level = logging.getLevelName(level_name)
    if not isinstance(level, int):
        raise ValueError(f"{LOG_LEVEL_ENV}={level_name!r} is not a logging level; "
                         "use DEBUG, INFO, WARNING, ERROR or CRITICAL")
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

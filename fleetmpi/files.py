"""Files fleetmpi writes where others can predict the name (timeline parts and traces,
parameter-server shards): never through a symbolic link planted at that name.

``open_for_writing`` refuses a path that is a symbolic link (``O_NOFOLLOW``);
``temporary_beside`` creates a new file exclusively under a random name in the same folder,
to be renamed over the final name, which replaces a link instead of writing through it.
``launch/rank_main.py`` opens the rank logs the same way, written out there because it imports
nothing of fleetmpi.
"""
import os
import tempfile


def open_for_writing(path, binary=False):
    """``path`` for writing, truncated (created with mode 0o644 when missing); an OSError
    naming it when it is a symbolic link."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    except OSError as error:
        link = " (it is a symbolic link)" if os.path.islink(path) else ""
        raise OSError(error.errno, f"cannot write {path}: {error.strerror}{link}") from None
    return os.fdopen(fd, "wb" if binary else "w")


def temporary_beside(path, binary=False):
    """``(file, name)``: a new file beside ``path``, created exclusively under a random name
    (``.<basename>.<random>.part``), for writing before it is renamed to ``path``."""
    fd, name = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                                prefix=f".{os.path.basename(path)}.", suffix=".part")
    return os.fdopen(fd, "wb" if binary else "w"), name

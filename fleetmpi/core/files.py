"""Files fleetmpi writes where others can predict the name (timeline parts and traces,
parameter-server shards): never through a symbolic link planted at that name.

``open_for_writing`` refuses a path that is a symbolic link (``O_NOFOLLOW``);
``temporary_beside`` creates a new file exclusively under a random name in the same folder,
to be renamed over the final name, which replaces a link instead of writing through it;
``write_atomically`` does the whole of that for a file written in one go (checkpoints,
parameter-server shards), so a crash leaves the old file or the new one, never a part.
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


def temporary_beside(path, binary=False, prefix=None):
    """``(file, name)``: a new file beside ``path``, created exclusively under a random name
    (``<prefix><random>.part``, the prefix ``.<basename>.`` by default), for writing before it
    is renamed to ``path``."""
    fd, name = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                                prefix=prefix or f".{os.path.basename(path)}.", suffix=".part")
    return os.fdopen(fd, "wb" if binary else "w"), name


def write_atomically(path, write, prefix=None):
    """``write(binary file object)`` into a temporary beside ``path`` (``temporary_beside``'s
    ``prefix``: a caller that names its temporaries can find those a killed process left),
    flushed to disk, then renamed over ``path``; on an error the temporary is removed, and an
    OSError without a file name (a full disk, a quota) is raised again naming ``path``."""
    f, temporary = temporary_beside(path, binary=True, prefix=prefix)
    try:
        with f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        if os.path.exists(temporary):
            os.remove(temporary)
        if isinstance(error, OSError) and error.filename is None and error.errno:
            raise OSError(error.errno, f"cannot write {path}: {error.strerror or error}") \
                from None
        raise

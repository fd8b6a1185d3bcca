"""Reading the ``.npz`` archives fleetmpi writes (checkpoints, parameter-server shards) with
memory bounded by the file's own bytes.

``np.load`` inflates a compressed member to whatever its array header declares, so a 1 MB file
of deflated zeros becomes a gigabyte array. fleetmpi writes its archives uncompressed
(``np.savez``, ``zipfile.ZIP_STORED``), where a member's array is the member's bytes after its
header; ``load_npz`` refuses, before any array is read, a member stored compressed and one whose
header declares other than the bytes it holds.
"""
import math
import zipfile

import numpy as np


def _header(entry):
    """``(shape, dtype)`` of the ``.npy`` header at the start of ``entry``."""
    version = np.lib.format.read_magic(entry)
    read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
            else np.lib.format.read_array_header_2_0)
    shape, _, dtype = read(entry)
    return shape, dtype


def _check_member(path, archive, info):
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"{path}: its member {info.filename} is compressed; fleetmpi writes "
                         "its archives uncompressed, and a compressed member may declare far "
                         "more memory than the file holds, so the file is not read")
    with archive.open(info) as entry:
        shape, dtype = _header(entry)
        held = info.file_size - entry.tell()
    declared = math.prod(shape) * dtype.itemsize
    if declared != held:
        raise ValueError(f"{path}: its member {info.filename} declares an array of shape "
                         f"{shape} and dtype {dtype} ({declared} bytes), but holds {held} bytes "
                         "after its header; the file is damaged or was not written by fleetmpi")


def check_npz(path):
    """Raise a ValueError naming ``path`` and the member where reading the archive could take
    more memory than its bytes (module docstring)."""
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            _check_member(path, archive, info)


def load_npz(path):
    """``np.load(path, allow_pickle=False)`` of an archive ``check_npz`` passed."""
    check_npz(path)
    return np.load(path, allow_pickle=False)

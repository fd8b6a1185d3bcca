"""The same model on every rank, checked before ``distributed_model`` broadcasts rank 0's values.

A model built differently on some rank (another width, a layer more, a dtype) used to surface as
``broadcast_many called with different arguments: count differs (rank 0: 195, rank 1: 387)``
deep in a traceback on every rank, naming no parameter. ``check_same_model`` compares each
rank's list of parameters and buffers (name, shape, dtype) through one small allgather; where
they differ, two more find the first entry that differs and each rank's description of it, so
that every rank raises one error with one line per rank.
"""
import hashlib

import numpy as np

from ..core import backend

# The bytes of a rank's description of one entry in the second exchange.
DESCRIPTION_BYTES = 160


class ModelMismatchError(ValueError):
    """The ranks built models that differ in their parameters or buffers."""


def _entries(model):
    named = list(model.named_parameters()) + [(f"{name} (buffer)", buffer)
                                               for name, buffer in model.named_buffers()]
    return [f"{name} of shape {tuple(value.shape)} {np.dtype(value.dtype).name}"
            for name, value in named]


def _digest(text):
    return np.frombuffer(hashlib.blake2b(text.encode(), digest_size=8).digest(), np.int64)[0]


def _gathered(comm, row):
    """Every rank's int64 or uint8 ``row`` (one length on every rank), stacked in rank order."""
    return backend.to_numpy(comm.allgather(backend.asarray(row), stack=True))


def _encoded(text):
    data = text.encode()[:DESCRIPTION_BYTES]
    row = np.zeros(DESCRIPTION_BYTES, dtype=np.uint8)
    row[:len(data)] = np.frombuffer(data, dtype=np.uint8)
    return row


def check_same_model(model, comm):
    """Raise ``ModelMismatchError`` on every rank of ``comm`` (a ``fleetmpi.comm.Communicator``)
    when the ranks' models differ; collective over ``comm``."""
    entries = _entries(model)
    digests = np.array([_digest(entry) for entry in entries], dtype=np.int64)
    summary = np.array([len(entries), _digest("\n".join(entries))], dtype=np.int64)
    every = _gathered(comm, summary)
    if (every == every[0]).all():
        return
    longest = int(every[:, 0].max())
    padded = np.full(longest, -1, dtype=np.int64)
    padded[:len(digests)] = digests
    columns = _gathered(comm, padded)
    first = int(np.flatnonzero((columns != columns[0]).any(axis=0))[0])
    mine = entries[first] if first < len(entries) else f"nothing: it has {len(entries)} entries"
    said = [bytes(row).rstrip(b"\0").decode(errors="replace")
            for row in _gathered(comm, _encoded(mine))]
    raise ModelMismatchError(
        f"distributed_model: the ranks built different models; their parameters and buffers "
        f"first differ at entry {first}:\n"
        + "\n".join(f"  rank {rank}: {text}" for rank, text in enumerate(said))
        + "\nEvery rank must build the same model (the same layers, sizes and dtypes in the "
        "same order) before its values are made equal")

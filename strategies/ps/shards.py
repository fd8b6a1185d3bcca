"""A server's shard on disk: one ``.npz`` file per server, written atomically, read without
pickle.

``server-<s>-of-<S>.npz`` holds the server's dense blocks (``block.<i>``), its optimizer state
(``optimizer.<name>``), its rows of every sparse table (``table.<t>``) with their optimizer
state (``table.<t>.<name>``), and ``meta``: JSON text with the server's place, the model's
signature, the mode, the update count and the optimizer's step count. The file is written next
to its final name and renamed over it, so a reader sees the old shard or the new one, never a
half-written file.
"""
import json
import os

import numpy as np

from fleetmpi.core import archives, files


def shard_path(dirname, server, server_num):
    return os.path.join(dirname, f"server-{server}-of-{server_num}.npz")


def save_shard(dirname, server, server_num, arrays, meta):
    """Write ``arrays`` (name -> array) and ``meta`` (a JSON-able dict); returns the path."""
    os.makedirs(dirname, exist_ok=True)
    path = shard_path(dirname, server, server_num)
    payload = dict(arrays)
    payload["meta"] = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
    files.write_atomically(path, lambda f: np.savez(f, **payload))
    return path


def load_shard(dirname, server, server_num):
    """``(arrays, meta)`` of the shard this server saved into ``dirname``."""
    path = shard_path(dirname, server, server_num)
    if not os.path.exists(path):
        present = sorted(n for n in os.listdir(dirname)) if os.path.isdir(dirname) else []
        raise FileNotFoundError(f"no shard {path} for server {server} of {server_num}; the "
                                f"directory holds {present}; a job restarts from its shards "
                                "with the same number of servers")
    with archives.load_npz(path) as archive:
        arrays = {name: archive[name] for name in archive.files}
    meta = json.loads(bytes(arrays.pop("meta")).decode("utf-8"))
    return arrays, meta

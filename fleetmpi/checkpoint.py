"""Checkpoints: model, optimizer, step counter and the rank's random state, one file per rank
plus a JSON manifest, without pickle.

Each rank writes ``step-<step>-rank-<rank>.npz`` (``np.savez``; read back with
``allow_pickle=False``), then rank 0 writes ``manifest.json`` naming every file and its SHA-256.
Every file goes to a temporary name first and is renamed into place, and the manifest is written
last, so a crash leaves either the previous checkpoint or the new one, never a mix. Loading checks
the world size and the digest before touching the model.
"""
import hashlib
import json
import os
import tempfile

import numpy as np

from . import backend

FORMAT = "fleetmpi-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
_META = "meta"
_MODEL = "model/"
_OPTIMIZER = "optimizer/"


def _world():
    from . import world

    try:
        topology = world.topology()
    except RuntimeError:
        return None, 0, 1
    return topology.world, topology.rank, topology.size


def _rank_file(step, rank):
    return f"step-{step}-rank-{rank}.npz"


def _write_atomically(path, write):
    """``write(file object)`` into a temporary file beside ``path``, then rename it there."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def _digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.digest()


def _gather_digests(comm, digest, size):
    if comm is None:
        return [digest]
    from mpi4py import MPI

    mine = np.frombuffer(digest, dtype=np.uint8)
    every = np.empty((size, mine.size), dtype=np.uint8)
    comm.Allgather([mine, MPI.BYTE], [every, MPI.BYTE])
    return [bytes(row) for row in every]


def save(directory, model, optimizer, step, extra=None):
    """Write this rank's checkpoint of ``model``, ``optimizer`` (or None) and ``step`` into
    ``directory`` (created if missing); every rank must call it. ``extra`` is JSON-able data
    stored per rank and handed back by ``load``."""
    if not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative integer, not {step!r}")
    step = int(step)
    comm, rank, size = _world()
    os.makedirs(directory, exist_ok=True)
    arrays = {_MODEL + name: value for name, value in model.state_dict().items()}
    scalars = {}
    if optimizer is not None:
        for key, value in optimizer.state_dict().items():
            if isinstance(value, np.ndarray):
                arrays[_OPTIMIZER + key] = value
            else:
                scalars[key] = value
    meta = {"step": step, "rank": rank, "world_size": size, "optimizer": scalars,
            "rng_state": backend.rng_state(), "extra": extra}
    arrays[_META] = np.array(json.dumps(meta))
    path = os.path.join(directory, _rank_file(step, rank))
    _write_atomically(path, lambda f: np.savez(f, **arrays))
    digests = _gather_digests(comm, _digest(path), size)
    if rank == 0:
        manifest = {"format": FORMAT, "version": VERSION, "step": step, "world_size": size,
                    "files": [{"rank": r, "file": _rank_file(step, r), "sha256": d.hex()}
                              for r, d in enumerate(digests)]}
        _write_atomically(os.path.join(directory, MANIFEST),
                          lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    if comm is not None:
        comm.Barrier()
    _remove_older(directory, step, rank)
    return path


def _remove_older(directory, step, rank):
    suffix = f"-rank-{rank}.npz"
    for name in os.listdir(directory):
        if name.startswith("step-") and name.endswith(suffix) and name != _rank_file(step, rank):
            os.remove(os.path.join(directory, name))


def read_manifest(directory):
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint in {directory!r}: {MANIFEST} is missing")
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(f"{path} is not a {FORMAT} version {VERSION} manifest")
    return manifest


def load(directory, model, optimizer=None):
    """Restore this rank's model, optimizer and random state from ``directory``; returns
    ``{"step": int, "extra": ...}``. The checkpoint must come from a job of the same size."""
    _, rank, size = _world()
    manifest = read_manifest(directory)
    if manifest["world_size"] != size:
        raise ValueError(f"checkpoint in {directory!r} was written by {manifest['world_size']} "
                         f"rank(s); this job has {size}")
    entry = manifest["files"][rank]
    path = os.path.join(directory, entry["file"])
    if _digest(path).hex() != entry["sha256"]:
        raise ValueError(f"{path} does not match the SHA-256 in the manifest; the checkpoint "
                         "is damaged or incomplete")
    with np.load(path, allow_pickle=False) as stored:
        meta = json.loads(str(stored[_META]))
        model.set_state_dict({k[len(_MODEL):]: stored[k] for k in stored.files
                              if k.startswith(_MODEL)})
        if optimizer is not None:
            state = dict(meta["optimizer"])
            state.update({k[len(_OPTIMIZER):]: stored[k] for k in stored.files
                          if k.startswith(_OPTIMIZER)})
            optimizer.set_state_dict(state)
    backend.set_rng_state(meta["rng_state"])
    return {"step": meta["step"], "extra": meta["extra"]}

"""Checkpoints: model, optimizer, step counter and the rank's random state, one file per rank
plus a JSON manifest, without pickle.

Each rank writes ``step-<step>-rank-<rank>.npz`` (``np.savez``; read back with
``allow_pickle=False``), then rank 0 writes ``manifest.json`` naming every file and its SHA-256.
Every file goes to a temporary name first and is renamed into place, and the manifest is written
last, so a crash leaves either the previous checkpoint or the new one, never a mix. Loading checks
the world size and the digest before touching the model.

Re-sharding: the optimizer state of a ``sharding`` run is saved as each rank's shard with its
range of the parameter space. Loading joins, for the range the loading optimizer updates, the
shards of the files that hold it, so such a checkpoint loads into a job of any size, sharded
or not.
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


def _verified(directory, entry):
    """The path of a manifest ``entry``'s file, after checking its digest."""
    path = os.path.join(directory, entry["file"])
    if _digest(path).hex() != entry["sha256"]:
        raise ValueError(f"{path} does not match the SHA-256 in the manifest; the checkpoint "
                         "is damaged or incomplete")
    return path


def _meta(stored):
    return json.loads(str(stored[_META]))


def _join_shards(directory, manifest, state, own):
    """``state`` (one rank's optimizer state of a sharded run) with its ``<name>.shard``
    arrays replaced by those of range ``own`` of the parameter space, joined from the files
    whose shards overlap it."""
    start, stop = own
    total = int(state["shard"][2])
    if stop > total:
        raise ValueError(f"the optimizer state in {directory!r} was saved for a parameter "
                         f"space of {total} elements; this optimizer updates [{start}, {stop})")
    keys = [k for k in state if k.endswith(".shard")]
    joined = {k: np.empty(stop - start, dtype=state[k].dtype) for k in keys}
    covered = np.zeros(stop - start, dtype=bool)
    for entry in manifest["files"]:
        path = os.path.join(directory, entry["file"])
        with np.load(path, allow_pickle=False) as stored:
            a, b, _ = _meta(stored)["optimizer"]["shard"]
        lo, hi = max(a, start), min(b, stop)
        if lo >= hi or covered[lo - start:hi - start].all():
            continue
        with np.load(_verified(directory, entry), allow_pickle=False) as stored:
            for k in keys:
                joined[k][lo - start:hi - start] = stored[_OPTIMIZER + k][lo - a:hi - a]
        covered[lo - start:hi - start] = True
    if not covered.all():
        missing = int(np.flatnonzero(~covered)[0]) + start
        raise ValueError(f"the shards in {directory!r} do not cover element {missing} of the "
                         "parameter space; the checkpoint is incomplete")
    state.update(joined)
    state["shard"] = [start, stop, total]
    return state


def load(directory, model, optimizer=None):
    """Restore this rank's model, optimizer and random state from ``directory``; returns
    ``{"step": int, "extra": ...}``.

    The checkpoint must come from a job of the same size, unless its optimizer state is
    sharded: then the optimizer's state for the range it updates is joined from the shards of
    every file that holds part of it, and in a job of another size rank ``r`` takes the model,
    random state and extra of the saved rank ``r % saved size`` (data parallelism keeps the
    parameters equal on every rank)."""
    _, rank, size = _world()
    manifest = read_manifest(directory)
    saved = manifest["world_size"]
    entry = manifest["files"][rank % saved]
    with np.load(_verified(directory, entry), allow_pickle=False) as stored:
        meta = _meta(stored)
        sharded = optimizer is not None and "shard" in meta["optimizer"]
        if saved != size and not sharded:
            raise ValueError(f"checkpoint in {directory!r} was written by {saved} rank(s); "
                             f"this job has {size} (only the optimizer state of a sharding "
                             "run is re-sharded to another number of ranks)")
        model_state = {k[len(_MODEL):]: stored[k] for k in stored.files if k.startswith(_MODEL)}
        state = dict(meta["optimizer"])
        state.update({k[len(_OPTIMIZER):]: stored[k] for k in stored.files
                      if k.startswith(_OPTIMIZER)})
    if sharded:
        state = _join_shards(directory, manifest, state, optimizer.shard_range)
    model.set_state_dict(model_state)
    if optimizer is not None:
        optimizer.set_state_dict(state)
    backend.set_rng_state(meta["rng_state"])
    return {"step": meta["step"], "extra": meta["extra"]}

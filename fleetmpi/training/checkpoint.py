"""Checkpoints: model, optimizer, step counter and the rank's random state, one file per rank
plus a JSON manifest, without pickle.

Each rank writes ``step-<step>-rank-<rank>-<save>.npz`` (``np.savez``; read back with
``allow_pickle=False``), where ``<save>`` is a token rank 0 draws for this save and every rank
shares, so that no save ever overwrites a file the current manifest names (saving the same
step again included). Then rank 0 writes ``manifest.json`` naming every file and its SHA-256.
Every file goes to a temporary name first (``.tmp-rank<r>-*.part``, created exclusively, never
through a symlink) and is renamed into place; the manifest is renamed last, and only after
every rank has seen the new manifest does each rank remove its older files and the temporaries
an earlier, crashed save of its own left behind. A crash at any point therefore leaves the
previous checkpoint or the new one loadable, never a mix and never neither. One job at a time
saves into a folder (``fleetmpi.training.checkpoint_lock``): a second job's save is refused on
every rank, naming the job that holds it.

Loading checks the manifest (whose files must be plain names inside the folder, and not
symbolic links pointing out of it), the world size and the digest, reads everything, and only
then applies it; if applying fails midway (a shape the model or optimizer refuses, a bad random
state), the model, the optimizer and the random state are put back as they were. In a job of
several ranks the ranks then agree, so that all load or none does
(``fleetmpi.training.checkpoint_agreement``).

Re-sharding: the optimizer state of a ``sharding`` run is saved as each rank's shard with its
range of the parameter space. Loading joins, for the range the loading optimizer updates, the
shards of the files that hold it, so such a checkpoint loads into a job of any size, sharded
or not.

Sharding stage 3 (a model built under ``LazyGuard`` too): a rank never holds the whole model.
Saving gathers and writes one parameter at a time (the gathers are collectives, in the same
order on every rank), and loading reads one parameter at a time from the file and keeps this
rank's shard of it (``Parameter.assign``); what is put back if loading fails is a copy of the
shard, not the model's values.
"""
import hashlib
import json
import os
import re
import zipfile
from collections.abc import Mapping

import numpy as np

from ..core import archives, backend, files
from . import checkpoint_lock

FORMAT = "fleetmpi-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
_META = "meta"
MODEL_PREFIX = "model/"
_OPTIMIZER = "optimizer/"
_RNG_DEVICE = "rng/device_state"


def _world():
    from ..core import job

    if not job.joined():
        return None, 0, 1
    topology = job.topology()
    return topology.world, topology.rank, topology.size


_RANK_FILE = re.compile(r"step-\d+-rank-(\d+)(-[0-9a-f]+)?\.npz")


def _rank_file(step, rank, save):
    return f"step-{step}-rank-{rank}-{save}.npz"


def _temporary_prefix(owner):
    return f".tmp-{owner}-"


def _digest(path):
    """The file's SHA-256, read through one reused buffer of 1 MiB."""
    h = hashlib.sha256()
    block = memoryview(bytearray(1 << 20))
    with open(path, "rb") as f:
        while count := f.readinto(block):
            h.update(block[:count])
    return h.digest()


def _exchange(comm, row):
    """Every rank's int64 ``row``, stacked in rank order, through the stall inspector: a rank
    that never reaches ``save`` is named after ``FLEETMPI_STALL_TIMEOUT`` instead of hanging
    the others."""
    from fleetmpi.comm.stall import gather_rows

    return gather_rows(comm, np.asarray(row, dtype=np.int64), "checkpoint.save")


def _hex(token):
    return token.tobytes()[:4].hex()


def _save_token(comm, rank, size, directory):
    """Eight hex digits that name this save, drawn by rank 0 and the same on every rank, once
    rank 0 holds the folder's lock (``checkpoint_lock``; every rank raises naming the job that
    holds it otherwise). In a job of several ranks rank 0 first leaves a marker of that name in
    ``directory``, which ``_check_shared`` then looks for."""
    token = np.frombuffer(os.urandom(8), dtype=np.int64)
    held = rank != 0 or checkpoint_lock.hold(directory, size)
    if comm is not None:
        if rank == 0 and held:
            files.open_for_writing(_marker(directory, _hex(token))).close()
        token, held = _exchange(comm, [token[0], int(held)])[0]
    if not held:
        raise checkpoint_lock.held_elsewhere_error(directory)
    return _hex(np.int64(token))


def _marker(directory, save):
    return os.path.join(directory, f".shared-{save}")


def _check_shared(comm, rank, directory, save):
    """Refuse, on every rank, a ``directory`` that is not the same folder on every rank (a
    node-local path on several nodes, say): the ranks that do not see rank 0's marker are
    named, before anything is written."""
    marker = _marker(directory, save)
    seen = _exchange(comm, [int(os.path.exists(marker))])[:, 0]
    if rank == 0:
        os.remove(marker)
    apart = np.flatnonzero(seen == 0)
    if apart.size:
        raise ValueError(
            f"checkpoint.save({directory!r}): rank(s) {', '.join(map(str, apart))} do not see "
            "the folder rank 0 writes to; a checkpoint folder must be one folder shared by "
            "every rank (a shared file system, not a node-local disk)")


def _gather_digests(comm, digest):
    """Every rank's SHA-256 digest, in rank order."""
    if comm is None:
        return [digest]
    return [row.tobytes() for row in _exchange(comm, np.frombuffer(digest, dtype=np.int64))]


def save(directory, model, optimizer, step, extra=None):
    """Write this rank's checkpoint of ``model``, ``optimizer`` (or None) and ``step`` into
    ``directory`` (created if missing); every rank must call it. ``extra`` is JSON-able data
    stored per rank and handed back by ``load``."""
    if not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative integer, not {step!r}")
    step = int(step)
    comm, rank, size = _world()
    os.makedirs(directory, exist_ok=True)
    shard = _stage_3_shard(optimizer)
    arrays = {} if shard is not None else {
        MODEL_PREFIX + name: value for name, value in model.state_dict().items()}
    scalars = {}
    trained = _trained(model, optimizer)
    if optimizer is not None:
        for key, value in optimizer.state_dict().items():
            if isinstance(value, np.ndarray):
                arrays[_OPTIMIZER + key] = value
            else:
                scalars[key] = value
    meta = {"step": step, "rank": rank, "world_size": size, "optimizer": scalars,
            "rng_state": backend.rng_state(), "extra": extra, "trained": trained,
            "parts": _parts(model)}
    device_state = backend.rng_device_state()
    if device_state is not None:
        arrays[_RNG_DEVICE] = device_state
    arrays[_META] = np.array(json.dumps(meta))
    save = _save_token(comm, rank, size, directory)
    if comm is not None:
        _check_shared(comm, rank, directory, save)
    path = os.path.join(directory, _rank_file(step, rank, save))
    if shard is None:
        files.write_atomically(path, lambda f: np.savez(f, **arrays),
                               _temporary_prefix(f"rank{rank}"))
    else:
        files.write_atomically(path, lambda f: _write_entries(f, _one_at_a_time(model, arrays)),
                               _temporary_prefix(f"rank{rank}"))
    digests = _gather_digests(comm, _digest(path))
    if rank == 0:
        manifest = {"format": FORMAT, "version": VERSION, "step": step, "world_size": size,
                    "files": [{"rank": r, "file": _rank_file(step, r, save), "sha256": d.hex()}
                              for r, d in enumerate(digests)]}
        files.write_atomically(os.path.join(directory, MANIFEST),
                               lambda f: f.write(json.dumps(manifest, indent=1).encode()),
                               _temporary_prefix("manifest"))
    if comm is not None:
        _exchange(comm, [0])
    _remove_stale(directory, rank, os.path.basename(path))
    return path


def _stage_3_shard(optimizer):
    """The shard of the parameters that ``optimizer`` updates under sharding stage 3, where the
    model holds no values of its own; None otherwise."""
    inner = getattr(optimizer, "inner", optimizer)
    return getattr(inner, "shard_parameters", None)


def _one_at_a_time(model, arrays):
    """``(key, array)`` of the model's parameters, each gathered when it is written, then its
    buffers and ``arrays``."""
    for name, p in model.named_parameters():
        yield MODEL_PREFIX + name, backend.to_numpy(p.values())
    for name, b in model.named_buffers():
        yield MODEL_PREFIX + name, backend.to_numpy(b)
    yield from arrays.items()


def _write_entries(f, entries):
    """``np.savez``'s format (a zip of ``<key>.npy``), written one entry at a time."""
    with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for key, value in entries:
            with archive.open(key + ".npy", "w", force_zip64=True) as entry:
                np.lib.format.write_array(entry, np.asanyarray(value), allow_pickle=False)


class _StoredModel(Mapping):
    """The model arrays of the checkpoint file ``path`` by name, each read from the file when
    asked for: a stage-3 model takes its shard of one parameter at a time."""

    def __init__(self, path, names):
        self.path = path
        self.names = names

    def __getitem__(self, name):
        if name not in self.names:
            raise KeyError(name)
        with archives.load_npz(self.path) as stored:
            return stored[MODEL_PREFIX + name]

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)


class _ShardCopy:
    """What a stage-3 model holds, to put back: a copy of the shard and of the buffers."""

    def __init__(self, model, shard):
        self.shard = shard
        self.values = shard.copy()
        self.buffers = {name: b.copy() for name, b in model.named_buffers()}

    def restore(self, model):
        self.shard[...] = self.values
        for name, b in model.named_buffers():
            b[...] = self.buffers[name]


def _trained(model, optimizer):
    """The names of the parameters ``optimizer`` updates when that is not all of ``model``'s
    (a pipeline stage's): which rank's copy of a parameter is the trained one, for
    ``fleetmpi.checkpoint_export``; None when it updates them all or is not given."""
    inner = getattr(optimizer, "inner", optimizer)
    if inner is None or not hasattr(inner, "owns") or not hasattr(model, "named_parameters"):
        return None
    named = model.named_parameters()
    trained = [name for name, p in named if inner.owns(p)]
    return None if len(trained) == len(named) else trained


def _parts(model):
    """The names of the parameters whose saved values are this rank's part of a split
    (tensor-parallel) parameter, for ``fleetmpi.checkpoint_export``; a model view that saves
    them whole says so with ``saves_whole``."""
    if getattr(model, "saves_whole", False) or not hasattr(model, "named_parameters"):
        return []
    return [name for name, p in model.named_parameters() if getattr(p, "is_distributed", False)]


def _remove_stale(directory, rank, current):
    """This rank's checkpoint files other than ``current`` and the temporaries its crashed
    saves left (rank 0 also the manifest's and the shared-folder markers'), once the manifest
    names the new files."""
    owners = [_temporary_prefix(f"rank{rank}")] + ([_temporary_prefix("manifest")]
                                                   if rank == 0 else [])
    for name in os.listdir(directory):
        match = _RANK_FILE.fullmatch(name)
        stale_file = match is not None and int(match.group(1)) == rank and name != current
        stale_temporary = name.endswith(".part") and name.startswith(tuple(owners))
        stale_marker = rank == 0 and name.startswith(os.path.basename(_marker("", "")))
        if stale_file or stale_temporary or stale_marker:
            os.remove(os.path.join(directory, name))


def read_manifest(directory):
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint in {directory!r}: {MANIFEST} is missing")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}); the checkpoint's manifest is "
                         "damaged") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT \
            or manifest.get("version") != VERSION:
        raise ValueError(f"{path} is not a {FORMAT} version {VERSION} manifest")
    files = manifest.get("files")
    if not isinstance(files, list) or not isinstance(manifest.get("world_size"), int) \
            or not 1 <= len(files) == manifest["world_size"] \
            or not all(isinstance(e, dict) and {"file", "sha256"} <= set(e) for e in files):
        raise ValueError(f"{path} does not list one file with its sha256 per rank of its "
                         "world_size; the checkpoint's manifest is damaged")
    for entry in files:
        name = entry["file"]
        if not isinstance(name, str) or name in ("", ".", "..") \
                or os.path.basename(name) != name:
            raise ValueError(f"{path} names {name!r} as a checkpoint file; only a plain file "
                             "name inside the checkpoint's folder is allowed (no folder, "
                             "'..' or absolute path)")
    return manifest


def _inside(path, directory):
    """Whether ``path``, its symbolic links followed, lies in ``directory``."""
    folder = os.path.realpath(directory)
    return os.path.commonpath([os.path.realpath(path), folder]) == folder


def verified_file(directory, entry):
    """The path of a manifest ``entry``'s file, after checking that it stays in the folder
    (``read_manifest`` checked the name; a symbolic link must not point out) and its digest."""
    path = os.path.join(directory, entry["file"])
    if os.path.islink(path) and not _inside(path, directory):
        raise ValueError(f"{path}, named in the manifest of {directory!r}, is a symbolic link "
                         f"to {os.path.realpath(path)!r}, outside the checkpoint's folder; "
                         "only files inside it are loaded")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}, named in the manifest of {directory!r}, is missing; "
                                "the checkpoint is incomplete")
    if _digest(path).hex() != entry["sha256"]:
        raise ValueError(f"{path} does not match the SHA-256 in the manifest; the checkpoint "
                         "is damaged or incomplete")
    return path


def _meta(stored):
    return json.loads(str(stored[_META]))


def read_meta(path):
    """The metadata of the checkpoint file ``path`` (step, rank, optimizer scalars, ...)."""
    with archives.load_npz(path) as stored:
        return _meta(stored)


def _is_shard_state(key):
    return key.startswith(_OPTIMIZER) and key.endswith(".shard")


def _read(path, model=True, shards=True):
    """Every array of the checkpoint file ``path`` and its metadata, as ``(arrays, meta)``;
    a file that is not a readable checkpoint is a ValueError naming it. ``model``: False
    leaves the model's arrays out, "lazy" gives them as one ``_StoredModel`` under the key
    ``MODEL_PREFIX``. ``shards``: False gives a sharded optimizer's ``"<state>.shard"``
    arrays as None, for ``_join_shards`` to read the range it needs."""
    try:
        with archives.load_npz(path) as stored:
            arrays = {k: None if not shards and _is_shard_state(k) else stored[k]
                      for k in stored.files
                      if k != _META and (model is True or not k.startswith(MODEL_PREFIX))}
            if model == "lazy":
                arrays[MODEL_PREFIX] = _StoredModel(path, [
                    k[len(MODEL_PREFIX):] for k in stored.files if k.startswith(MODEL_PREFIX)])
            return arrays, _meta(stored)
    except (zipfile.BadZipFile, OSError, EOFError, KeyError, ValueError) as error:
        raise ValueError(f"{path} is not a readable checkpoint file ({error})") from None


def _stored_range(path, key, lo, hi):
    """Elements ``[lo, hi)`` of the 1-d array ``key`` of the checkpoint file ``path``, read
    alone: the entries are stored uncompressed (``np.savez``, ``_write_entries``; the caller
    read the file's metadata first, through ``archives.load_npz``, which refuses any other),
    so the range lies at a known place in the file."""
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(key + ".npy")
        with archive.open(info) as entry:
            version = np.lib.format.read_magic(entry)
            shape, _, dtype = (np.lib.format.read_array_header_1_0(entry) if version == (1, 0)
                               else np.lib.format.read_array_header_2_0(entry))
            if len(shape) != 1 or not 0 <= lo <= hi <= shape[0]:
                raise ValueError(f"{path}: {key} has shape {shape}, not a shard holding "
                                 f"elements [{lo}, {hi})")
            header = entry.tell()
    out = np.empty(hi - lo, dtype)
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_length, extra_length = np.frombuffer(f.read(4), "<u2")
        f.seek(info.header_offset + 30 + int(name_length) + int(extra_length) + header
               + lo * dtype.itemsize)
        if f.readinto(memoryview(out).cast("B")) != out.nbytes:
            raise ValueError(f"{path}: {key} ends before element {hi}")
    return out


def _join_shards(directory, manifest, state, own):
    """``state`` (one rank's optimizer state of a sharded run) with its ``<name>.shard``
    arrays (None: not read) replaced by those of range ``own`` of the parameter space, joined
    from the files whose shards overlap it, each file's part read alone."""
    start, stop = own
    total = int(state["shard"][2])
    if stop > total:
        raise ValueError(f"the optimizer state in {directory!r} was saved for a parameter "
                         f"space of {total} elements; this optimizer updates [{start}, {stop})")
    keys = [k for k in state if k.endswith(".shard")]
    joined = {}
    covered = np.zeros(stop - start, dtype=bool)
    for entry in manifest["files"]:
        path = verified_file(directory, entry)
        a, b, _ = read_meta(path)["optimizer"]["shard"]
        lo, hi = max(a, start), min(b, stop)
        if lo >= hi or covered[lo - start:hi - start].all():
            continue
        for k in keys:
            part = _stored_range(path, _OPTIMIZER + k, lo - a, hi - a)
            if k not in joined:
                joined[k] = np.empty(stop - start, dtype=part.dtype)
            joined[k][lo - start:hi - start] = part
            del part
        covered[lo - start:hi - start] = True
    if not covered.all():
        missing = int(np.flatnonzero(~covered)[0]) + start
        raise ValueError(f"the shards in {directory!r} do not cover element {missing} of the "
                         "parameter space; the checkpoint is incomplete")
    state.update(joined)
    state["shard"] = [start, stop, total]
    return state


def saved_model_value(directory, name):
    """The model-state array ``name`` of the first rank's file of the checkpoint in
    ``directory`` (after checking its digest), or None when it holds no such entry: what a
    loader checks before loading anything."""
    entry = read_manifest(directory)["files"][0]
    stored, _ = _read(verified_file(directory, entry))
    return stored.get(MODEL_PREFIX + name)


def load(directory, model, optimizer=None, replicated=False):
    """Restore this rank's model, optimizer and random state from ``directory``; returns
    ``{"step": int, "extra": ...}``. Every rank must call it.

    The checkpoint must come from a job of the same size, unless its optimizer state is
    sharded, or ``replicated`` says that every rank holds the same model and optimizer state
    (plain data parallelism, as after an elastic restart with fewer ranks; see
    ``fleetmpi.training.elastic``). A sharded optimizer's state for the range it updates is joined
    from the shards of every file that holds part of it. In a job of another size rank ``r`` takes
    the model, random state and extra of the saved rank ``r % saved size`` (data parallelism
    keeps the parameters equal on every rank), and with ``replicated`` its optimizer state
    too.

    In a job of several ranks, every rank loads or none does: when one rank refuses its part
    (a damaged or missing file, a state its model refuses), every rank puts back what it had
    and raises the same error, naming each refusing rank and why
    (``fleetmpi.training.checkpoint_agreement``)."""
    comm, rank, size = _world()
    if size > 1:
        return _load_agreed(comm, directory, model, optimizer, replicated)
    _, states, info = _read_part(directory, rank, size, optimizer, replicated)
    _apply_or_restore(model, optimizer, states, _current(model, optimizer))
    return info


def _load_agreed(comm, directory, model, optimizer, replicated):
    """``load`` on every rank of ``comm``: each reads and applies its part, then the ranks
    agree; if any refused, those that loaded put back what they had, and all raise."""
    from .checkpoint_agreement import refusal

    error = path = part = None
    try:
        part = _read_part(directory, comm.Get_rank(), comm.Get_size(), optimizer, replicated)
    except Exception as exc:  # shared with the other ranks below, then raised on all
        error = exc
    before = _current(model, optimizer)     # on every rank: a tensor-parallel model gathers
    if part is not None:
        try:
            _apply_or_restore(model, optimizer, part[1], before)
        except Exception as exc:
            error, path = exc, part[0]
    refused = refusal(comm, directory, error, path)
    if refused is not None:
        if error is None:
            _apply(model, optimizer, before)
        raise refused from error
    return part[2]


def _read_part(directory, rank, size, optimizer, replicated):
    """``(path, (model state, optimizer state, random state), info)``: what rank ``rank`` of
    ``size`` loads, read and checked (``load``'s rules) but not yet applied."""
    manifest = read_manifest(directory)
    saved = manifest["world_size"]
    entry = manifest["files"][rank % saved]
    path = verified_file(directory, entry)
    lazy = _stage_3_shard(optimizer) is not None
    # A sharded state's arrays are read by _join_shards, only the range this rank updates.
    stored, meta = _read(path, model="lazy" if lazy else True, shards=False)
    sharded = optimizer is not None and "shard" in meta["optimizer"]
    if saved != size and not sharded and not replicated:
        raise ValueError(f"checkpoint in {directory!r} was written by {saved} rank(s); "
                         f"this job has {size} (only the optimizer state of a sharding "
                         "run is re-sharded to another number of ranks, or a state that "
                         "load(..., replicated=True) is told every rank holds alike)")
    model_state = stored.pop(MODEL_PREFIX) if lazy else {
        k[len(MODEL_PREFIX):]: v for k, v in stored.items() if k.startswith(MODEL_PREFIX)}
    state = dict(meta["optimizer"])
    state.update({k[len(_OPTIMIZER):]: v for k, v in stored.items() if k.startswith(_OPTIMIZER)})
    if sharded:
        state = _join_shards(directory, manifest, state, optimizer.shard_range)
    backend.check_rng_state(meta["rng_state"])
    return (path, (model_state, state, (meta["rng_state"], stored.get(_RNG_DEVICE))),
            {"step": meta["step"], "extra": meta["extra"]})


def _set_rng(rng):
    state, device_state = rng
    backend.set_rng_state(state)
    backend.set_rng_device_state(device_state)


def _current(model, optimizer):
    """The model's, the optimizer's and the random state as they are, in ``_apply``'s form."""
    shard = _stage_3_shard(optimizer)
    return (model.state_dict() if shard is None else _ShardCopy(model, shard),
            optimizer.state_dict() if optimizer is not None else None,
            (backend.rng_state(), backend.rng_device_state()))


def _apply(model, optimizer, states):
    """Load the three ``states`` (the random one: the rank generator's, and on a GPU its
    device state)."""
    model_state, optimizer_state, rng = states
    if isinstance(model_state, _ShardCopy):
        model_state.restore(model)
    else:
        model.set_state_dict(model_state)
    if optimizer is not None:
        optimizer.set_state_dict(optimizer_state)
    _set_rng(rng)


def _apply_or_restore(model, optimizer, states, before):
    """``_apply(states)``; if one of them is refused, put back ``before`` (``_current``'s) and
    raise."""
    try:
        _apply(model, optimizer, states)
    except BaseException:
        _apply(model, optimizer, before)
        raise

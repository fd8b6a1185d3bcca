"""Checkpoints: resuming continues bit for bit; manifest, digests and errors; a crash while
saving (the same step again included) keeps the previous checkpoint loadable and the next save
clears what it left; a load that is refused changes nothing."""
import hashlib
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.core import backend
from fleetmpi.training import checkpoint
from fleetmpi import nn, optimizer
from fleetmpi.optimizer import lr

from job_limits import HANG_SECONDS

STEPS = 6


def batch(step, rank=0):
    rng = np.random.default_rng([step, rank])
    return rng.standard_normal((8, 5)), rng.integers(0, 3, 8)


def build(seed, distributed):
    backend.manual_seed(seed)
    nn.set_default_dtype("float64")
    try:
        model = nn.MLP([5, 12, 3], dropout=0.3)
    finally:
        nn.set_default_dtype("float32")
    if distributed:
        model = fleet.distributed_model(model)
    opt = optimizer.Adam(learning_rate=lr.StepDecay(0.01, step_size=2, gamma=0.5),
                         parameters=model.parameters(), weight_decay=0.001)
    if distributed:
        opt = fleet.distributed_optimizer(opt)
    return model, opt


def train(model, opt, steps, rank):
    losses = []
    for step in steps:
        losses.append(float(opt.minimize(model, nn.CrossEntropyLoss(), *batch(step, rank))))
        opt._learning_rate.step()
    return losses


def resume_matches_uninterrupted(directory, distributed, rank=0):
    model, opt = build(0, distributed)
    losses = train(model, opt, range(STEPS), rank)
    straight = model.state_dict()

    model, opt = build(0, distributed)
    first = train(model, opt, range(STEPS // 2), rank)
    checkpoint.save(directory, model, opt, STEPS // 2, extra={"note": "half way"})
    model, opt = build(7, distributed)
    info = checkpoint.load(directory, model, opt)
    assert info == {"step": STEPS // 2, "extra": {"note": "half way"}}
    second = train(model, opt, range(info["step"], STEPS), rank)
    assert first + second == losses
    resumed = model.state_dict()
    assert set(resumed) == set(straight)
    for name in straight:
        np.testing.assert_array_equal(resumed[name], straight[name], err_msg=name)


def test_resume_is_bit_for_bit(tmp_path):
    resume_matches_uninterrupted(str(tmp_path), distributed=False)


@pytest.mark.mpi(min_size=2)
def test_resume_is_bit_for_bit_on_every_rank(tmp_path_factory):
    from mpi4py import MPI

    fleet.init(is_collective=True)
    world = MPI.COMM_WORLD
    directory = world.bcast(str(tmp_path_factory.mktemp("ckpt")) if world.rank == 0 else None)
    resume_matches_uninterrupted(directory, distributed=True, rank=fleet.worker_index())
    manifest = checkpoint.read_manifest(directory)
    assert manifest["world_size"] == fleet.worker_num()
    assert os.path.exists(os.path.join(directory, manifest["files"][world.rank]["file"]))


def test_a_gpu_generator_state_is_saved_as_an_array_and_nowhere_else(tmp_path):
    """On CuPy the rank generator's state (per-thread device states) is saved in the rank
    file and restored bit for bit (``test_resume_is_bit_for_bit`` then passes on a GPU); on
    NumPy it is JSON in the metadata, and a GPU state cannot be loaded."""
    model, opt = build(3, False)
    backend.rank_rng()
    state = backend.rng_device_state()
    checkpoint.save(str(tmp_path), model, opt, 1)
    with np.load(rank_file(str(tmp_path)), allow_pickle=False) as stored:
        saved = "rng/device_state" in stored.files
    if backend.on_gpu():
        assert state is not None and saved
        backend.rank_rng().random(5)
        backend.set_rng_device_state(state)
        np.testing.assert_array_equal(backend.rng_device_state(), state)
    else:
        assert state is None and not saved
        with pytest.raises(ValueError, match="runs on NumPy"):
            backend.set_rng_device_state(np.zeros(4, dtype=np.int8))


def test_manifest_files_and_replacement(tmp_path):
    model, opt = build(0, False)
    train(model, opt, range(2), 0)
    checkpoint.save(str(tmp_path), model, opt, 2)
    train(model, opt, range(2, 3), 0)
    checkpoint.save(str(tmp_path), model, opt, 3)
    names = sorted(os.listdir(tmp_path))
    assert names[0] == ".lock"        # this process holds the folder (checkpoint_lock)
    names = names[1:]
    assert len(names) == 2 and names[0] == "manifest.json"
    assert re.fullmatch(r"step-3-rank-0-[0-9a-f]{8}\.npz", names[1]), names
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["world_size"] == 1
    assert manifest["files"][0]["file"] == names[1]
    assert len(manifest["files"][0]["sha256"]) == 64
    with np.load(tmp_path / names[1], allow_pickle=False) as stored:
        assert "model/fc0.weight" in stored.files
        assert "optimizer/moment1.0" in stored.files


def test_damaged_or_foreign_checkpoints_are_refused(tmp_path):
    model, opt = build(0, False)
    with pytest.raises(FileNotFoundError, match="manifest.json is missing"):
        checkpoint.load(str(tmp_path), model, opt)
    checkpoint.save(str(tmp_path), model, opt, 1)
    manifest_path = tmp_path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    four = dict(manifest, world_size=4, files=manifest["files"] * 4)
    manifest_path.write_text(json.dumps(four))
    with pytest.raises(ValueError, match="written by 4 rank"):
        checkpoint.load(str(tmp_path), model, opt)
    for wrong in (dict(manifest, world_size=4), dict(manifest, world_size=0, files=[])):
        manifest_path.write_text(json.dumps(wrong))
        with pytest.raises(ValueError, match="one file with its sha256 per rank"):
            checkpoint.load(str(tmp_path), model, opt)
    manifest["files"][0]["sha256"] = "0" * 64
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="does not match the SHA-256"):
        checkpoint.load(str(tmp_path), model, opt)
    with pytest.raises(ValueError, match="step must be a non-negative integer"):
        checkpoint.save(str(tmp_path), model, opt, -1)


# -- faults ----------------------------------------------------------------------------------

def rank_file(directory, rank=0):
    return os.path.join(directory, checkpoint.read_manifest(directory)["files"][rank]["file"])


def rewrite(directory, change, rank=0, savez=np.savez):
    """Rewrite rank ``rank``'s file with ``change(arrays)`` applied (through ``savez``) and give
    the manifest its new digest, as a checkpoint that passes the digest check but holds bad
    contents."""
    path = rank_file(directory, rank)
    with np.load(path, allow_pickle=False) as stored:
        arrays = {k: stored[k] for k in stored.files}
    change(arrays)
    with open(path, "wb") as f:
        savez(f, **arrays)
    manifest = checkpoint.read_manifest(directory)
    manifest["files"][rank]["sha256"] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    with open(os.path.join(directory, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def everything(model, opt):
    """The model's and the optimizer's state and the rank generator's, for comparison."""
    return model.state_dict(), opt.state_dict(), backend.rng_state()


def assert_same(a, b):
    (model_a, opt_a, rng_a), (model_b, opt_b, rng_b) = a, b
    assert model_a.keys() == model_b.keys() and opt_a.keys() == opt_b.keys()
    for name in model_a:
        np.testing.assert_array_equal(model_a[name], model_b[name], err_msg=name)
    for key in opt_a:
        np.testing.assert_array_equal(np.asarray(opt_a[key], dtype=object),
                                      np.asarray(opt_b[key], dtype=object), err_msg=key)
    assert rng_a == rng_b


def set_meta(field, value):
    def change(arrays):
        meta = json.loads(str(arrays["meta"]))
        meta[field] = value
        arrays["meta"] = np.array(json.dumps(meta))
    return change


def replace(key, value):
    def change(arrays):
        arrays[key] = value
    return change


@pytest.mark.parametrize("damage, message", [
    (replace("model/fc1.bias", np.zeros(7)), "fc1.bias"),
    (replace("optimizer/moment1.0", np.zeros(3)), "moment1"),
    (set_meta("rng_state", {"bit_generator": "PCG64", "state": "garbage"}), "random state"),
], ids=["model_shape", "optimizer_shape", "rng_state"])
def test_a_refused_load_changes_nothing(tmp_path, damage, message):
    model, opt = build(0, False)
    train(model, opt, range(2), 0)
    checkpoint.save(str(tmp_path), model, opt, 2)
    rewrite(str(tmp_path), damage)
    model, opt = build(5, False)
    train(model, opt, range(1), 0)
    before = everything(model, opt)
    with pytest.raises((ValueError, KeyError), match=message):
        checkpoint.load(str(tmp_path), model, opt)
    assert_same(everything(model, opt), before)
    assert opt.step_count == 1


def test_a_crafted_file_that_would_inflate_is_refused_before_it_is_read(tmp_path):
    """A compressed member of 64 MiB of zeros is a few dozen KiB on disk: the load refuses it,
    naming the file and the member, without taking the memory it declares."""
    import tracemalloc

    model, opt = build(0, False)
    checkpoint.save(str(tmp_path), model, opt, 1)
    rewrite(str(tmp_path), replace("model/fc1.bias", np.zeros(8 << 20)),
            savez=np.savez_compressed)
    assert os.path.getsize(rank_file(str(tmp_path))) < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"its member model/\S+\.npy is compressed"):
            checkpoint.load(str(tmp_path), model, opt)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


def test_a_member_whose_header_declares_more_than_it_holds_is_refused(tmp_path):
    from fleetmpi.core import archives

    import io
    import zipfile

    member = io.BytesIO()
    np.lib.format.write_array_header_1_0(member, {"descr": "<f8", "fortran_order": False,
                                                  "shape": (9,)})
    member.write(np.zeros(4).tobytes())
    path = str(tmp_path / "a.npz")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("small.npy", member.getvalue())
    with pytest.raises(ValueError, match=r"small.npy declares an array of shape \(9,\) and "
                                         r"dtype float64 \(72 bytes\), but holds 32 bytes"):
        archives.check_npz(path)


def test_a_full_disk_during_a_save_names_the_file_and_keeps_the_checkpoint(tmp_path,
                                                                          monkeypatch):
    import errno

    model, opt = build(0, False)
    checkpoint.save(str(tmp_path), model, opt, 1)

    def full(f, **arrays):
        f.write(b"PK partly")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(np, "savez", full)
    with pytest.raises(OSError, match=r"cannot write .*step-2-rank-0-[0-9a-f]{8}\.npz: No space "
                                      r"left on device") as info:
        checkpoint.save(str(tmp_path), model, opt, 2)
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert checkpoint.load(str(tmp_path), *build(1, False))["step"] == 1
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".part")]


def test_damaged_manifest_and_files_are_named(tmp_path):
    model, opt = build(0, False)
    checkpoint.save(str(tmp_path), model, opt, 1)
    path = rank_file(str(tmp_path))
    manifest_text = (tmp_path / "manifest.json").read_text()
    (tmp_path / "manifest.json").write_text(manifest_text[:40])
    with pytest.raises(ValueError, match=r"manifest.json is not valid JSON"):
        checkpoint.load(str(tmp_path), model, opt)
    (tmp_path / "manifest.json").write_text(manifest_text)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])
    with pytest.raises(ValueError, match="does not match the SHA-256"):
        checkpoint.load(str(tmp_path), model, opt)
    manifest = json.loads(manifest_text)
    manifest["files"][0]["sha256"] = hashlib.sha256(data[:len(data) // 2]).hexdigest()
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=re.escape(path) + " is not a readable checkpoint"):
        checkpoint.load(str(tmp_path), model, opt)
    os.remove(path)
    with pytest.raises(FileNotFoundError, match="is missing; the checkpoint is incomplete"):
        checkpoint.load(str(tmp_path), model, opt)


CRASHING_SAVE = """
import os, sys
import numpy as np
sys.path.insert(0, {tests!r})
import test_checkpoint as t
from fleetmpi import checkpoint
directory, where = sys.argv[1], sys.argv[2]
model, opt = t.build(0, False)
t.train(model, opt, range(2), 0)
checkpoint.save(directory, model, opt, 2)
t.train(model, opt, range(2, 3), 0)
if where == "writing":      # killed while the rank file's temporary is half written
    def savez(f, **arrays):
        f.write(b"PK-half-written")
        f.flush()
        os._exit(9)
    np.savez = savez
else:                       # killed after the new rank file is in place, before the manifest
    checkpoint._gather_digests = lambda *args: os._exit(9)
checkpoint.save(directory, model, opt, 2)
"""


@pytest.mark.parametrize("where", ["writing", "before_manifest"])
def test_a_crash_while_saving_the_same_step_again_keeps_the_checkpoint(tmp_path, where):
    tests = os.path.dirname(os.path.abspath(__file__))
    crashed = subprocess.run([sys.executable, "-c", CRASHING_SAVE.format(tests=tests),
                              str(tmp_path), where], capture_output=True, text=True,
                             timeout=HANG_SECONDS)     # on this process's device, as the reference
    assert crashed.returncode == 9, crashed.stdout + crashed.stderr
    left = sorted(os.listdir(tmp_path))
    assert left[0] == ".lock"       # the killed process's lock, which the kernel dropped
    left = left[1:]
    assert len(left) == 3, left     # manifest, the saved file, and the crash's file
    model, opt = build(0, False)
    train(model, opt, range(2), 0)
    want = everything(model, opt)
    model, opt = build(3, False)
    assert checkpoint.load(str(tmp_path), model, opt)["step"] == 2
    assert_same(everything(model, opt), want)
    checkpoint.save(str(tmp_path), model, opt, 2)      # the folder's lock is free again
    names = sorted(os.listdir(tmp_path))
    assert names == [".lock", "manifest.json", os.path.basename(rank_file(str(tmp_path)))], \
        names



# -- a manifest names files inside its folder only -------------------------------------------

def name_in_manifest(directory, name):
    manifest = checkpoint.read_manifest(directory)
    manifest["files"][0]["file"] = name
    with open(os.path.join(directory, "manifest.json"), "w") as f:
        json.dump(manifest, f)


@pytest.mark.parametrize("where", ["parent", "absolute", "subfolder"])
def test_a_manifest_entry_outside_the_folder_is_refused(tmp_path, where):
    """The rank file, intact (its digest matches), moved out of the checkpoint's folder and
    named there by the manifest: refused by its name alone."""
    directory = tmp_path / "ckpt"
    model, opt = build(0, False)
    checkpoint.save(str(directory), model, opt, 1)
    (tmp_path / "sub").mkdir()
    moved = {"parent": tmp_path / "moved.npz", "absolute": tmp_path / "moved.npz",
             "subfolder": directory / "sub" / "moved.npz"}[where]
    moved.parent.mkdir(exist_ok=True)
    os.replace(rank_file(str(directory)), moved)
    name = {"parent": "../moved.npz", "absolute": str(moved), "subfolder": "sub/moved.npz"}
    name_in_manifest(str(directory), name[where])
    before = everything(model, opt)
    with pytest.raises(ValueError, match=re.escape(repr(name[where])) + " as a checkpoint "
                       "file; only a plain file name inside the checkpoint's folder"):
        checkpoint.load(str(directory), model, opt)
    assert_same(everything(model, opt), before)


def test_a_symbolic_link_out_of_the_folder_is_refused_and_one_inside_is_followed(tmp_path):
    directory = tmp_path / "ckpt"
    model, opt = build(0, False)
    checkpoint.save(str(directory), model, opt, 1)
    path = rank_file(str(directory))
    os.replace(path, tmp_path / "outside.npz")
    os.symlink(tmp_path / "outside.npz", path)
    with pytest.raises(ValueError, match=re.escape(path) + ", .* is a symbolic link to .*"
                       "outside.npz', outside the checkpoint's folder"):
        checkpoint.load(str(directory), model, opt)
    os.remove(path)
    os.replace(tmp_path / "outside.npz", directory / "inside.npz")
    os.symlink("inside.npz", path)
    assert checkpoint.load(str(directory), model, opt)["step"] == 1


# -- every rank loads, or none does ----------------------------------------------------------

def flip_a_byte(directory, rank):
    path = rank_file(directory, rank)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    with open(path, "wb") as f:
        f.write(data)


DAMAGE_ON_RANK_1 = {
    "shape": (lambda d: rewrite(d, replace("model/fc1.bias", np.zeros(7)), rank=1),
              ValueError, "state entry 'fc1.bias' has shape"),
    "flipped_byte": (lambda d: flip_a_byte(d, 1), ValueError, "does not match the SHA-256"),
    "missing": (lambda d: os.remove(rank_file(d, 1)), FileNotFoundError, "is missing"),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("replicated", [False, True], ids=["plain", "replicated"])
@pytest.mark.parametrize("damage", sorted(DAMAGE_ON_RANK_1))
def test_a_part_one_rank_refuses_is_a_load_every_rank_refuses(tmp_path_factory, damage,
                                                              replicated):
    """Rank 1's file alone is damaged: every rank raises the same error, naming rank 1 and
    its file, and keeps the state it had (rank 0 had loaded its own part, and puts it back)."""
    from mpi4py import MPI
    from comm_support import ok

    fleet.init(is_collective=True)
    world = MPI.COMM_WORLD
    directory = world.bcast(str(tmp_path_factory.mktemp("ckpt")) if world.rank == 0 else None)
    model, opt = build(0, True)
    train(model, opt, range(2), world.rank)
    checkpoint.save(directory, model, opt, 2)
    damaged = os.path.basename(rank_file(directory, 1))
    change, kind, reason = DAMAGE_ON_RANK_1[damage]
    world.Barrier()  # every rank has read the manifest before rank 0 rewrites it
    if world.rank == 0:
        change(directory)
    world.Barrier()
    model, opt = build(5, True)
    train(model, opt, range(1), world.rank)
    before = everything(model, opt)
    try:
        checkpoint.load(directory, model, opt, replicated=replicated)
        error = None
    except Exception as exc:
        error = exc
    errors = world.allgather(None if error is None else (type(error), str(error)))
    ok(all(e == errors[0] for e in errors), f"the ranks' errors differ: {errors}")
    ok(errors[0] is not None and errors[0][0] is kind, f"not a {kind.__name__}: {errors[0]}")
    message = errors[0][1]
    ok(f"rank 1: {directory}/{damaged}" in message and reason in message
       and "rank 0" not in message and "loaded on none of the" in message, message)
    try:
        assert_same(everything(model, opt), before)
        kept = True
    except AssertionError:
        kept = False
    ok(kept, "a rank's model, optimizer or random state changed")
    ok(opt.step_count == 1, f"step_count {opt.step_count}")


@pytest.mark.mpi(min_size=2)
def test_a_model_every_rank_refuses_is_named_once_for_all_ranks(tmp_path_factory):
    """The same refusal on every rank (a checkpoint of another world size) is one reason,
    with the ranks that gave it."""
    from mpi4py import MPI
    from comm_support import raises

    fleet.init(is_collective=True)
    world = MPI.COMM_WORLD
    directory = world.bcast(str(tmp_path_factory.mktemp("ckpt")) if world.rank == 0 else None)
    model, opt = build(0, True)
    checkpoint.save(directory, model, opt, 1)
    if world.rank == 0:
        manifest = checkpoint.read_manifest(directory)
        wider = dict(manifest, world_size=world.size + 1,
                     files=manifest["files"] + manifest["files"][:1])
        with open(os.path.join(directory, "manifest.json"), "w") as f:
            json.dump(wider, f)
    world.Barrier()
    last = world.size - 1
    with raises(ValueError, match=re.escape(f"loaded on none of the {world.size} ranks, "
                                            "because not every rank could load its part; "
                                            f"ranks 0-{last}: checkpoint in {directory!r} "
                                            f"was written by {world.size + 1} rank(s)")):
        checkpoint.load(directory, model, opt)


@pytest.mark.mpi(min_size=2)
def test_a_folder_the_ranks_do_not_share_is_refused_before_anything_is_written(
        tmp_path_factory):
    """Each rank its own folder under one name stands for a node-local disk on each node:
    every rank refuses, naming the ranks that do not see rank 0's folder, and writes nothing
    but rank 0's lock of the folder."""
    from mpi4py import MPI
    from comm_support import ok, raises

    fleet.init(is_collective=True)
    world = MPI.COMM_WORLD
    own = str(tmp_path_factory.mktemp(f"local-rank{world.rank}"))
    model, opt = build(0, True)
    others = ", ".join(str(r) for r in range(1, world.size))
    with raises(ValueError, match=re.escape(f"rank(s) {others} do not see the folder rank 0 "
                                            "writes to")):
        checkpoint.save(own, model, opt, 1)
    held = [".lock"] if world.rank == 0 else []     # rank 0 holds its folder (checkpoint_lock)
    ok(os.listdir(own) == held, f"rank {world.rank} left {os.listdir(own)}")
    shared = world.bcast(str(tmp_path_factory.mktemp("shared")) if world.rank == 0 else None)
    checkpoint.save(shared, model, opt, 2)
    ok(not [n for n in os.listdir(shared) if n.startswith(".shared-")], "a marker was left")

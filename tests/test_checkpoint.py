"""Checkpoints: resuming continues bit for bit; manifest, digests and errors."""
import json
import os

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi import backend, checkpoint, nn, optimizer
from fleetmpi.optimizer import lr

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


def test_manifest_files_and_replacement(tmp_path):
    model, opt = build(0, False)
    train(model, opt, range(2), 0)
    checkpoint.save(str(tmp_path), model, opt, 2)
    train(model, opt, range(2, 3), 0)
    checkpoint.save(str(tmp_path), model, opt, 3)
    assert sorted(os.listdir(tmp_path)) == ["manifest.json", "step-3-rank-0.npz"]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["world_size"] == 1
    assert len(manifest["files"][0]["sha256"]) == 64
    with np.load(tmp_path / "step-3-rank-0.npz", allow_pickle=False) as stored:
        assert "model/fc0.weight" in stored.files
        assert "optimizer/moment1.0" in stored.files


def test_damaged_or_foreign_checkpoints_are_refused(tmp_path):
    model, opt = build(0, False)
    with pytest.raises(FileNotFoundError, match="manifest.json is missing"):
        checkpoint.load(str(tmp_path), model, opt)
    checkpoint.save(str(tmp_path), model, opt, 1)
    manifest_path = tmp_path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["world_size"] = 4
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="written by 4 rank"):
        checkpoint.load(str(tmp_path), model, opt)
    manifest["world_size"] = 1
    manifest["files"][0]["sha256"] = "0" * 64
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="does not match the SHA-256"):
        checkpoint.load(str(tmp_path), model, opt)
    with pytest.raises(ValueError, match="step must be a non-negative integer"):
        checkpoint.save(str(tmp_path), model, opt, -1)

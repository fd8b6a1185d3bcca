"""``fleetmpi.save`` / ``fleetmpi.load``: state dicts in the safetensors format, with Paddle's
names, read back by the safetensors package itself, never written through a link."""
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from fleetmpi import nn, optimizer
from fleetmpi.optimizer import lr


def host(value):
    return value.numpy() if hasattr(value, "numpy") else np.asarray(value)


def _trained():
    fleet.seed(3)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1D(6), nn.ReLU(), nn.Linear(6, 2))
    opt = optimizer.Adam(learning_rate=lr.StepDecay(0.01, 2), parameters=model.parameters())
    x = fleet.to_tensor(np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32))
    for _ in range(2):
        loss = F.cross_entropy(model(x), fleet.to_tensor(np.arange(8) % 2))
        loss.backward()
        opt.step()
        opt.clear_grad()
    return model, opt


def test_a_model_and_its_optimizer_round_trip(tmp_path):
    model, opt = _trained()
    fleet.save(model.state_dict(), str(tmp_path / "model.safetensors"))
    fleet.save(opt.state_dict(), str(tmp_path / "opt.safetensors"))
    fresh, fresh_opt = _trained()[0], None
    for p in fresh.parameters():
        p.set_value(np.zeros(p.shape, p.dtype))
    loaded = fleet.load(str(tmp_path / "model.safetensors"))
    assert all(isinstance(v, fleet.Tensor) for v in loaded.values())
    fresh.set_state_dict(loaded)
    for (name, want), (other, got) in zip(model.state_dict().items(),
                                          fresh.state_dict().items()):
        assert name == other
        np.testing.assert_array_equal(host(got), host(want))
    state = fleet.load(str(tmp_path / "opt.safetensors"), return_numpy=True)
    want = opt.state_dict()
    assert state.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(state[key], value)
        else:
            assert state[key] == value
    fresh_opt = optimizer.Adam(learning_rate=lr.StepDecay(0.01, 2),
                               parameters=fresh.parameters())
    fresh_opt.set_state_dict(state)
    assert fresh_opt.state_dict()["step_count"] == want["step_count"] == 2


def test_the_file_is_plain_safetensors_with_paddles_names(tmp_path):
    model, _ = _trained()
    path = str(tmp_path / "model.safetensors")
    fleet.save(model.state_dict(), path)
    tensors = load_file(path)
    assert set(tensors) == {"0.weight", "0.bias", "1.weight", "1.bias", "1._mean",
                            "1._variance", "3.weight", "3.bias"}
    assert tensors["0.weight"].shape == (4, 6)  # Paddle's Linear layout: (in, out)
    np.testing.assert_array_equal(tensors["1._variance"],
                                  host(model.state_dict()["1._variance"]))
    with open(path, "rb") as f:
        assert b"pickle" not in f.read(4096).lower()


def test_nested_dicts_and_values(tmp_path):
    path = str(tmp_path / "state.safetensors")
    state = {"model": {"w": np.arange(3.0)}, "epoch": 4, "name": "run", "none": None,
             "schedule": {"last_epoch": 2}}
    fleet.save(state, path)
    back = fleet.load(path, return_numpy=True)
    np.testing.assert_array_equal(back["model"]["w"], np.arange(3.0))
    assert (back["epoch"], back["name"], back["none"], back["schedule"]) == (
        4, "run", None, {"last_epoch": 2})


def test_save_replaces_a_planted_link_instead_of_writing_through_it(tmp_path):
    target = tmp_path / "victim"
    target.write_text("keep me")
    path = tmp_path / "model.safetensors"
    os.symlink(target, path)
    fleet.save({"w": np.ones(2)}, str(path))
    assert target.read_text() == "keep me" and not path.is_symlink()
    np.testing.assert_array_equal(fleet.load(str(path), return_numpy=True)["w"], np.ones(2))


@pytest.mark.parametrize("obj, error, message", [
    ([np.ones(2)], TypeError, "takes a dict such as a state_dict, not list"),
    ({"a/b": np.ones(2)}, ValueError, "string keys without '/', not 'a/b'"),
    ({"w": object()}, TypeError, "cannot store 'w': a object"),
    ({"w": {"x": object()}}, TypeError, "cannot store 'w/x'"),
])
def test_what_cannot_be_saved_is_refused_by_name(tmp_path, obj, error, message):
    with pytest.raises(error, match=message):
        fleet.save(obj, str(tmp_path / "x.safetensors"))
    assert not os.listdir(tmp_path)


def test_bad_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="folder .* does not exist"):
        fleet.save({"w": np.ones(1)}, str(tmp_path / "missing" / "x.safetensors"))
    with pytest.raises(FileNotFoundError, match="no file to load at"):
        fleet.load(str(tmp_path / "absent.safetensors"))
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match="damaged.safetensors is not a readable safetensors"):
        fleet.load(str(damaged))


@pytest.mark.parametrize("values, clash", [
    ({"w": 1}, "'w'"),                      # the same name as a tensor
    ({"opt/moment": [0]}, "'opt/moment'"),  # a tensor nested under a dict
    ({"opt": {"m": 1}}, "'opt/moment'"),    # a value a tensor nests under
], ids=["same_name", "same_nested_name", "parent_of_a_tensor"])
def test_metadata_never_takes_the_place_of_a_tensor(tmp_path, values, clash):
    """A crafted file whose metadata values share a tensor's name is refused, where loading
    would have replaced the tensor silently."""
    import json

    import safetensors.numpy

    path = tmp_path / "crafted.safetensors"
    path.write_bytes(safetensors.numpy.save(
        {"w": np.ones(2, np.float32), "opt/moment": np.zeros(2, np.float32)},
        metadata={"fleetmpi.values": json.dumps(values)}))
    with pytest.raises(ValueError, match=f"crafted.safetensors: .* the place of the tensor "
                                         f"{clash}"):
        fleet.load(str(path))


def test_metadata_that_is_not_a_json_object_is_named(tmp_path):
    import safetensors.numpy

    path = tmp_path / "crafted.safetensors"
    path.write_bytes(safetensors.numpy.save({"w": np.ones(2, np.float32)},
                                            metadata={"fleetmpi.values": "[1, 2]"}))
    with pytest.raises(ValueError, match="crafted.safetensors: its fleetmpi.values metadata is "
                                         "a list, not a JSON object"):
        fleet.load(str(path))

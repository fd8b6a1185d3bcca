"""Paddle's checkpoint files: ``fleet.save`` to a ``.pdparams``/``.pdopt`` name writes the
pickle ``paddle.save`` writes (a dict of NumPy arrays and values, protocol 4, with its name
table), and ``fleet.load`` reads files in Paddle's layout, made here as Paddle writes them (its
name table; protocol 2 with NumPy 1's module names and big arrays cut into slices; an
``OrderedDict``), into a model and an optimizer. A pickle holding anything else (a
``__reduce__`` naming ``os.system``, ``builtins.eval``, an array of Python objects) is refused
without running it; a file that is neither format names the one its name calls for."""
import collections
import os
import pickle

import numpy as np
import pytest

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from fleetmpi import nn, optimizer

NAME_TABLE = "StructuredToParameterName@@"


def _trained():
    fleet.seed(3)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    opt = optimizer.Adam(learning_rate=0.01, parameters=model.parameters())
    x = fleet.to_tensor(np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32))
    loss = F.cross_entropy(model(x), fleet.to_tensor(np.arange(8) % 2))
    loss.backward()
    opt.step()
    opt.clear_grad()
    return model, opt


def test_save_to_a_paddle_name_writes_paddles_pickle_and_loads_back(tmp_path):
    model, opt = _trained()
    path = str(tmp_path / "model.pdparams")
    fleet.save(model.state_dict(), path)
    with open(path, "rb") as f:
        assert f.read(2) == b"\x80\x04"  # pickle protocol 4, as paddle.save
        f.seek(0)
        raw = pickle.load(f)
    state = model.state_dict()
    assert raw[NAME_TABLE] == {name: name for name in state}
    for name, value in state.items():
        assert type(raw[name]) is np.ndarray
        np.testing.assert_array_equal(raw[name], value)
    loaded = fleet.load(path)
    assert NAME_TABLE not in loaded and all(isinstance(v, fleet.Tensor) for v in loaded.values())
    fresh = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    fresh.set_state_dict(loaded)
    for name, value in fresh.state_dict().items():
        np.testing.assert_array_equal(value, state[name])

    opt_path = str(tmp_path / "model.pdopt")
    fleet.save(opt.state_dict(), opt_path)
    back = fleet.load(opt_path, return_numpy=True)
    want = opt.state_dict()
    assert back.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(back[key], value, err_msg=key)
        else:
            assert back[key] == value, key
    plain = optimizer.Adam(learning_rate=0.01, parameters=fresh.parameters())
    plain.set_state_dict(back)
    assert plain.state_dict()["step_count"] == want["step_count"]


def paddle_layout(protocol, slices=False):
    """A model state dict as Paddle 2.x's paddle.save pickles it: arrays under the structured
    names and its name table; with ``slices``, the first weight cut as protocol 2 and 3 cut
    big arrays, with NumPy 1's module names."""
    rng = np.random.default_rng(5)
    state = {"0.weight": rng.standard_normal((4, 6)).astype(np.float32),
             "0.bias": rng.standard_normal(6).astype(np.float32),
             "2.weight": rng.standard_normal((6, 2)).astype(np.float32),
             "2.bias": rng.standard_normal(2).astype(np.float32)}
    saved = dict(state)
    saved[NAME_TABLE] = {"0.weight": "linear_0.w_0", "0.bias": "linear_0.b_0",
                         "2.weight": "linear_1.w_0", "2.bias": "linear_1.b_0"}
    if slices:
        flat = saved.pop("0.weight").flatten()
        saved["0.weight@@.0"], saved["0.weight@@.1"] = flat[:16], flat[16:]
        saved["UnpackBigParamInfor@@"] = {"0.weight": {"OriginShape": (4, 6),
                                                       "slices": ["0.weight@@.0",
                                                                  "0.weight@@.1"]}}
    data = pickle.dumps(saved, protocol=protocol)
    if protocol == 2:  # as NumPy 1 names its reconstruction function
        data = data.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    return state, data


@pytest.mark.parametrize("protocol, slices", [(4, False), (2, True)], ids=["2.x", "protocol-2"])
def test_a_file_in_paddles_layout_loads_into_the_model(tmp_path, protocol, slices):
    state, data = paddle_layout(protocol, slices)
    path = tmp_path / "model.pdparams"
    path.write_bytes(data)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    model.set_state_dict(fleet.load(str(path)))
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value, state[name])


def test_an_ordered_dict_with_values_loads(tmp_path):
    path = tmp_path / "opt.pdopt"
    saved = collections.OrderedDict(
        [("linear_0.w_0_moment1_0", np.ones((2, 3), np.float32)),
         ("LR_Scheduler", {"last_epoch": 3, "last_lr": 0.5}),
         ("beta1_pow", np.float32(0.9)), ("names", ["a", ("b", 1)])])
    path.write_bytes(pickle.dumps(saved, protocol=4))
    back = fleet.load(str(path), return_numpy=True)
    np.testing.assert_array_equal(back["linear_0.w_0_moment1_0"], np.ones((2, 3)))
    assert back["LR_Scheduler"] == {"last_epoch": 3, "last_lr": 0.5}
    assert back["beta1_pow"] == np.float32(0.9) and back["names"] == ["a", ("b", 1)]


class RunsACommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class Evaluates:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return eval, (f"open({str(self.marker)!r}, 'w').close()",)


@pytest.mark.parametrize("make, names", [
    (lambda marker: {"w": np.ones(2), "x": RunsACommand(marker)}, r"(posix|os|nt)\.system"),
    (lambda marker: {"w": Evaluates(marker)}, r"builtins\.eval"),
    (lambda marker: {"w": np.array([RunsACommand(marker)], dtype=object)}, r"dtype object"),
], ids=["os.system", "eval", "object array"])
def test_a_pickle_with_any_other_object_is_refused_without_running_it(tmp_path, make, names):
    marker = tmp_path / "ran"
    path = tmp_path / "model.pdparams"
    path.write_bytes(pickle.dumps(make(marker), protocol=4))
    with pytest.raises(ValueError, match=r"model.pdparams is not loaded as a Paddle "
                                         r"checkpoint: .*" + names):
        fleet.load(str(path))
    assert not marker.exists(), "loading ran code from the file"


def test_a_file_that_is_neither_names_the_format_its_name_calls_for(tmp_path):
    path = tmp_path / "model.pdparams"
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match=r"model.pdparams is not a Paddle checkpoint \(the "
                                         r"pickle paddle.save writes, which its name calls "
                                         r"for\), nor a readable safetensors file"):
        fleet.load(str(path))
    other = tmp_path / "model.safetensors"
    other.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors "
                                         r"file \(what fleetmpi.save writes to this name\), "
                                         r"nor a Paddle checkpoint"):
        fleet.load(str(other))

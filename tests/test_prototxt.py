"""save_to_prototxt / load_from_prototxt: exact round trips, and errors that name file and line."""
import pytest
from google.protobuf import text_format

import fleetmpi as fleet


def _configured():
    strategy = fleet.DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {"init_loss_scaling": 128, "custom_white_list": ["conv2d", "mul"]}
    strategy.recompute = True
    strategy.recompute_configs = {"checkpoints": ["fc_0", "fc_2"], "enable_offload": True,
                                  "checkpoint_shape": [100, 512, 1024]}
    strategy.dgc_configs = {"sparsity": [0.75, 0.9375, 0.999], "rampup_step": 100}
    strategy.lars_configs = {"lars_coeff": 0.001, "epsilon": 1e-12,
                             "exclude_from_weight_decay": ["batch_norm", ".b_0"]}
    strategy.a_sync = False
    strategy.a_sync_configs = {"heter_worker_device_guard": "gpu"}
    strategy.fuse_grad_size_in_MB = 16
    strategy.build_strategy.fuse_all_optimizer_ops = True
    strategy.execution_strategy.num_iteration_per_drop_scope = 100
    return strategy


def test_round_trip_is_exact(tmp_path):
    path = tmp_path / "s.prototxt"
    strategy = _configured()
    strategy.save_to_prototxt(str(path))
    loaded = fleet.DistributedStrategy().load_from_prototxt(str(path))
    assert loaded == strategy
    assert loaded._message.SerializeToString(deterministic=True) == \
        strategy._message.SerializeToString(deterministic=True)
    assert loaded.lars_configs["epsilon"] == 1e-12
    assert loaded.dgc_configs["sparsity"] == [0.75, 0.9375, 0.999]


def test_file_holds_the_fields_that_were_set_only(tmp_path):
    """proto2 presence, as Paddle writes its files: a field set to its default is written,
    one never set is not."""
    path = tmp_path / "s.prototxt"
    fleet.DistributedStrategy().save_to_prototxt(str(path))
    assert path.read_text() == ("# fleetmpi DistributedStrategy\n"
                                "# end of fleetmpi DistributedStrategy\n")
    strategy = fleet.DistributedStrategy()
    strategy.fuse_grad_size_in_MB = 32
    strategy.amp_configs = {"decr_ratio": 0.25}
    strategy.save_to_prototxt(str(path))
    text = path.read_text()
    parsed = type(strategy._message)()
    text_format.Parse(text, parsed)
    assert [field.name for field, _ in parsed.ListFields()] == ["fuse_grad_size_in_MB",
                                                                 "amp_configs"]
    assert [field.name for field, _ in parsed.amp_configs.ListFields()] == ["decr_ratio"]
    assert "sharding_configs" not in text and "elastic" not in text


def test_load_replaces_the_whole_strategy_and_returns_it(tmp_path):
    path = tmp_path / "partial.prototxt"
    path.write_text("amp: true\namp_configs { incr_ratio: 4 }\n")
    strategy = fleet.DistributedStrategy()
    strategy.gradient_merge = True
    result = strategy.load_from_prototxt(str(path))
    assert result is strategy
    assert strategy.amp is True
    assert strategy.amp_configs["incr_ratio"] == 4.0
    assert strategy.amp_configs["decr_ratio"] == 0.5
    assert strategy.gradient_merge is False
    assert strategy.dgc_configs["sparsity"] == [0.999]


@pytest.mark.parametrize("text,line,words", [
    ("amp: true\nampp: true\n", 2, "ampp"),
    ("amp: true\namp_configs {\n  init_loss_scale: 2\n}\n", 3, "init_loss_scale"),
    ("amp: true\nnccl_comm_num: \"two\"\n", 2, "nccl_comm_num"),
    ("amp_configs {\n  incr_ratio: 2\n", 2, "}"),
    ("amp: maybe\n", 1, "amp"),
    ("amp: true\namp: false\n", 2, "amp"),
])
def test_malformed_files_name_file_and_line(tmp_path, text, line, words):
    path = tmp_path / "bad.prototxt"
    path.write_text(text)
    strategy = fleet.DistributedStrategy()
    with pytest.raises(fleet.ConfigError) as info:
        strategy.load_from_prototxt(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}:{line}:"), message
    assert words in message
    assert strategy == fleet.DistributedStrategy()


@pytest.mark.parametrize("text,words", [
    ("amp_configs { incr_ratio: 0.5 }\n", "amp_configs.incr_ratio"),
    ("gradient_merge_configs { k_steps: 0 }\n", "gradient_merge_configs.k_steps"),
    ("dgc_configs { sparsity: 0.9 sparsity: 1.0 }\n", "dgc_configs.sparsity[1]"),
    ("a_sync_configs { heter_worker_device_guard: \"tpu\" }\n", "heter_worker_device_guard"),
])
def test_values_outside_the_allowed_range_in_a_file_are_refused(tmp_path, text, words):
    path = tmp_path / "range.prototxt"
    path.write_text(text)
    strategy = fleet.DistributedStrategy()
    with pytest.raises(fleet.ConfigError) as info:
        strategy.load_from_prototxt(str(path))
    assert str(path) in str(info.value) and words in str(info.value)
    assert strategy == fleet.DistributedStrategy()


def test_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        fleet.DistributedStrategy().load_from_prototxt(str(tmp_path / "none.prototxt"))


def test_every_cut_of_a_saved_file_is_refused_and_loads_nothing(tmp_path):
    """Text format has no end marker: cut at a line or inside a number, a file still parses,
    as another strategy. Every proper prefix of a saved file is refused by name instead."""
    path = tmp_path / "s.prototxt"
    _configured().save_to_prototxt(str(path))
    whole = path.read_bytes()
    cut = tmp_path / "cut.prototxt"
    for end in range(len("# fleetmpi DistributedStrategy\n"), len(whole)):
        cut.write_bytes(whole[:end])
        strategy = fleet.DistributedStrategy()
        with pytest.raises(fleet.ConfigError) as info:
            strategy.load_from_prototxt(str(cut))
        assert str(info.value).startswith(f"{cut}:"), (end, str(info.value))
        assert strategy == fleet.DistributedStrategy(), end
    assert fleet.DistributedStrategy().load_from_prototxt(str(path)) == _configured()


def test_a_file_without_fleetmpis_first_line_loads_as_written(tmp_path):
    """Paddle's files and hand-written ones have neither the first nor the last line."""
    path = tmp_path / "s.prototxt"
    _configured().save_to_prototxt(str(path))
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[1:-1]))
    assert fleet.DistributedStrategy().load_from_prototxt(str(path)) == _configured()


def test_a_file_that_is_not_utf8_is_refused_naming_file_and_byte(tmp_path):
    path = tmp_path / "latin1.prototxt"
    path.write_bytes(b"amp: true\n# caf\xe9\n")
    with pytest.raises(fleet.ConfigError, match=r"latin1.prototxt: byte 0xe9 at offset 15 is "
                                                r"not UTF-8"):
        fleet.DistributedStrategy().load_from_prototxt(str(path))


def test_a_save_that_fails_leaves_the_old_file_whole(tmp_path, monkeypatch):
    """The file is written beside its name and renamed over it: a save cut short (here the
    rename fails, as on a full disk) leaves the previous strategy, and no temporary."""
    import os

    path = tmp_path / "s.prototxt"
    _configured().save_to_prototxt(str(path))
    before = path.read_bytes()

    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    changed = _configured()
    changed.amp = False
    with pytest.raises(OSError, match="No space left"):
        changed.save_to_prototxt(str(path))
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.prototxt"]

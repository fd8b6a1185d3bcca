"""Paddle's FLAGS_* variables: the fusion sizes feed the fields a strategy leaves unset, the
memory fraction is checked and limits CuPy's pool, and any other flag that is set is reported
as not applied."""
import pytest

import fleetmpi as fleet
from fleetmpi import nn, optimizer
from fleetmpi.core import paddle_flags


def _applied(strategy):
    fleet.init()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    fleet.distributed_optimizer(optimizer.SGD(learning_rate=0.1, parameters=model.parameters()),
                                strategy)
    return fleet.applied_strategy()


def test_fusion_flags_set_the_fields_the_strategy_leaves_unset(monkeypatch):
    monkeypatch.setenv("FLAGS_fuse_parameter_memory_size", "16")
    monkeypatch.setenv("FLAGS_fuse_parameter_groups_size", "50")
    applied = _applied(fleet.DistributedStrategy())
    assert (applied.fuse_grad_size_in_MB, applied.fuse_grad_size_in_TFLOPS) == (16, 50.0)
    strategy = fleet.DistributedStrategy()
    strategy.fuse_grad_size_in_MB = 32          # set by the script, even to the default: wins
    applied = _applied(strategy)
    assert (applied.fuse_grad_size_in_MB, applied.fuse_grad_size_in_TFLOPS) == (32, 50.0)
    assert strategy.fuse_grad_size_in_TFLOPS == 20.0   # the script's strategy is not changed


def test_flags_fleetmpi_does_not_read_are_reported(monkeypatch):
    monkeypatch.setenv("FLAGS_eager_delete_tensor_gb", "0.0")
    monkeypatch.setenv("FLAGS_fraction_of_gpu_memory_to_use", "0.7")
    reasons = _applied(fleet.DistributedStrategy()).not_applied
    assert reasons["FLAGS_eager_delete_tensor_gb"] == paddle_flags.UNREAD
    if fleet.backend.on_gpu():
        assert "FLAGS_fraction_of_gpu_memory_to_use" not in reasons
    else:
        assert "computes on the CPU" in reasons["FLAGS_fraction_of_gpu_memory_to_use"]


@pytest.mark.parametrize("name,text,match", [
    ("FLAGS_fuse_parameter_memory_size", "16.5", "must be a positive integer"),
    ("FLAGS_fuse_parameter_groups_size", "-1", "must be a positive number"),
])
def test_bad_fusion_flags_are_refused_by_name(monkeypatch, name, text, match):
    monkeypatch.setenv(name, text)
    with pytest.raises(ValueError, match=f"{name}='{text}' {match}"):
        _applied(fleet.DistributedStrategy())


@pytest.mark.parametrize("text,expected", [("0.7", 0.7), ("1", 1.0), ("", None)])
def test_memory_fraction_is_a_fraction(text, expected):
    assert paddle_flags.memory_fraction({"FLAGS_fraction_of_gpu_memory_to_use": text}) == \
        expected
    with pytest.raises(ValueError, match=r"must be a fraction in \(0, 1\]"):
        paddle_flags.memory_fraction({"FLAGS_fraction_of_gpu_memory_to_use": "1.5"})

"""Errors a Paddle script catches by Paddle's types: fleetmpi's stricter checks and messages,
raised as exceptions that are also instances of the type Paddle raises."""
import pytest

import fleetmpi as fleet


@pytest.mark.parametrize("paddle_type", [TypeError, AttributeError])
def test_unknown_strategy_attribute_is_a_type_error_as_in_paddle(paddle_type):
    strategy = fleet.DistributedStrategy()
    with pytest.raises(paddle_type, match="DistributedStrategy has no attribute 'amp_config' "
                                          r"\(did you mean 'amp_configs'\?\)"):
        strategy.amp_config = {"init_loss_scaling": 2.0}
    with pytest.raises(paddle_type, match="has no attribute 'recomputee'"):
        strategy.recomputee
    with pytest.raises(paddle_type, match="BuildStrategy has no attribute 'fuse_all'"):
        strategy.build_strategy.fuse_all = True
    assert not hasattr(strategy, "recomputee")


@pytest.mark.parametrize("call", ["init_worker", "stop_worker", "init_server", "run_server",
                                  "save_persistables"])
@pytest.mark.parametrize("paddle_type", [ValueError, RuntimeError, fleet.ModeError])
def test_parameter_server_calls_in_collective_mode_are_value_errors(call, paddle_type):
    fleet.init(is_collective=True)
    args = ("somewhere",) if call == "save_persistables" else ()
    with pytest.raises(paddle_type, match=rf"fleet.{call}\(\) belongs to parameter-server mode"):
        getattr(fleet, call)(*args)

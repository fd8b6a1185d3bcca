"""Paddle's dygraph sharding API: ``group_sharded_parallel`` at each level is the sharding stage
it names, bit for bit (a user's model with a shared weight and an unused branch, Adam); what is
not supported is refused with the reason; ``save_group_sharded_model`` writes the whole model
and optimizer state, which load into a plain model and optimizer and continue the run."""
import logging
import os

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.core import backend
from fleetmpi import optimizer
from fleetmpi.distributed.sharding import group_sharded_parallel  # Paddle's path
from comm_support import equal, ok
from strategy_support import global_batch, make_mlp, shard, train_step
from test_sharding_stages import sharding
from test_user_model import UserNet

STEPS = 4
LEVELS = {"os": 1, "os_g": 2, "p_g_os": 3}


def adam(parameters):
    return optimizer.Adam(learning_rate=0.01, parameters=parameters)


def train_from(model, opt, steps):
    size, rank = fleet.worker_num(), fleet.worker_index()
    for step in steps:
        x, y = global_batch(step)
        train_step(opt, model, shard(x, rank, size), shard(y, rank, size), "dygraph")


def build(level=None, stage=None, **arguments):
    """UserNet from seed 0 with Adam, through group_sharded_parallel at ``level`` or through
    distributed_optimizer with sharding ``stage``."""
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    net = UserNet("float64", "all")
    if level is not None:
        model, opt, scaler = group_sharded_parallel(net, adam(net.parameters()), level,
                                                    **arguments)
        ok(scaler is None, "the scaler came back changed")
        return model, opt
    model = fleet.distributed_model(net)
    return model, fleet.distributed_optimizer(adam(model.parameters()), sharding(stage))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("level", sorted(LEVELS))
def test_each_level_is_its_sharding_stage_bit_for_bit(level):
    model, opt = build(level)
    ok(opt.strategies["sharding"].stage == LEVELS[level], "another stage was applied")
    train_from(model, opt, range(STEPS))
    expected, expected_opt = build(stage=LEVELS[level])
    train_from(expected, expected_opt, range(STEPS))
    reference = expected.state_dict()
    for name, value in model.state_dict().items():
        equal(value, reference[name], err_msg=name)


def released(parameter):
    """Whether ``parameter`` holds stage 3's placeholder instead of values."""
    return parameter.data.strides == (0,) * parameter.data.ndim


@pytest.mark.mpi(min_size=2)
def test_stage_3_parameters_are_whole_after_get_all_parameters_and_after_the_save(
        tmp_path_factory):
    """As Paddle's stage-3 test reads them: after training and ``get_all_parameters``, and
    after ``save_group_sharded_model``, the parameters are stage 1's; the next update releases
    them again."""
    from mpi4py import MPI

    folder = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("saved"))
                                  if MPI.COMM_WORLD.rank == 0 else None)
    model, opt = build("p_g_os")
    expected, expected_opt = build("os")
    for steps, read in ((range(STEPS), model.get_all_parameters),
                        (range(STEPS, STEPS + 1),
                         lambda: fleet.save_group_sharded_model(model, folder, opt))):
        train_from(model, opt, steps)
        ok(all(released(p) for p in model.parameters()), "the update left whole parameters")
        train_from(expected, expected_opt, steps)
        read()
        reference = expected.parameters()
        for p, q in zip(model.parameters(), reference, strict=True):
            equal(p.numpy(), q.numpy(), err_msg=p.name)


@pytest.mark.mpi(min_size=2)
def test_buffer_max_size_sets_the_gradient_buckets():
    _, opt = build("os_g", buffer_max_size=2 ** 17)
    ok(opt.strategy.fuse_grad_size_in_MB == 1, "2**17 float64 elements are 1 MiB")
    _, opt = build("os_g")
    ok(opt.strategy.fuse_grad_size_in_MB == 64, "2**23 float64 elements are 64 MiB")


@pytest.mark.parametrize("arguments, message", [
    ({"level": "p_g"}, r"level 'p_g' is not one of 'os', 'os_g', 'p_g_os'"),
    ({"level": "os", "offload": True}, r"offload=True is not supported: .* no offload"),
    ({"level": "os", "scaler": object()}, r"scaler must be None: fleetmpi has no GradScaler"),
    ({"level": "os", "group": object()}, r"group must be None: .* hybrid_dp"),
    ({"level": "os", "dp_group": object()}, r"dp_group must be None"),
    ({"level": "p_g_os", "exclude_layer": ["GroupNorm"]}, r"exclude_layer=\['GroupNorm'\]"),
    ({"level": "os", "sync_buffers": 1}, r"sync_buffers must be True or False, not 1"),
    ({"level": "os", "buffer_max_size": 0}, r"buffer_max_size must be a positive int"),
])
def test_what_is_not_supported_is_refused_with_the_reason(arguments, message):
    fleet.init(is_collective=True)
    net = make_mlp()
    with pytest.raises(ValueError, match=message):
        fleet.group_sharded_parallel(net, adam(net.parameters()), **arguments)


def test_a_segment_size_is_reported_as_having_no_effect(caplog):
    fleet.init(is_collective=True)
    net = make_mlp()
    with caplog.at_level(logging.WARNING):
        fleet.group_sharded_parallel(net, adam(net.parameters()), "p_g_os", segment_size=4)
    ok("segment_size=4 has no effect" in caplog.text, caplog.text)


@pytest.mark.mpi(min_size=2)
def test_sync_buffers_broadcasts_the_buffers_from_rank_0_before_forward():
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    net = UserNet("float64", "all")
    net.register_buffer("counter", np.zeros(3))
    model, opt, _ = fleet.group_sharded_parallel(net, adam(net.parameters()), "os_g",
                                                 sync_buffers=True)
    model.counter[...] = fleet.worker_index() + 1
    train_from(model, opt, range(1))
    equal(np.asarray(model.counter), np.ones(3))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("level", ["os", "p_g_os"])
def test_a_saved_model_and_optimizer_load_before_group_sharded_parallel_and_continue(
        level, tmp_path_factory):
    from mpi4py import MPI

    fleet.init(is_collective=True)
    world = MPI.COMM_WORLD
    folder = world.bcast(str(tmp_path_factory.mktemp("saved")) if world.rank == 0 else None)
    model, opt = build(level)
    train_from(model, opt, range(STEPS // 2))
    fleet.save_group_sharded_model(model, folder, opt)
    ok(sorted(os.listdir(folder)) == ["model.pdmodel", "model.pdopt"], os.listdir(folder))
    saved = fleet.load(os.path.join(folder, "model.pdopt"))
    equal(saved["shard"], [0, opt.inner.space_size, opt.inner.space_size])
    train_from(model, opt, range(STEPS // 2, STEPS))

    backend.manual_seed(5)
    net = UserNet("float64", "all")
    net.set_state_dict(fleet.load(os.path.join(folder, "model.pdmodel")))
    plain = adam(net.parameters())
    plain.set_state_dict(saved)
    resumed, resumed_opt, _ = fleet.group_sharded_parallel(net, plain, level)
    train_from(resumed, resumed_opt, range(STEPS // 2, STEPS))
    reference = model.state_dict()
    for name, value in resumed.state_dict().items():
        equal(value, reference[name], err_msg=name)


def test_saving_into_a_file_or_with_another_optimizer_is_refused(tmp_path):
    fleet.init(is_collective=True)
    net = make_mlp()
    model, opt, _ = fleet.group_sharded_parallel(net, adam(net.parameters()), "os")
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(ValueError, match=r"output '.*afile' is a file; it must be a folder"):
        fleet.save_group_sharded_model(model, str(afile), opt)
    with pytest.raises(TypeError, match=r"the one group_sharded_parallel returned, not a Adam"):
        fleet.save_group_sharded_model(model, str(tmp_path / "out"), opt.inner)

"""Checkpoints of tensor-parallel models across model-parallel degrees: a GPT trained two
steps at mp_degree 2 is saved as the serial model (parameters and the optimizer's state per
parameter) and loads into a serial model, and at mp_degree 1, 2 and 4 (as the world allows)
with its optimizer, where the next step lands exactly where the mp 2 run's third step does; a
sharded optimizer at another degree is refused and everything put back."""
import pytest

import fleetmpi as fleet
from fleetmpi.core import backend
from fleetmpi.training import hybrid_checkpoint
from fleetmpi import nn, optimizer
from comm_support import close, equal, raises
from strategy_support import make_strategy
from test_hybrid import expected_parts, tiny_gpt, token_batch, train_hybrid


def layout(degree, **fields):
    fields.setdefault("hybrid_configs", {"mp_degree": degree})
    strategy = make_strategy(**fields)
    fleet.init(is_collective=True, strategy=strategy)
    return strategy


def fresh(strategy, seed=5):
    backend.manual_seed(seed)
    model = tiny_gpt()
    opt = fleet.distributed_optimizer(
        optimizer.AdamW(learning_rate=0.01, parameters=model.parameters()), strategy)
    return model, opt


def shared_directory(tmp_path_factory):
    from mpi4py import MPI

    return MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("tp"))
                                if MPI.COMM_WORLD.rank == 0 else None)


@pytest.mark.mpi(min_size=2)
def test_a_checkpoint_of_mp2_goes_on_at_mp1_mp2_and_mp4(tmp_path_factory):
    fleet.init(is_collective=True)
    size = fleet.worker_num()
    if size % 2:
        pytest.skip("mp_degree 2 needs an even world")
    directory = shared_directory(tmp_path_factory)
    model, opt, _ = train_hybrid({"mp_degree": 2}, tiny_gpt, token_batch, steps=2)
    hybrid_checkpoint.save(directory, model, opt, step=2)
    saved = hybrid_checkpoint.merged_state_dict(model)
    third, _, _ = train_hybrid({"mp_degree": 2}, tiny_gpt, token_batch, steps=3)
    continued = hybrid_checkpoint.merged_state_dict(third)

    fleet.init(is_collective=True, strategy=fleet.DistributedStrategy())
    backend.manual_seed(5)
    serial = tiny_gpt()
    hybrid_checkpoint.load(directory, serial)
    for name, value in serial.state_dict().items():
        equal(value, saved[name], err_msg=name)

    x, y = token_batch(2)
    for degree in (1, 2, 4):
        if size % degree:
            continue
        other, opt = fresh(layout(degree))
        assert hybrid_checkpoint.load(directory, other, opt)["step"] == 2
        parts = expected_parts(other, serial)
        for name, value in other.state_dict().items():
            equal(value, parts[name], err_msg=f"mp {degree}: {name}")
        share = len(x) // (size // degree)
        replica = fleet.worker_index() // degree
        mine = slice(replica * share, (replica + 1) * share)
        loss = nn.ParallelCrossEntropy(reduction="mean") if degree > 1 else nn.CrossEntropyLoss()
        opt.minimize(other, loss, x[mine], y[mine])
        after = hybrid_checkpoint.merged_state_dict(other)
        for name, value in after.items():
            close(value, continued[name], rtol=1e-9, atol=1e-12,
                  err_msg=f"mp {degree}: {name} after the next step")


@pytest.mark.mpi(min_size=4)
def test_a_sharded_optimizer_loads_only_at_the_degree_that_saved(tmp_path_factory):
    fleet.init(is_collective=True)
    if fleet.worker_num() != 4:
        pytest.skip("layouts of four ranks")
    directory = shared_directory(tmp_path_factory)
    model, opt = fresh(layout(2, hybrid_configs={"mp_degree": 2, "sharding_degree": 2}))
    hybrid_checkpoint.save(directory, model, opt, step=0)
    serial, opt = fresh(layout(1, hybrid_configs={"sharding_degree": 2}), seed=6)
    before = serial.state_dict()
    with raises(ValueError, match="saved at mp_degree 2; this model runs at mp_degree 1, and "
                                  "a sharded optimizer"):
        hybrid_checkpoint.load(directory, serial, opt)
    for name, value in serial.state_dict().items():
        equal(value, before[name], err_msg=f"{name} put back after the refusal")
    hybrid_checkpoint.load(directory, serial)
    saved = hybrid_checkpoint.merged_state_dict(model)
    for name, value in serial.state_dict().items():
        equal(value, saved[name], err_msg=name)

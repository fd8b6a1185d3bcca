"""Checkpoints of tensor-parallel models across model-parallel degrees: a GPT trained at
mp_degree 2 is saved as the serial model and loads into the serial model, into mp_degree 2
(with its optimizer state, training on exactly as without the checkpoint) and, at four
ranks, into mp_degree 4; an optimizer at another degree is refused."""
import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi import backend, hybrid_checkpoint, nn, optimizer
from comm_support import close, equal, raises
from strategy_support import make_strategy
from test_hybrid import expected_parts, tiny_gpt, token_batch, train_hybrid


def mp_layout(degree):
    strategy = make_strategy(hybrid_configs={"mp_degree": degree})
    fleet.init(is_collective=True, strategy=strategy)
    return strategy


def fresh_gpt(seed=5):
    backend.manual_seed(seed)
    return tiny_gpt()


@pytest.mark.mpi(min_size=2)
def test_a_checkpoint_of_mp2_loads_serial_at_mp2_and_at_mp4(tmp_path_factory):
    fleet.init(is_collective=True)
    size = fleet.worker_num()
    if size % 2:
        pytest.skip("mp_degree 2 needs an even world")
    from mpi4py import MPI

    directory = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("tp")) if
                                     MPI.COMM_WORLD.rank == 0 else None)
    model, opt, _ = train_hybrid({"mp_degree": 2}, tiny_gpt, token_batch, steps=2)
    hybrid_checkpoint.save(directory, model, opt, step=2)
    serial_state = hybrid_checkpoint.merged_state_dict(model)

    fleet.init(is_collective=True, strategy=fleet.DistributedStrategy())
    serial = fresh_gpt()
    hybrid_checkpoint.load(directory, serial)
    for name, value in serial.state_dict().items():
        equal(value, serial_state[name], err_msg=name)
    parts = expected_parts(model, serial)
    for name, value in model.state_dict().items():
        equal(value, parts[name], err_msg=name)

    # The same degree: parameters and optimizer state, so training goes on as it would have.
    _, _, going_on = train_hybrid({"mp_degree": 2}, tiny_gpt, token_batch, steps=3)
    strategy = mp_layout(2)
    restored = fresh_gpt()
    opt = fleet.distributed_optimizer(
        optimizer.AdamW(learning_rate=0.01, parameters=restored.parameters()), strategy)
    assert hybrid_checkpoint.load(directory, restored, opt)["step"] == 2
    x, y = token_batch(2)
    share = len(x) // (size // 2)
    rank = fleet.get_hybrid_communicate_group().get_data_parallel_rank()
    loss = float(opt.minimize(restored, nn.ParallelCrossEntropy(),
                              x[rank * share:(rank + 1) * share],
                              y[rank * share:(rank + 1) * share]))
    close(loss, going_on[2], rtol=1e-12)

    if size % 4 == 0:
        strategy = mp_layout(4)
        wider = fresh_gpt()
        hybrid_checkpoint.load(directory, wider)
        parts = expected_parts(wider, serial)
        for name, value in wider.state_dict().items():
            equal(value, parts[name], err_msg=name)
        opt = fleet.distributed_optimizer(
            optimizer.AdamW(learning_rate=0.01, parameters=wider.parameters()), strategy)
        with raises(ValueError, match="saved at mp_degree 2; this model runs at mp_degree 4"):
            hybrid_checkpoint.load(directory, wider, opt)
        for name, value in wider.state_dict().items():
            equal(value, parts[name], err_msg=f"{name} put back after the refusal")

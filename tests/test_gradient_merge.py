"""gradient_merge: k steps of batch b are one step of batch k·b (avg) or of the summed
gradient, parameters change only every k steps, and nothing travels in between."""
import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.core import backend
from fleetmpi import nn, optimizer
from comm_support import close, equal, ok
from strategy_support import global_batch, make_mlp, make_strategy, momentum, shard, train

K = 4


def merged_batch(window):
    """The k global batches of window ``window`` as one batch."""
    parts = [global_batch(window * K + i) for i in range(K)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def one_step_per_window(windows, learning_rate):
    backend.manual_seed(0)
    model = make_mlp()
    opt = optimizer.Momentum(learning_rate=learning_rate, momentum=0.9,
                             parameters=model.parameters())
    for window in range(windows):
        opt.minimize(model, nn.CrossEntropyLoss(), *merged_batch(window))
    return model.state_dict()


def merge_strategy(avg):
    return make_strategy(gradient_merge=True, gradient_merge_configs={"k_steps": K, "avg": avg})


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("avg", [True, False])
def test_k_steps_equal_one_step_of_k_times_the_batch_at_n_ranks(avg):
    model, _, _ = train(merge_strategy(avg), steps=2 * K)
    # Summed gradients are K times the mean: Momentum from zero velocity then moves K times
    # as far, which is the mean-gradient run at K times the learning rate.
    expected = one_step_per_window(2, 0.1 if avg else 0.1 * K)
    for name, value in model.state_dict().items():
        close(value, expected[name], rtol=1e-10, atol=1e-13, err_msg=name)


@pytest.mark.parametrize("avg", [True, False])
def test_k_steps_equal_one_step_of_k_times_the_batch_in_one_process(avg):
    model, _, _ = train(merge_strategy(avg), steps=2 * K, local=True)
    expected = one_step_per_window(2, 0.1 if avg else 0.1 * K)
    for name, value in model.state_dict().items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-10, atol=1e-13, err_msg=name)


@pytest.mark.mpi(min_size=2)
def test_parameters_change_and_gradients_travel_only_every_k_steps():
    fleet.init(is_collective=True)
    size, rank = fleet.worker_num(), fleet.worker_index()
    backend.manual_seed(0)
    model = fleet.distributed_model(make_mlp())
    opt = fleet.distributed_optimizer(momentum(model.parameters()), merge_strategy(True))
    merge = opt.strategies["gradient_merge"]
    before = model.state_dict()
    for step in range(2 * K):
        sent = opt.communicator.payload_bytes
        x, y = global_batch(step)
        opt.minimize(model, nn.CrossEntropyLoss(), shard(x, rank, size), shard(y, rank, size))
        after = model.state_dict()
        boundary = step % K == K - 1
        changed = any(not np.array_equal(before[n], after[n]) for n in after)
        ok(changed == boundary, f"step {step}: parameters changed={changed}")
        travelled = opt.communicator.payload_bytes - sent
        ok((travelled > 0) == boundary, f"step {step}: {travelled} bytes sent")
        before = after
    ok(merge.micro_step == 0)


@pytest.mark.mpi(min_size=2)
def test_k_steps_one_is_plain_data_parallel_bit_for_bit():
    merged, _, _ = train(make_strategy(gradient_merge=True,
                                       gradient_merge_configs={"k_steps": 1}), steps=3)
    plain, _, _ = train(make_strategy(), steps=3)
    for name, value in merged.state_dict().items():
        equal(value, plain.state_dict()[name], err_msg=name)


def test_state_round_trips_through_the_optimizer_state_dict():
    model, opt, _ = train(merge_strategy(True), steps=K + 2, local=True)
    state = opt.state_dict()
    assert state["strategy.gradient_merge.micro_step"] == 2
    backend.manual_seed(0)
    copy = make_mlp()
    copy.set_state_dict(model.state_dict())
    again = fleet.distributed_optimizer(momentum(copy.parameters()), merge_strategy(True),
                                        local=True)
    again.set_state_dict(state)
    for step in range(K + 2, 2 * K):
        x, y = global_batch(step)
        opt.minimize(model, nn.CrossEntropyLoss(), x, y)
        again.minimize(copy, nn.CrossEntropyLoss(), x, y)
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value, copy.state_dict()[name], err_msg=name)

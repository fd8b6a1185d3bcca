"""localsgd and adaptive_localsgd: synchronous before begin_step, local steps after it, and
parameters averaged every k steps; k = 1 is synchronous SGD; adaptive k follows AdaComm."""
import math

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.core import backend
from fleetmpi import nn, optimizer
from fleetmpi.strategies.localsgd import MAX_K_STEPS
from comm_support import close, ok
from strategy_support import (global_batch, make_mlp, make_strategy, momentum, shard, train,
                              world_gather)


def sgd(parameters):
    return optimizer.SGD(learning_rate=0.1, parameters=parameters)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("make_optimizer", [sgd, momentum], ids=["sgd", "momentum"])
@pytest.mark.parametrize("begin_step", [0, 2])
def test_k_steps_one_equals_synchronous_sgd(make_optimizer, begin_step):
    strategy = make_strategy(localsgd=True,
                             localsgd_configs={"k_steps": 1, "begin_step": begin_step})
    local_sgd, _, _ = train(strategy, make_optimizer, steps=6)
    synchronous, _, _ = train(make_strategy(), make_optimizer, steps=6, local=True)
    for name, value in local_sgd.state_dict().items():
        close(value, synchronous.state_dict()[name], rtol=1e-10, atol=1e-13, err_msg=name)


def identical_everywhere(model):
    return all(np.array_equal(g[0], g[r]) for g in map(world_gather, model.state_dict().values())
               for r in range(1, len(g)))


def run_and_watch(strategy, steps, change_lr=None):
    """Per step: (parameters identical on all ranks?, bytes this rank sent)."""
    fleet.init(is_collective=True)
    size, rank = fleet.worker_num(), fleet.worker_index()
    backend.manual_seed(0)
    model = fleet.distributed_model(make_mlp())
    opt = fleet.distributed_optimizer(momentum(model.parameters()), strategy)
    seen, losses = [], []
    for step in range(steps):
        if change_lr and step in change_lr:
            opt.set_lr(change_lr[step])
        sent = opt.communicator.payload_bytes
        x, y = global_batch(step)
        losses.append(float(opt.minimize(model, nn.CrossEntropyLoss(), shard(x, rank, size),
                                         shard(y, rank, size))))
        seen.append((identical_everywhere(model), opt.communicator.payload_bytes - sent))
    return opt, seen, losses


@pytest.mark.mpi(min_size=2)
def test_local_steps_after_begin_step_and_averaging_every_k_steps():
    strategy = make_strategy(localsgd=True, localsgd_configs={"k_steps": 3, "begin_step": 2})
    opt, seen, _ = run_and_watch(strategy, 9)
    parameter_bytes = sum(p.size * p.dtype.itemsize for p in opt.inner.parameters())
    # steps 1-2 synchronous, 3-4 local, 5 averages, 6-7 local, 8 averages, 9 local; the
    # synchronous steps' gradient reduction carries the non-finite check's verdicts, and the
    # local ones decide alone: no verdict travels on its own
    ok(opt.strategies["nonfinite_check"].exchanged_bytes == 0, "verdicts exchanged")
    averaged = {1, 2, 5, 8}
    for step, (identical, sent) in enumerate(seen, start=1):
        ok(identical == (step in averaged), f"step {step}: identical={identical}")
        if step in (1, 2):
            ok(sent == parameter_bytes, f"step {step}: gradients, sent {sent}")
        else:
            ok(sent == (parameter_bytes if step in averaged else 0), f"step {step}: sent {sent}")
    ok(opt.strategies["localsgd"].averagings == 2)


def adacomm(init_k, lr_0, loss_0, lr, loss):
    return min(max(math.ceil(math.sqrt(lr_0 * loss / (lr * loss_0) * init_k)), 1), MAX_K_STEPS)


@pytest.mark.mpi(min_size=2)
def test_adaptive_period_follows_adacomm_from_the_averaged_loss():
    strategy = make_strategy(adaptive_localsgd=True,
                             adaptive_localsgd_configs={"init_k_steps": 2, "begin_step": 1})
    # a smaller learning rate lengthens the period; a tiny one hits the clamp at 16
    opt, seen, losses = run_and_watch(strategy, 40, change_lr={6: 0.02, 14: 1e-5})
    adaptive = opt.strategies["adaptive_localsgd"]
    averaged_losses = world_gather(np.array(losses)).mean(axis=0)
    loss_0, lr_0 = averaged_losses[0], 0.1
    close(adaptive.loss_0, loss_0, rtol=1e-12)
    ok(len(adaptive.history) >= 4, f"only {len(adaptive.history)} averagings")
    period, last = 2, 1
    for step, loss, lr, next_k in adaptive.history:
        ok(step - last == period, f"averaged at step {step}, {step - last} steps after {last}")
        close(loss, averaged_losses[step - 1], rtol=1e-12)
        period = adacomm(2, lr_0, loss_0, lr, loss)
        ok(next_k == period, f"step {step}: k={next_k}, AdaComm gives {period}")
        ok(seen[step - 1][0], f"parameters differ after the averaging at step {step}")
        last = step
    ok(adaptive.k_steps == period)
    ok(adaptive.history[-1][3] == MAX_K_STEPS, f"k never reached the clamp: {adaptive.history}")


def test_single_process_localsgd_is_plain_training():
    strategy = make_strategy(localsgd=True, localsgd_configs={"k_steps": 2, "begin_step": 0})
    local_sgd, _, _ = train(strategy, steps=4, local=True)
    plain, _, _ = train(make_strategy(), steps=4, local=True)
    for name, value in local_sgd.state_dict().items():
        np.testing.assert_array_equal(value, plain.state_dict()[name], err_msg=name)


@pytest.mark.mpi(min_size=2)
def test_adaptive_period_survives_a_step_whose_loss_is_not_finite():
    fleet.init(is_collective=True)
    size, rank = fleet.worker_num(), fleet.worker_index()
    strategy = make_strategy(amp=True, adaptive_localsgd=True,
                             adaptive_localsgd_configs={"init_k_steps": 1, "begin_step": 1})
    backend.manual_seed(0)
    model = fleet.distributed_model(make_mlp(dtype="float32"))
    opt = fleet.distributed_optimizer(momentum(model.parameters()), strategy)
    for step in range(6):
        x, y = global_batch(step)
        if step in (0, 2):
            x = x * 1e6  # float16 overflows in forward: the loss of this step is not finite
        opt.minimize(model, nn.CrossEntropyLoss(), shard(x.astype(np.float32), rank, size),
                     shard(y, rank, size))
    adaptive = opt.strategies["adaptive_localsgd"]
    ok(adaptive.loss_0 is not None and np.isfinite(adaptive.loss_0), f"{adaptive.loss_0}")
    ok(1 <= adaptive.k_steps <= MAX_K_STEPS, f"k_steps {adaptive.k_steps}")
    ok(opt.strategies["amp"].skipped_steps == 2)

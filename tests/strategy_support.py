"""Shared pieces of the strategy tests: a small float64 model, a global batch per step, a
strategy from keyword fields, and runs of N ranks (each on its shard of the global batch) or of
one process alone (``local=True``: the same strategies, no communication)."""
import numpy as np
import pytest

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from fleetmpi.core import backend
from fleetmpi import nn, optimizer

GLOBAL_BATCH = 24
FEATURES = 6
CLASSES = 4


def make_mlp(sizes=(FEATURES, 16, 12, CLASSES), dtype="float64"):
    """Linear layers ``fc0, fc1, ...`` with Tanh ``act0, act1, ...`` between them."""
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append((f"fc{i}", nn.Linear(fan_in, fan_out, dtype=dtype)))
        if i < len(sizes) - 2:
            layers.append((f"act{i}", nn.Tanh()))
    return nn.Sequential(*layers)


def global_batch(step, batch=GLOBAL_BATCH, features=FEATURES, classes=CLASSES):
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((batch, features)), rng.integers(0, classes, batch)


def shard(array, rank, size):
    """This rank's equal share of ``array`` along its first axis."""
    share = len(array) // size
    assert share * size == len(array), f"{len(array)} samples do not split over {size} ranks"
    return array[rank * share:(rank + 1) * share]


def make_strategy(**fields):
    """A DistributedStrategy with ``fields`` set (``amp=True, amp_configs={...}``)."""
    strategy = fleet.DistributedStrategy()
    for key, value in fields.items():
        setattr(strategy, key, value)
    return strategy


# Data parallel (None) and sharding's stages, as the test parameters of ``by_stage``.
STAGES = [pytest.param(None, id="data parallel")] + [
    pytest.param(stage, id=f"sharding stage {stage}") for stage in (1, 2, 3)]


def by_stage(stage):
    """The strategy of sharding ``stage`` (1 to 3), or of data parallel for None."""
    if stage is None:
        return make_strategy()
    return make_strategy(sharding=True, sharding_configs={"stage": stage})


def momentum(parameters):
    return optimizer.Momentum(learning_rate=0.1, momentum=0.9, parameters=parameters)


def train(strategy, make_optimizer=momentum, steps=4, make_model=make_mlp, batch=global_batch,
          local=False, seed=0, communicator=None):
    """Train ``make_model()`` (built from ``seed`` on every rank) for ``steps`` steps under
    ``strategy``; each rank trains on its shard of ``batch(step)``, or on the whole batch when
    ``local``; over ``communicator`` when given (the world's by default). Returns ``(model,
    distributed optimizer, per-step losses)``."""
    fleet.init(is_collective=True)
    size, rank = (1, 0) if local else (fleet.worker_num(), fleet.worker_index())
    backend.manual_seed(seed)
    model = make_model()
    if not local:
        model = fleet.distributed_model(model, communicator)
    opt = fleet.distributed_optimizer(make_optimizer(model.parameters()), strategy,
                                      communicator=communicator, local=local)
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    for step in range(steps):
        x, y = batch(step)
        losses.append(float(opt.minimize(model, loss_fn, shard(x, rank, size),
                                         shard(y, rank, size))))
    return model, opt, losses


def world_gather(array):
    """Every rank's ``array``, stacked in rank order."""
    from mpi4py import MPI

    array = np.ascontiguousarray(array)
    gathered = np.empty((MPI.COMM_WORLD.Get_size(),) + array.shape, dtype=array.dtype)
    MPI.COMM_WORLD.Allgather(array, gathered)
    return gathered


def train_step(opt, model, x, y, idiom):
    """One training step on ``(x, y)`` in either idiom: ``"minimize"``
    (``opt.minimize(model, nn.CrossEntropyLoss(), x, y)``) or ``"dygraph"`` (``loss =
    F.cross_entropy(model(x), y); loss.backward(); opt.step(); opt.clear_grad()``). Returns the
    loss as a float."""
    if idiom == "minimize":
        return float(opt.minimize(model, nn.CrossEntropyLoss(), x, y))
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.clear_grad()
    return loss.item()


def is_running_statistic(name):
    """Whether the state-dict entry ``name`` is a batch norm's running statistic (Paddle's
    ``_mean`` and ``_variance``): each rank's own, from its own batches."""
    return name.endswith(("._mean", "._variance"))

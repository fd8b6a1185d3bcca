"""sharding stage 3's prefetch (``sharding_configs["prefetch_depth"]``) and units
(``unit_size_MB``): prefetching changes no result bit for bit, in both idioms and with a tied
weight, also when the guessed order is wrong; after the first step every gather but the step's
first was started ahead; at most ``prefetch_depth`` units more than without prefetch are alive
(tracemalloc); units join adjacent layers up to their size, by default a norm the layer beside
it."""
import tracemalloc

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.core import backend
from fleetmpi import nn, optimizer
import fleetmpi.nn.functional as F
from comm_support import equal, ok
from strategy_support import global_batch, make_mlp, make_strategy, shard
from test_sharding_stages import TiedNet
from test_user_model import train_user_model


def sharding(**configs):
    return make_strategy(sharding=True, sharding_configs=dict(configs, stage=3))


def adam(parameters):
    return optimizer.Adam(learning_rate=0.01, parameters=parameters)


def assert_same_bits(model, reference, losses, reference_losses):
    ok(losses == reference_losses, f"losses {losses} != {reference_losses}")
    expected = reference.state_dict()
    for name, value in model.state_dict().items():
        equal(value, expected[name], err_msg=name)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("idiom", ["dygraph", "minimize"])
@pytest.mark.parametrize("depth", [1, 3])
def test_prefetch_changes_no_result_bit_for_bit(idiom, depth):
    model, opt, losses = train_user_model(sharding(prefetch_depth=depth), idiom=idiom,
                                          skip="all", make_optimizer=adam)
    plain, _, plain_losses = train_user_model(sharding(), idiom=idiom, skip="all",
                                              make_optimizer=adam)
    assert_same_bits(model, plain, losses, plain_losses)
    gatherer = opt.strategies["sharding"].gatherer
    ok(gatherer.prefetch_depth == depth and gatherer.prefetched > 0,
       f"{gatherer.prefetched} units prefetched at depth {gatherer.prefetch_depth}")


def tied_steps(strategy, steps=3, width=32):
    """TiedNet with Adam, ``steps`` steps on this rank's part of a global batch; returns the
    losses, the model and, per step, the gatherer's ``(gathers, prefetched, dropped)``."""
    fleet.init(is_collective=True)
    rank, size = fleet.worker_index(), fleet.worker_num()
    backend.manual_seed(0)
    model = fleet.distributed_model(TiedNet(width=width, depth=4))
    opt = fleet.distributed_optimizer(adam(model.parameters()), strategy)
    gatherer = opt.strategies["sharding"].gatherer
    losses, counts = [], []
    for step in range(steps):
        x = shard(np.random.default_rng(step).standard_normal((4 * size, width)), rank, size)
        before = (gatherer.gathers, gatherer.prefetched, gatherer.dropped)
        loss = (model(x) ** 2).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss.numpy()))
        counts.append(tuple(now - then for now, then in zip(
            (gatherer.gathers, gatherer.prefetched, gatherer.dropped), before)))
    return losses, model, counts


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("depth", [1, 2])
def test_after_the_first_step_every_gather_but_the_first_was_started_ahead(depth):
    """A tied weight is gathered at both ends of forward and of backward: the recorded
    sequence has it twice, and the guess is right from the second step on."""
    losses, model, counts = tied_steps(sharding(prefetch_depth=depth))
    plain_losses, plain, plain_counts = tied_steps(sharding())
    assert_same_bits(model, plain, losses, plain_losses)
    for step, ((gathers, prefetched, dropped), (plain_gathers, _, _)) in enumerate(
            zip(counts, plain_counts)):
        if step == 0:
            continue
        ok(prefetched == gathers - 1 and dropped == 0,
           f"step {step}: {gathers} gathers, {prefetched} prefetched, {dropped} dropped")
        ok(gathers == plain_gathers, f"step {step}: {gathers} gathers, {plain_gathers} "
                                     f"without prefetch")


class Reordered(nn.Layer):
    """Linear layers run in an order that changes every step (the same on every rank): the
    order recorded in one step is a wrong guess for the next."""

    def __init__(self, width=16, depth=4):
        super().__init__()
        self.blocks = nn.LayerList([nn.Linear(width, width, dtype="float64")
                                    for _ in range(depth)])
        self.step = 0

    def forward(self, x):
        order = np.random.default_rng(self.step).permutation(len(self.blocks))
        self.step += 1
        for index in order:
            x = F.tanh(self.blocks[int(index)](x))
        return x


def reordered_steps(strategy, steps=4):
    fleet.init(is_collective=True)
    rank, size = fleet.worker_index(), fleet.worker_num()
    backend.manual_seed(0)
    model = fleet.distributed_model(Reordered())
    opt = fleet.distributed_optimizer(adam(model.parameters()), strategy)
    losses = []
    for step in range(steps):
        x = shard(np.random.default_rng(step).standard_normal((4 * size, 16)), rank, size)
        loss = opt.minimize(model, lambda out, y: ((out - y) ** 2).mean(), x, np.zeros_like(x))
        losses.append(float(loss))
    return losses, model, opt.strategies["sharding"].gatherer


@pytest.mark.mpi(min_size=2)
def test_a_wrong_guess_costs_gathers_and_no_bit():
    losses, model, gatherer = reordered_steps(sharding(prefetch_depth=2))
    plain_losses, plain, _ = reordered_steps(sharding())
    assert_same_bits(model, plain, losses, plain_losses)
    ok(gatherer.dropped > 0, "no prefetched unit was dropped although the order changed")


def traced_backward(depth, width=192, layers=8):
    """The most bytes one step (forward and backward) of an MLP of ``layers`` equal layers
    adds over what is alive before it, after two warm-up steps; and the bytes of a unit."""
    fleet.init(is_collective=True)
    rank, size = fleet.worker_index(), fleet.worker_num()
    backend.manual_seed(0)
    model = make_mlp(sizes=(width,) * (layers + 1))
    opt = fleet.distributed_optimizer(adam(model.parameters()), sharding(prefetch_depth=depth))
    gatherer = opt.strategies["sharding"].gatherer
    added = 0
    for step in range(3):
        x, y = global_batch(step, batch=2 * size, features=width, classes=width)
        x, y = shard(x, rank, size), shard(y, rank, size)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.clear_grad()
            del loss
            if step == 2:
                added = tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()
    unit_bytes = max((unit.stop - unit.start) * 8 for unit in gatherer.units)
    return added, unit_bytes, gatherer


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("depth", [1, 2])
def test_prefetch_keeps_at_most_depth_more_units_alive(depth):
    """Whole units alive at once: the one in use and ``depth`` in flight. The step's peak
    over what was alive before it exceeds the peak without prefetch by at most ``depth``
    units (and a little bookkeeping), never by the model."""
    added, unit_bytes, gatherer = traced_backward(depth)
    plain_added, _, _ = traced_backward(0)
    ok(gatherer.prefetched > 0, "nothing was prefetched")
    allowed = depth * unit_bytes + unit_bytes // 4
    ok(added - plain_added <= allowed,
       f"a step adds {added} bytes with prefetch_depth {depth}, {plain_added} without: more "
       f"than {depth} unit(s) of {unit_bytes} bytes apart")
    model_bytes = sum(unit.stop - unit.start for unit in gatherer.units) * 8
    ok(added < plain_added + model_bytes // 2, f"{added} bytes added, model {model_bytes}")


@pytest.mark.parametrize("unit_MB, layers_per_unit", [(0, 1), (0.2, 2), (100, 8)])
def test_units_join_adjacent_layers_up_to_unit_size_mb(unit_MB, layers_per_unit):
    """8 Linear layers of 96 x 96 float64 (about 0.07 MiB each with the bias): one a unit
    by default (each is the largest), two within 0.2 MiB, all within 100 MiB; training is
    bit for bit the same."""
    def run(configs):
        fleet.init(is_collective=True)
        backend.manual_seed(0)
        model = make_mlp(sizes=(96,) * 9)
        opt = fleet.distributed_optimizer(adam(model.parameters()), sharding(**configs),
                                          local=True)
        for step in range(2):
            x, y = global_batch(step, batch=4, features=96, classes=96)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.clear_grad()
        return model, opt.strategies["sharding"].gatherer
    model, gatherer = run({"unit_size_MB": unit_MB})
    plain, plain_gatherer = run({})
    ok(len(plain_gatherer.units) == 8, f"{len(plain_gatherer.units)} units of 8 layers")
    ok(len(gatherer.units) == 8 // layers_per_unit,
       f"{len(gatherer.units)} units at unit_size_MB {unit_MB}")
    limit = max(unit_MB * 2 ** 20, max(u.stop - u.start for u in plain_gatherer.units) * 8)
    for unit in gatherer.units:
        ok((unit.stop - unit.start) * 8 <= limit, f"unit {unit.index} over {limit} bytes")
    expected = plain.state_dict()
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


class NormedNet(nn.Layer):
    """4 Linear 64 x 64 layers, each followed by a LayerNorm (0.5% of its size)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.LayerList([nn.Linear(64, 64, dtype="float64") for _ in range(4)])
        self.norms = nn.LayerList([nn.LayerNorm(64, dtype="float64") for _ in range(4)])

    def forward(self, x):
        for block, norm in zip(self.blocks, self.norms):
            x = norm(F.relu(block(x)))
        return x


@pytest.mark.mpi(min_size=2)
def test_by_default_a_norm_joins_the_layer_beside_it():
    """unit_size_MB 0: every LayerNorm joins a Linear, no unit is over the largest layer and
    an eighth, and training is bit for bit that of one layer a unit."""
    def run(configs):
        fleet.init(is_collective=True)
        rank, size = fleet.worker_index(), fleet.worker_num()
        backend.manual_seed(0)
        model = fleet.distributed_model(NormedNet())
        opt = fleet.distributed_optimizer(adam(model.parameters()), sharding(**configs))
        for step in range(2):
            x = shard(np.random.default_rng(step).standard_normal((4 * size, 64)), rank, size)
            (model(x) ** 2).mean().backward()
            opt.step()
            opt.clear_grad()
        return model, opt.strategies["sharding"].gatherer
    model, gatherer = run({})
    layered, layer_gatherer = run({"unit_size_MB": 1e-6})
    ok(len(layer_gatherer.units) == 8 and len(gatherer.units) == 4,
       f"{len(gatherer.units)} units by default, {len(layer_gatherer.units)} one layer a unit")
    largest = max(u.stop - u.start for u in layer_gatherer.units)
    ok(all(u.stop - u.start <= largest * 9 / 8 for u in gatherer.units),
       f"a unit over {largest * 9 / 8} elements")
    expected = layered.state_dict()
    for name, value in model.state_dict().items():
        equal(value, expected[name], err_msg=name)


@pytest.mark.parametrize("key, value, allowed", [("prefetch_depth", -1, r"\[0, inf\)"),
                                                 ("unit_size_MB", -1.0, r"\[0, inf\)")])
def test_a_negative_depth_or_unit_size_is_refused_naming_it(key, value, allowed):
    strategy = fleet.DistributedStrategy()
    with pytest.raises(ValueError, match=rf"{key}'\] = {value}.*allowed: .*{allowed}"):
        strategy.sharding_configs = {key: value}

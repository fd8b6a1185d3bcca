"""``LazyGuard`` with sharding: under stage 3 each rank produces only its shard of a model built
under the guard, equal bit for bit to the slice of the model built whole from the same seed;
every stage trained from such a model equals data parallel (Momentum and Adam, a shared weight,
an unused branch, both idioms); no optimizer of stages 1 to 3 allocates the whole state; a
model without values says which parameter and what to do; anything but stage 3 materialises
the whole model and says so; without the guard, stage 3 frees the whole values as before."""
import gc
import tracemalloc

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.core import backend
from fleetmpi import nn, optimizer
from fleetmpi.nn import initializer, lazy
from comm_support import equal, ok
from strategy_support import FEATURES, make_strategy
from test_sharding_stages import OPTIMIZERS, assert_models_close, sharding
from test_user_model import UserNet, train_user_model


class EveryInitializer(nn.Layer):
    """A parameter from every kind of initializer: the built-in ones (uniform draws jump,
    normal draws are drawn to move past them), a callable of the user's and an array; one
    weight is used twice in forward."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(40, 12, dtype="float64")
        self.fc = nn.Linear(12, 30, dtype="float64")
        kinds = [initializer.Normal(0.5, 2.0), initializer.Uniform(-3.0, 1.0),
                 initializer.XavierNormal(), initializer.KaimingNormal(),
                 initializer.Constant(0.25)]
        for index, kind in enumerate(kinds):
            setattr(self, f"w{index}", self.create_parameter([30, 7 + index], dtype="float64",
                                                             default_initializer=kind))
        self.own = self.create_parameter(
            [5, 6], dtype="float64",
            default_initializer=lambda shape: backend.shared_rng().standard_normal(shape) * 3)
        self.given = self.create_parameter([9], dtype="float64",
                                           default_initializer=np.arange(9.0) / 7)
        self.head = nn.Linear(30, 3, dtype="float64")


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of a few elements, so that every parameter is produced in many of them."""
    monkeypatch.setattr(lazy, "CHUNK", 7)
    monkeypatch.setattr(initializer, "SKIP_CHUNK", 5)


def whole_space(model):
    """The flat values of ``model`` built whole: its one buffer, in the optimizer's order."""
    (buffer,) = model.flat_buffers()
    return backend.to_numpy(buffer.data).copy()


def lazy_stage3(build, stage=3, local=False):
    """``build()`` under LazyGuard from seed 0, through distributed_model and a sharded Adam;
    returns ``(model, distributed optimizer, shared generator state after building)``."""
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    with fleet.LazyGuard():
        model = build()
    after = backend.shared_rng().bit_generator.state
    model = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(OPTIMIZERS["adam"](model.parameters()), sharding(stage),
                                      local=local)
    return model, opt, after


def small_gpt():
    """GPT-2's initial weights are drawn again after the layers are built (a second
    initializer per weight)."""
    return nn.GPT(vocab_size=40, block_size=8, n_layer=2, n_head=2, n_embd=12,
                  dtype="float64")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("build", [EveryInitializer, small_gpt])
def test_stage_3_shards_are_slices_of_a_whole_init_bit_for_bit(small_pieces, build):
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    whole = build()
    expected, expected_after = whole_space(whole), backend.shared_rng().bit_generator.state
    model, opt, after = lazy_stage3(build)
    start, stop = opt.strategies["sharding"].shard
    equal(backend.to_numpy(opt.inner.shard_parameters), expected[start:stop])
    ok(after == expected_after, "the guard left the shared generator elsewhere")
    ok(all(buffer.data is None for buffer in model.flat_buffers()), "a whole buffer exists")
    ok(opt.inner.state_nbytes() == 2 * (stop - start) * 8, "Adam state is not the shard's")
    reference = whole.state_dict()
    for name, value in model.state_dict().items():
        equal(value, reference[name], err_msg=name)


def test_gpt_weights_drawn_again_under_the_guard_keep_no_values():
    """GPT's second initializer of each weight is recorded, not drawn whole and kept."""
    backend.manual_seed(0)
    with fleet.LazyGuard():
        model = small_gpt()
    kept = [p.name for p in model.parameters()
            if not isinstance(p.deferred_init.initializer, initializer.Initializer)]
    ok(not kept, f"parameters built under the guard hold arrays: {kept}")


def test_one_process_stage_3_materialises_the_whole_init_bit_for_bit(small_pieces):
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    expected = whole_space(EveryInitializer())
    _, opt, _ = lazy_stage3(EveryInitializer, local=True)
    np.testing.assert_array_equal(backend.to_numpy(opt.inner.shard_parameters), expected)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", (1, 2, 3))
@pytest.mark.parametrize("idiom", ["dygraph", "minimize"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_stage_from_a_lazy_model_equals_data_parallel(stage, idiom, name):
    """UserNet: a weight used twice, a branch never taken, a parameter of create_parameter."""
    model, _, _ = train_user_model(sharding(stage), idiom=idiom, skip="all", lazy=True,
                                   make_optimizer=OPTIMIZERS[name])
    data_parallel, _, _ = train_user_model(idiom=idiom, skip="all",
                                           make_optimizer=OPTIMIZERS[name])
    assert_models_close(model, data_parallel)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", (1, 2, 3))
def test_no_stage_allocates_the_whole_optimizer_state(stage, monkeypatch):
    """From building Adam to the end of distributed_optimizer, on a model built whole
    beforehand, no array of the parameter space's length is allocated (each of Adam's two
    moments of the whole space would be one); the state held is the shard's."""
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    model = fleet.distributed_model(nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)]))
    (buffer,) = model.flat_buffers()
    lengths = []
    for name in ("zeros", "empty"):
        allocate = getattr(np, name)
        monkeypatch.setattr(np, name, lambda shape, *args, _allocate=allocate, **kwargs: (
            lengths.append(int(np.prod(shape))) or _allocate(shape, *args, **kwargs)))
    opt = fleet.distributed_optimizer(OPTIMIZERS["adam"](model.parameters()), sharding(stage))
    monkeypatch.undo()
    start, stop = opt.strategies["sharding"].shard
    ok(opt.inner.state_nbytes() == 2 * (stop - start) * 4, "the state is not the shard's")
    ok(lengths and max(lengths) < buffer.size,
       f"an array of {max(lengths)} elements, the space has {buffer.size}")


def test_a_model_without_values_names_the_parameter_and_what_to_do():
    fleet.init(is_collective=True)
    with fleet.LazyGuard():
        model = UserNet()
    named = dict(model.named_parameters())
    ok(not any(p.materialized for p in named.values()))
    ok(all(p.grad is None for p in named.values()), "a lazy parameter has a gradient")
    x = np.ones((2, FEATURES))
    with pytest.raises(lazy.NotMaterializedError,
                       match=r"parameter 'embed\.weight' of a Linear was built under LazyGuard"
                             r".*fleet\.distributed_optimizer"):
        model(x)
    with pytest.raises(lazy.NotMaterializedError, match="'gain' of a UserNet"):
        named["gain"].values()
    with pytest.raises(lazy.NotMaterializedError, match="'gain'"):
        model.state_dict()
    with fleet.LazyGuard():
        unnamed = nn.Linear(3, 4)
    with pytest.raises(lazy.NotMaterializedError, match=r"parameter of shape \[3, 4\]"):
        unnamed(np.ones((1, 3), np.float32))


@pytest.mark.parametrize("strategy", [None, sharding(1), sharding(2),
                                      make_strategy(gradient_merge=True)])
def test_without_stage_3_a_lazy_model_is_materialised_whole_and_says_so(strategy,
                                                                       fleetmpi_warnings):
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    expected = EveryInitializer().state_dict()
    backend.manual_seed(0)
    with fleet.LazyGuard():
        model = EveryInitializer()
    fleet.distributed_optimizer(optimizer.SGD(parameters=model.parameters()), strategy,
                                local=True)
    messages = fleetmpi_warnings()
    assert any("materialised whole" in m and "sharding stage 3" in m for m in messages), messages
    assert all(p.materialized for p in model.parameters())
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_set_value_under_the_guard_sets_the_initial_values():
    with fleet.LazyGuard():
        layer = nn.Linear(3, 2, dtype="float64")
    layer.weight.set_value(np.arange(6.0).reshape(3, 2))
    lazy.materialize(layer.parameters())
    np.testing.assert_array_equal(layer.weight.numpy(), np.arange(6.0).reshape(3, 2))


def test_a_parameter_built_outside_the_guard_keeps_its_values_in_a_lazy_buffer():
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    with fleet.LazyGuard():
        model = nn.Sequential(nn.Linear(4, 4))
    model.extra = nn.Linear(4, 2)
    values = model.extra.weight.numpy().copy()
    _, opt, _ = lazy_stage3(lambda: model, local=True)
    np.testing.assert_array_equal(model.state_dict()["extra.weight"], values)


def largest_block_alive():
    """The bytes of the largest allocation ``tracemalloc`` traces now (NumPy's arrays among
    them), after a collection, and where it was made."""
    gc.collect()
    traces = tracemalloc.take_snapshot().traces
    largest = max(traces, key=lambda trace: trace.size)
    return largest.size, str(largest.traceback)


@pytest.mark.mpi(min_size=2)
def test_without_the_guard_stage_3_still_frees_the_whole_values():
    """The model is built whole and broadcast, then sharded: after distributed_optimizer and
    after each step no allocation of the whole model's size is alive anywhere in the process
    (a reference kept by the model, the optimizer, the strategies or the communicators)."""
    fleet.init(is_collective=True)
    backend.manual_seed(0)
    rank, size = fleet.worker_index(), fleet.worker_num()
    tracemalloc.start()
    try:
        model = fleet.distributed_model(nn.Sequential(*[nn.Linear(96, 96, dtype="float64")
                                                        for _ in range(4)]))
        (buffer,) = model.flat_buffers()
        whole = buffer.size * 8
        opt = fleet.distributed_optimizer(OPTIMIZERS["adam"](model.parameters()), sharding(3))
        ok(all(b.data is None for b in model.flat_buffers()), "a whole buffer is alive")
        held = [largest_block_alive()]
        for step in range(2):
            x = np.random.default_rng([step, rank]).standard_normal((4, 96))
            loss = (model(x) ** 2).mean()
            loss.backward()
            opt.step()
            opt.clear_grad()
            del loss
            held.append(largest_block_alive())
    finally:
        tracemalloc.stop()
    for moment, (nbytes, where) in zip(("after distributed_optimizer", "after step 1",
                                        "after step 2"), held):
        ok(nbytes < whole / size + 4096,
           f"{moment}: an allocation of {nbytes} bytes is alive (the whole model is {whole}, "
           f"a shard {whole // size}), made at {where}")


def test_a_bad_initializer_shape_is_refused_under_the_guard_naming_both():
    class Wrong(nn.Layer):
        def __init__(self):
            super().__init__()
            self.w = self.create_parameter([2, 3], default_initializer=np.zeros((3, 2)))

    with fleet.LazyGuard(), pytest.raises(ValueError, match=r"shape \(3, 2\) for a parameter of "
                                                      r"shape \(2, 3\)"):
        Wrong()

"""``fleet.meta_parallel``: Paddle's names and argument names, ``ParallelCrossEntropy``'s
per-token losses, the RNG state tracker, and dropout under tensor parallelism: the ranks of a
model-parallel group draw their own masks inside ``rng_state()`` and the same masks outside it
(at 2 ranks mp2 and 4 ranks dp2 x mp2)."""
import inspect

import numpy as np
import pytest

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from fleetmpi.core import backend
from fleetmpi import nn, to_tensor
from fleetmpi.autograd.recompute import recompute
from fleetmpi.meta_parallel import get_rng_state_tracker, model_parallel_random_seed
from comm_support import equal, host, ok
from strategy_support import make_strategy

# Paddle's leading arguments (python/paddle/distributed/fleet/layers/mpu/mp_layers.py)
PADDLE_ARGUMENTS = {
    "ColumnParallelLinear": ["in_features", "out_features", "weight_attr", "has_bias",
                             "gather_output", "fuse_matmul_bias", "mp_group", "name"],
    "RowParallelLinear": ["in_features", "out_features", "weight_attr", "has_bias",
                          "input_is_parallel", "fuse_matmul_bias", "mp_group", "name"],
    "VocabParallelEmbedding": ["num_embeddings", "embedding_dim", "weight_attr", "mp_group",
                               "name"],
    "ParallelCrossEntropy": ["mp_group", "name"],
}


@pytest.mark.parametrize("name", sorted(PADDLE_ARGUMENTS))
def test_meta_parallel_has_paddles_layers_with_paddles_arguments(name):
    layer = getattr(fleet.meta_parallel, name)
    assert layer is getattr(nn, name)
    arguments = list(inspect.signature(layer).parameters)
    assert arguments[:len(PADDLE_ARGUMENTS[name])] == PADDLE_ARGUMENTS[name]


def test_column_parallel_linear_has_no_bias_unless_asked_as_in_paddle():
    assert nn.ColumnParallelLinear(4, 6).bias is None
    assert nn.ColumnParallelLinear(4, 6, has_bias=True).bias.shape == [6]
    assert nn.RowParallelLinear(4, 6).bias.shape == [6]
    assert nn.ColumnParallelLinear(4, 6, fuse_matmul_bias=True, name="qkv").full_name() == "qkv"
    with pytest.raises(ValueError, match="fuse_matmul_bias must be True or False, not 'yes'"):
        nn.RowParallelLinear(4, 6, fuse_matmul_bias="yes")


def test_parallel_cross_entropy_returns_each_tokens_loss_as_paddle():
    logits = np.random.default_rng(0).standard_normal((2, 3, 7))
    labels = np.random.default_rng(1).integers(0, 7, (2, 3))
    want = host(F.cross_entropy(logits, labels, reduction="none"))
    for given in (labels, labels[..., None]):
        got = fleet.meta_parallel.ParallelCrossEntropy()(to_tensor(logits), given)
        assert tuple(got.shape) == (2, 3, 1)
        np.testing.assert_allclose(host(got)[..., 0], want, rtol=1e-12)
    mean = nn.ParallelCrossEntropy(reduction="mean")(to_tensor(logits), labels)
    np.testing.assert_allclose(float(mean), want.mean(), rtol=1e-12)


@pytest.fixture
def tracker():
    tracker = get_rng_state_tracker()
    saved = dict(tracker.generators), dict(tracker._seeds)
    tracker.reset()
    yield tracker
    tracker.generators, tracker._seeds = saved


def test_tracker_add_refuses_a_name_or_seed_twice_and_an_unknown_state(tracker):
    tracker.add("local_seed", 7)
    with pytest.raises(ValueError, match="RNG state 'local_seed' already exists"):
        tracker.add("local_seed", 8)
    with pytest.raises(ValueError, match="seed 7 is already the seed of RNG state 'local_seed'"):
        tracker.add("global_seed", 7)
    with pytest.raises(ValueError, match="must be a non-negative integer, not -1"):
        tracker.add("global_seed", -1)
    with pytest.raises(ValueError, match="RNG state 'model_parallel_rng' does not exist .*"
                                         "model_parallel_random_seed"):
        with tracker.rng_state():
            pass


def dropout_mask(shape=(6, 40)):
    return host(F.dropout(to_tensor(np.ones(shape)), 0.5)) != 0


def test_dropout_inside_the_tracker_draws_from_its_state_and_leaves_the_rank_generator(tracker):
    backend.manual_seed(3)
    outside = dropout_mask(), dropout_mask()
    backend.manual_seed(3)
    tracker.add("model_parallel_rng", 11)
    first = dropout_mask()
    with tracker.rng_state():
        inside = dropout_mask()
    assert not np.array_equal(inside, first)
    np.testing.assert_array_equal(first, outside[0])
    np.testing.assert_array_equal(dropout_mask(), outside[1])   # the rank generator untouched
    states = tracker.get_states_tracker()
    with tracker.rng_state("model_parallel_rng"):
        again = dropout_mask()
    tracker.set_states_tracker(states)
    with tracker.rng_state("model_parallel_rng"):
        np.testing.assert_array_equal(dropout_mask(), again)


def test_model_parallel_random_seed_reseeds_and_adds_the_model_parallel_state(tracker):
    model_parallel_random_seed(5)
    assert backend.get_seed() == 5
    assert sorted(tracker.generators) == ["model_parallel_rng"]
    with tracker.rng_state():
        first = dropout_mask()
    model_parallel_random_seed(5)
    with tracker.rng_state():
        np.testing.assert_array_equal(dropout_mask(), first)


class TrackedDropout(nn.Layer):
    """A Linear whose output is dropped inside the tracker's state (a split activation)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 32)

    def forward(self, x):
        with get_rng_state_tracker().rng_state():
            return F.dropout(self.fc(x), 0.5)


def test_recompute_replays_the_tracker_draws(tracker):
    x = np.random.default_rng(2).standard_normal((4, 5))
    grads = []
    for wrap in (False, True):
        model_parallel_random_seed(9)
        layer = TrackedDropout()
        out = recompute(layer, to_tensor(x)) if wrap else layer(to_tensor(x))
        out.sum().backward()
        grads.append(host(layer.fc.weight.grad).copy())
    np.testing.assert_array_equal(grads[1], grads[0])


def gathered(mask):
    from mpi4py import MPI

    return MPI.COMM_WORLD.allgather(mask)


def check_masks_over_the_layout(mp_degree):
    """On every rank: outside the tracker the ranks of one model-parallel group draw the same
    mask (and the groups differ), inside it each rank of a group draws its own."""
    rank, size = fleet.worker_index(), fleet.worker_num()
    strategy = make_strategy(hybrid_configs={"mp_degree": mp_degree})
    fleet.init(is_collective=True, strategy=strategy)
    backend.manual_seed(0)
    replicated = gathered(dropout_mask())
    with get_rng_state_tracker().rng_state():
        split = gathered(dropout_mask())
    group = [r for r in range(size) if r // mp_degree == rank // mp_degree]
    for other in group:
        equal(replicated[other], replicated[rank], err_msg=f"rank {rank} vs {other}, outside")
        ok(other == rank or not np.array_equal(split[other], split[rank]),
           f"rank {rank} and {other} drew one mask inside the tracker")
    others = [r for r in range(size) if r not in group]
    ok(all(not np.array_equal(replicated[r], replicated[rank]) for r in others),
       "two data-parallel replicas drew one mask")
    fleet.init(is_collective=True, strategy=fleet.DistributedStrategy())


@pytest.mark.mpi(min_size=2)
def test_dropout_masks_at_mp2():
    fleet.init(is_collective=True)
    if fleet.worker_num() != 2:
        pytest.skip("the mp2 layout takes 2 ranks")
    check_masks_over_the_layout(2)


@pytest.mark.mpi(min_size=4)
def test_dropout_masks_at_dp2_mp2():
    fleet.init(is_collective=True)
    if fleet.worker_num() != 4:
        pytest.skip("the dp2 x mp2 layout takes 4 ranks")
    check_masks_over_the_layout(2)


@pytest.mark.mpi(min_size=2)
def test_gpt_with_dropout_keeps_the_replicated_activations_equal_over_the_group():
    """A tensor-parallel GPT with dropout trains: the hidden state after each block (whole on
    every rank of the group) is the same on every rank, the attention's own heads having
    been dropped with each rank's masks."""
    fleet.init(is_collective=True)
    size = fleet.worker_num()
    if size not in (2, 4):
        pytest.skip("mp_degree 2 over 2 or 4 ranks")
    fleet.init(is_collective=True, strategy=make_strategy(hybrid_configs={"mp_degree": 2}))
    backend.manual_seed(1)
    model = nn.GPT(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, dropout=0.3)
    ids = np.random.default_rng(fleet.worker_index() // 2).integers(0, 16, (2, 8))
    hidden = model.drop(model.wte(ids) + model.wpe(np.arange(8)))
    for block in model.blocks:
        hidden = block(hidden)
    mine = host(hidden)
    everyone = gathered(mine)
    for other in range(size):
        if other // 2 == fleet.worker_index() // 2:
            equal(everyone[other], mine, err_msg=f"rank {other}'s hidden state")
    loss = nn.ParallelCrossEntropy(reduction="mean")(model(ids[:, :-1]), ids[:, 1:])
    loss.backward()
    ok(np.isfinite(float(loss)))
    fleet.init(is_collective=True, strategy=fleet.DistributedStrategy())


class TinyParallelNet(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc = fleet.meta_parallel.ColumnParallelLinear(4, 8, has_bias=True,
                                                          gather_output=False)
        self.out = fleet.meta_parallel.RowParallelLinear(8, 3, input_is_parallel=True)

    def forward(self, x):
        return self.out(F.relu(self.fc(x)))


def train_tiny(strategy_for_optimizer, steps=2):
    backend.manual_seed(2)
    model = fleet.distributed_model(TinyParallelNet())
    opt = fleet.distributed_optimizer(
        fleet.optimizer.Momentum(learning_rate=0.1, momentum=0.9,
                                 parameters=model.parameters()),
        *strategy_for_optimizer)
    rng = np.random.default_rng(fleet.worker_index() // 2)
    for _ in range(steps):
        x, y = rng.standard_normal((4, 4)), rng.integers(0, 3, 4)
        loss = F.cross_entropy(model(to_tensor(x)), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
    return opt, host(model.out.weight.numpy()).copy()


@pytest.mark.mpi(min_size=2)
def test_distributed_optimizer_without_a_strategy_runs_the_one_given_to_init():
    """As in Paddle: fleet.init(is_collective=True, strategy=...) with mp_degree 2, then
    distributed_model(model) and distributed_optimizer(opt) with no strategy train exactly as
    with the strategy passed again."""
    fleet.init(is_collective=True)
    if fleet.worker_num() not in (2, 4):
        pytest.skip("mp_degree 2 over 2 or 4 ranks")
    strategy = make_strategy(hybrid_configs={"mp_degree": 2}, gradient_merge=True,
                             gradient_merge_configs={"k_steps": 2})
    fleet.init(is_collective=True, strategy=strategy)
    opt, implied = train_tiny(())
    ok(opt.strategy.gradient_merge and opt.hybrid is not None,
       "distributed_optimizer did not take fleet.init's strategy")
    fleet.init(is_collective=True, strategy=strategy)
    _, given = train_tiny((strategy,))
    equal(implied, given)
    strategy.gradient_merge = False         # the strategy init kept is a copy, as Paddle's
    ok(fleet.world.init_strategy().gradient_merge, "fleet.init kept the caller's object")

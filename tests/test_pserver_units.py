"""Parameter-server pieces on one process: the block plan, the message codec,
the mode a strategy selects, the shard files, and sparse lookups on the tape."""
import os

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi import nn, no_grad
from fleetmpi.config.schema_view import ConfigError
from fleetmpi.strategies import field_effects
from fleetmpi.strategies.ps import blocks, mode, shards, wire


def test_block_plan_splits_large_parameters_and_balances_servers():
    sizes = [64 * 160, 160, 160 * 4, 4, 100_000]
    plan = blocks.plan_blocks(sizes, 3)
    for index, size in enumerate(sizes):
        mine = [b for b in plan if b.param == index]
        # the blocks of a parameter tile it exactly, and never more blocks than servers
        assert mine[0].start == 0 and mine[-1].stop == size
        assert all(a.stop == b.start for a, b in zip(mine, mine[1:]))
        assert len(mine) == min(3, -(-size // blocks.MIN_BLOCK_SIZE))
    big = [b for b in plan if b.param == 4]
    assert sorted(b.server for b in big) == [0, 1, 2]
    load = [sum(b.size for b in plan if b.server == s) for s in range(3)]
    assert max(load) - min(load) <= max(b.size for b in plan)


def test_rows_go_to_servers_by_id_modulo():
    ids = np.array([0, 1, 2, 3, 4, 5, 9_999_999])
    assert blocks.row_owner(ids, 2).tolist() == [0, 1, 0, 1, 0, 1, 1]
    assert blocks.local_rows(ids, 2).tolist() == [0, 0, 1, 1, 2, 2, 4_999_999]
    assert blocks.shard_rows(10_000_000, 1, 2) == 5_000_000
    assert blocks.shard_rows(7, 0, 3) == 3 and blocks.shard_rows(7, 2, 3) == 2
    parts = dict(blocks.split_by_owner(ids, 2))
    assert ids[parts[1]].tolist() == [1, 3, 5, 9_999_999]


def test_message_codec_round_trips_every_dtype():
    arrays = [np.arange(5, dtype=np.int64), np.linspace(0, 1, 3, dtype=np.float32),
              np.array([1.5, -2.0], dtype=np.float64), np.ones(3, np.float16),
              wire.text_array("dir/ü"), np.zeros(0, np.float64)]
    data = wire.encode(wire.Kind.PUSH, arrays, step=7, version=-3, extra=11, lr=0.125)
    message = wire.decode(data, source=2)
    assert (message.kind, message.step, message.version, message.extra, message.lr,
            message.source) == (wire.Kind.PUSH, 7, -3, 11, 0.125, 2)
    for got, want in zip(message.arrays, arrays):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    assert wire.decode(wire.encode(wire.Kind.ERROR, [wire.text_array("dir/ü")])).text() == "dir/ü"
    with pytest.raises(TypeError, match="cannot carry dtype complex128"):
        wire.encode(wire.Kind.PUSH, [np.zeros(2, np.complex128)])


def strategy(a_sync, k_steps=-1, **fields):
    s = fleet.DistributedStrategy()
    s.a_sync = a_sync
    s.a_sync_configs = {"k_steps": k_steps}
    for name, value in fields.items():
        setattr(s, name, value)
    return s


def test_mode_follows_a_sync_and_k_steps():
    assert mode.training_mode(strategy(False)) == mode.SYNC
    assert mode.training_mode(strategy(True, -1)) == mode.ASYNC
    assert mode.training_mode(strategy(True, 0)) == mode.ASYNC
    assert mode.training_mode(strategy(True, 3)) == mode.GEO
    with pytest.raises(ConfigError, match="k_steps=3 selects GEO.*needs a_sync=True"):
        mode.training_mode(strategy(False, 3))
    with pytest.raises(ConfigError, match=r"collective strategies \['amp'\]"):
        mode.training_mode(strategy(True, amp=True))


def test_every_a_sync_configs_key_is_effective_or_listed_without_effect():
    keys = set(fleet.DistributedStrategy().a_sync_configs)
    assert keys == set(field_effects.EFFECTIVE_KEYS) | set(field_effects.NO_EFFECT_KEYS)
    assert not set(field_effects.EFFECTIVE_KEYS) & set(field_effects.NO_EFFECT_KEYS)


def test_keys_without_effect_are_listed_and_reported_once(caplog):
    from fleetmpi.strategies import applied, inert_fields

    s = strategy(True, 0)
    s.a_sync_configs = {"send_queue_size": 4, "thread_pool_size": 2}
    s.amp_configs = {"init_loss_scaling": 8.0}
    reasons = applied.parameter_server_not_applied(s, on_gpu=False)
    why = field_effects.NO_EFFECT_KEYS
    assert reasons == {"a_sync_configs.send_queue_size": why["send_queue_size"],
                       "a_sync_configs.thread_pool_size": why["thread_pool_size"],
                       "amp_configs.init_loss_scaling": applied._PARAMETER_SERVER}
    inert_fields._reported.difference_update(reasons)
    fleet_logger = inert_fields.logger
    fleet_logger.propagate = True
    try:
        with caplog.at_level("WARNING", logger="fleetmpi"):
            report = applied.AppliedStrategy.of(s, ["parameter_server (async)"], reasons)
            applied.report(report)
            after_first = len(caplog.records)
            applied.report(report)
            assert len(caplog.records) == after_first   # nothing new the second time
    finally:
        fleet_logger.propagate = False
    lines = {r.getMessage() for r in caplog.records}
    assert len(lines) == 3
    assert any("a_sync_configs.send_queue_size" in line for line in lines)
    assert any("a_sync_configs.thread_pool_size" in line for line in lines)


def test_shard_files_are_replaced_whole_and_read_without_pickle(tmp_path):
    arrays = {"block.0": np.arange(4.0), "table.0": np.ones((3, 2), np.float32)}
    path = shards.save_shard(str(tmp_path), 1, 2, arrays, {"server": 1, "version": 5})
    assert os.path.basename(path) == "server-1-of-2.npz"
    assert os.listdir(tmp_path) == ["server-1-of-2.npz"]   # no partial file left behind
    loaded, meta = shards.load_shard(str(tmp_path), 1, 2)
    assert meta == {"server": 1, "version": 5}
    np.testing.assert_array_equal(loaded["table.0"], arrays["table.0"])
    with pytest.raises(FileNotFoundError, match="no shard .*server-0-of-3.npz.*same number"):
        shards.load_shard(str(tmp_path), 0, 3)


class RowSource:
    """A ``SparseTable`` source serving the rows of a dense array, as a worker's client
    serves the servers' rows; ``asked`` records the ids of every request."""

    def __init__(self, rows):
        self.rows = rows
        self.asked = []

    def lookup(self, table, ids):
        self.asked.append(ids.tolist())
        return self.rows[ids]


def test_sparse_lookups_are_recorded_and_accumulate_as_a_dense_embedding_does():
    """A table looked up twice in one forward (repeated ids in each lookup): each lookup asks
    for its distinct ids once, and backward leaves exactly the dense Embedding's gradient rows
    for the ids touched, summed over both lookups."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((10, 3))
    ids_a, ids_b = np.array([[1, 4, 4], [7, 1, 0]]), np.array([4, 9])
    weight_a, weight_b = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))
    sparse = nn.Embedding(10, 3, dtype="float64", sparse=True)
    source = sparse.table.source = RowSource(rows)
    dense = nn.Embedding(10, 3, dtype="float64")
    dense.weight.set_value(rows)
    for layer in (sparse, dense):
        loss = (layer(ids_a).sum(axis=1) * weight_a).sum() + (layer(ids_b) * weight_b).sum()
        loss.backward()
    assert source.asked == [[0, 1, 4, 7], [4, 9]]
    touched = [0, 1, 4, 7, 9]
    assert sparse.table.grad_ids.tolist() == touched
    np.testing.assert_allclose(sparse.table.grad_values, dense.weight.grad.numpy()[touched],
                               rtol=1e-14, atol=1e-14)
    untouched = np.setdiff1d(np.arange(10), touched)
    assert not dense.weight.grad.numpy()[untouched].any()
    sparse.table.clear_gradient()
    assert sparse.table.grad_ids is None and sparse.table.grad_values is None


def test_sparse_lookup_outside_recording_or_without_servers():
    """Under no_grad a lookup records nothing (no gradient will come back); a table with no
    source says how to get one."""
    table_layer = nn.Embedding(10, 3, dtype="float64", sparse=True)
    with pytest.raises(RuntimeError, match="keeps its rows on the parameter servers"):
        table_layer(np.array([1, 2]))
    table_layer.table.source = RowSource(np.arange(30.0).reshape(10, 3))
    with no_grad():
        out = table_layer(np.array([[3, 3]]))
    assert out.stop_gradient and out.is_leaf
    np.testing.assert_array_equal(out.numpy(), [[[9.0, 10.0, 11.0], [9.0, 10.0, 11.0]]])
    assert table_layer.table.grad_ids is None

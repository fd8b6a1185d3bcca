"""The planner's hybrid layouts: tensor-parallel all-reduces, pipeline bubble, sharded
optimizer state, the links each axis uses, the ranking and the command line."""
import math

import pytest

from fleetmpi.plan import GPU, Cluster, preset
from fleetmpi.plan import costs
from fleetmpi.plan.__main__ import main
from fleetmpi.plan.hybrid import (ADAM_STATE_BYTES, Layout, Transformer, layouts,
                                  predict_layout, rank_layouts)

MODEL = Transformer(n_layer=4, n_embd=64, n_head=4, vocab_size=128, seq=16)
CLUSTER = Cluster(4, preset("nvlink"), preset("ib100"), GPU)
FLOPS = 1e12


def test_parameter_count_of_a_gpt():
    h = MODEL.n_embd
    per_block = (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h) + 4 * h
    assert MODEL.block_params == per_block
    assert MODEL.params == 4 * per_block + (128 + 16) * h + 2 * h


def test_tensor_parallel_is_four_activation_allreduces_per_block():
    micro_batches, batch = 2, 8
    p = predict_layout(MODEL, Layout(mp=2), CLUSTER, batch, micro_batches, FLOPS)
    activation = batch // micro_batches * MODEL.seq * MODEL.n_embd * 4
    link = CLUSTER.intra
    # one ring allreduce of two ranks by hand: a reduce-scatter step (one chunk) and the
    # mean of the owned half, then one allgather step
    half = activation / 2
    ring = (link.alpha + half * link.beta + half * GPU.gamma) + half * GPU.gamma \
        + (link.alpha + half * link.beta)
    assert ring == pytest.approx(costs.ring_allreduce(activation, 2, link, GPU.gamma))
    assert p.tensor_parallel_s == pytest.approx(micro_batches * MODEL.n_layer * 4 * ring)
    assert p.pipeline_s == 0 and p.data_parallel_s == 0
    assert p.step_s == pytest.approx(p.compute_s + p.tensor_parallel_s)
    serial = predict_layout(MODEL, Layout(), CLUSTER, batch, micro_batches, FLOPS)
    assert p.compute_s == pytest.approx(serial.compute_s / 2)


def test_model_parallel_beyond_a_node_crosses_the_network():
    inside = predict_layout(MODEL, Layout(mp=4), CLUSTER, 8, 1, FLOPS)
    wide = Cluster(2, preset("nvlink"), preset("ib100"), GPU)
    across = predict_layout(MODEL, Layout(mp=4), wide, 8, 1, FLOPS)
    activation = 8 * MODEL.seq * MODEL.n_embd * 4
    for p, link in ((inside, CLUSTER.intra), (across, wide.inter)):
        assert p.tensor_parallel_s == pytest.approx(
            4 * MODEL.n_layer * costs.ring_allreduce(activation, 4, link, GPU.gamma))
    assert across.tensor_parallel_s > inside.tensor_parallel_s


def test_pipeline_bubble_is_stages_minus_one_stage_times():
    micro_batches = 4
    p = predict_layout(MODEL, Layout(pp=2), CLUSTER, 8, micro_batches, FLOPS)
    stage = p.compute_s / micro_batches
    link = CLUSTER.intra
    activation = 8 // micro_batches * MODEL.seq * MODEL.n_embd * 4
    sends = (micro_batches + 1) * 2 * (link.alpha + activation * link.beta)
    assert p.pipeline_s == pytest.approx(stage + sends)
    assert p.step_s == pytest.approx(p.compute_s + p.pipeline_s)


def test_sharding_divides_the_optimizer_state():
    dp = predict_layout(MODEL, Layout(dp=2), CLUSTER, 8, 1, FLOPS)
    sharded = predict_layout(MODEL, Layout(sharding=2), CLUSTER, 8, 1, FLOPS)
    assert dp.memory_bytes - sharded.memory_bytes == pytest.approx(
        MODEL.params * ADAM_STATE_BYTES / 2)
    assert sharded.data_parallel_s > 0 and dp.data_parallel_s > 0


def test_every_layout_multiplies_to_the_world():
    found = layouts(4, MODEL, 8, 1)
    assert len(set(found)) == len(found) == 10  # ordered factorizations of 2 x 2 into 4 axes
    assert all(layout.world == 4 for layout in found)
    assert Layout(mp=8) not in layouts(8, MODEL, 8, 1)  # 8 does not divide n_head = 4


def test_ranking_is_fastest_first_and_drops_what_does_not_fit():
    ranked = rank_layouts(MODEL, CLUSTER, 4, 8, 2, FLOPS)
    times = [p.step_s for p in ranked]
    assert times == sorted(times) and len(ranked) == 10
    limit = sorted(p.memory_bytes for p in ranked)[4]
    fitting = rank_layouts(MODEL, CLUSTER, 4, 8, 2, FLOPS, memory_bytes=limit)
    assert 0 < len(fitting) < len(ranked)
    assert all(p.memory_bytes <= limit for p in fitting)


def test_recompute_keeps_only_block_inputs():
    full = predict_layout(MODEL, Layout(), CLUSTER, 8, 1, FLOPS)
    kept = predict_layout(MODEL, Layout(), CLUSTER, 8, 1, FLOPS, recompute=True)
    assert kept.memory_bytes < full.memory_bytes


@pytest.mark.parametrize("call, message", [
    (lambda: Layout(dp=0), "dp=0"),
    (lambda: Layout.from_spec("dp=2,tp=2"), "tp=2"),
    (lambda: Transformer.from_spec("gpt:4,64,4"), "gpt:N_LAYER"),
    (lambda: Transformer(4, 65, 4, 128, 16), "n_embd=65"),
    (lambda: predict_layout(MODEL, Layout(mp=3), CLUSTER, 9, 1), "mp=3"),
    (lambda: predict_layout(MODEL, Layout(dp=2), CLUSTER, 7, 1), "global_batch=7"),
    (lambda: predict_layout(MODEL, Layout(pp=8), CLUSTER, 8, 1), "pp=8"),
    (lambda: predict_layout(MODEL, Layout(dp=6), CLUSTER, 12, 1), "ranks=6"),
])
def test_bad_inputs_name_the_value(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_cli_ranks_layouts_and_predicts_one(capsys):
    spec = "gpt:4,64,4,128,16"
    assert main(["--model", spec, "--world", "4", "--global-batch", "8", "--gpus-per-node",
                 "4", "--top", "3"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 4  # header and three layouts
    times = [float(row.split("|")[2]) for row in rows[1:]]
    assert times == sorted(times)
    assert main(["--model", spec, "--layout", "dp=2,mp=2", "--global-batch", "8",
                 "--gpus-per-node", "4"]) == 0
    assert "dp2 x mp2" in capsys.readouterr().out
    assert main(["--model", spec, "--layout", "dp=2", "--world", "4"]) == 2
    assert "is 2 ranks, not --world 4" in capsys.readouterr().err
    assert main(["--model", spec]) == 2
    assert "--layout or --world" in capsys.readouterr().err
    assert math.isfinite(predict_layout(MODEL, Layout(dp=2, mp=2), CLUSTER, 8).step_s)

"""The planner's hybrid layouts: tensor-parallel communication is four allreduces of the
activation per block and micro-batch (plus the embedding's and the output projection's), as
counted in a step of the tensor-parallel GPT at 2 ranks, priced by the comm layer's ring;
compute and parameters divide by mp x pp; layouts are checked, enumerated and ranked; the
command line prints a given layout and the ranking."""
import math

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.core import backend
from fleetmpi import nn

from fleetmpi.plan import costs, hybrid
from fleetmpi.plan.__main__ import main
from fleetmpi.plan.links import preset
from fleetmpi.plan.predict import GPU, Cluster

MODEL = hybrid.GPTShape(layers=8, width=1024, heads=16, vocab=32768, seq=512, batch=32,
                        value_bytes=2)
CLUSTER = Cluster(8, preset("nvlink"), preset("ib100"), GPU)
FLOPS = 100e12


def test_tensor_parallel_is_four_activation_allreduces_per_block_and_micro_batch():
    layout = {"dp": 2, "pp": 2, "sharding": 1, "mp": 4}
    micro = 4
    got = hybrid.tensor_parallel_seconds(MODEL, layout, CLUSTER, micro)
    activation = 32 // 2 // micro * 512 * 1024 * 2
    one = costs.ring_allreduce(activation, 4, CLUSTER.intra, GPU.gamma) + GPU.call_overhead
    assert got == pytest.approx(micro * (4 * 8 // 2 + 1) * one)
    alone = hybrid.tensor_parallel_seconds(MODEL, dict(layout, pp=1), CLUSTER, micro)
    assert alone == pytest.approx(micro * (4 * 8 + 2) * one)
    assert hybrid.tensor_parallel_seconds(MODEL, dict(layout, mp=1), CLUSTER, micro) == 0.0
    across_nodes = hybrid.tensor_parallel_seconds(MODEL, {"dp": 1, "pp": 1, "sharding": 1,
                                                          "mp": 16}, CLUSTER, 1)
    within = hybrid.tensor_parallel_seconds(MODEL, {"dp": 2, "pp": 1, "sharding": 1, "mp": 8},
                                            CLUSTER, 1)
    assert across_nodes > within


def test_model_parallel_divides_compute_and_parameters():
    alone = hybrid.predict_layout(MODEL, {"dp": 8}, CLUSTER, FLOPS)
    split = hybrid.predict_layout(MODEL, {"dp": 4, "mp": 2}, CLUSTER, FLOPS)
    assert split.compute_s == pytest.approx(alone.compute_s)  # half the work, twice the batch
    assert split.tensor_parallel_s > 0 and alone.tensor_parallel_s == 0
    params = MODEL.parameters * 2
    assert alone.memory_bytes > 4 * params and split.memory_bytes < alone.memory_bytes
    sharded = hybrid.predict_layout(MODEL, {"dp": 2, "sharding": 4}, CLUSTER, FLOPS)
    assert sharded.memory_bytes < alone.memory_bytes
    assert sharded.step_s == pytest.approx(alone.step_s)
    piped = hybrid.predict_layout(MODEL, {"dp": 4, "pp": 2}, CLUSTER, FLOPS, micro_batches=4)
    assert piped.pipeline_s > 0
    assert piped.compute_s == pytest.approx(2 * alone.compute_s / 2 * (4 + 1) / 4)


def test_layouts_are_checked_and_every_one_is_ranked():
    with pytest.raises(ValueError, match="dp=3, pp=1, sharding=1, mp=2: the degrees multiply "
                                         "to 6, not the 8 ranks"):
        hybrid.check_layout({"dp": 3, "mp": 2}, 8, MODEL)
    with pytest.raises(ValueError, match="heads=16 does not split over 32"):
        hybrid.check_layout({"mp": 32}, 32, MODEL)
    with pytest.raises(ValueError, match="unknown degree"):
        hybrid.check_layout({"tp": 2}, 2, MODEL)
    every = hybrid.layouts(8, MODEL)
    assert all(math.prod(layout.values()) == 8 for layout in every)
    assert len(every) == len({tuple(layout.values()) for layout in every}) == 20
    ranked = hybrid.rank_layouts(MODEL, 8, CLUSTER, FLOPS)
    assert [p.step_s for p in ranked] == sorted(p.step_s for p in ranked)
    budget = sorted(p.memory_bytes for p in ranked)[5]
    fitting = hybrid.rank_layouts(MODEL, 8, CLUSTER, FLOPS, memory_bytes=budget)
    fits = [p.memory_bytes <= budget for p in fitting]
    assert fits == sorted(fits, reverse=True) and sum(fits) >= 6


def test_the_command_line_prints_the_layout_and_the_ranking(capsys):
    argv = ["--gpt", "8,1024,16,32768,512", "--global-batch", "32", "--ranks", "8",
            "--inter", "ib100", "--layout", "dp=2,pp=2,mp=2", "--memory-GB", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    given = out.split("given layout:")[1].split("every layout")[0]
    assert "| dp2 x pp2 x mp2 |" in given
    assert out.count("| dp8 |") == 1 and "| mp8 |" in out
    assert main(argv[:-4] + ["--layout", "dp=3,mp=2"]) == 2
    assert "the degrees multiply to 6, not the 8 ranks" in capsys.readouterr().err


@pytest.mark.mpi(min_size=2)
def test_the_planner_counts_the_allreduces_a_tensor_parallel_gpt_step_makes():
    fleet.init(is_collective=True)
    if fleet.worker_num() % 2:
        pytest.skip("mp_degree 2 needs an even world")
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"mp_degree": 2}
    fleet.init(is_collective=True, strategy=strategy)
    layers, batch, seq, width = 3, 4, 6, 8
    backend.manual_seed(0)
    model = nn.GPT(vocab_size=12, block_size=seq, n_layer=layers, n_head=2, n_embd=width,
                   dtype="float64")
    group = fleet.get_hybrid_communicate_group().get_model_parallel_group()
    sizes = []
    allreduce = group.allreduce

    def counting(x, *args, **kwargs):
        sizes.append(x.size)
        return allreduce(x, *args, **kwargs)
    group.allreduce = counting
    try:
        tokens = np.random.default_rng(0).integers(0, 12, (batch, seq + 1))
        loss = nn.ParallelCrossEntropy(reduction="mean")(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
    finally:
        del group.allreduce
    activation = batch * seq * width
    assert sizes.count(activation) == \
        hybrid.ALLREDUCES_PER_BLOCK * layers + hybrid.ALLREDUCES_OUTSIDE_BLOCKS
    assert sorted(set(sizes) - {activation}) == [batch * seq, 2 * batch * seq]

"""The scaling planner: cost formulas by hand and against the messages the comm layer really
sends, bucket sizes against the trainer's, the command line, bad input, and one prediction
against a measurement at 2 ranks."""
import math
import struct

import numpy as np
import pytest

from fleetmpi import nn, optimizer
from fleetmpi.comm.hierarchical import allreduce_hierarchical
from fleetmpi.comm.ring import DEFAULT_CHUNK_BYTES, allreduce_ring
from fleetmpi.config.distributed_strategy import DistributedStrategy
from fleetmpi.plan import (GPU, Buckets, Cluster, Device, Link, Workload, gradient_buckets,
                           model_from_spec, predict, preset)
from fleetmpi.plan import costs
from fleetmpi.plan.__main__ import main as plan_main
from fleetmpi.strategies.dgc import keep_count
from fleetmpi.strategies.gradient_allreduce import GradientAllreduce

MIB = 1 << 20
LINK = Link("test", alpha=1e-5, beta=1e-9)
FREE = Link("free", 0.0, 0.0)


class CountingTransport:
    """One rank of ``size`` whose ``sendrecv`` counts messages and sent bytes instead of
    moving them (received buffers are left as they are)."""

    def __init__(self, size, rank=0):
        self.size, self.rank = size, rank
        self.messages = 0
        self.sent_bytes = 0

    def sendrecv(self, sendbuf, dest, recvbuf, source):
        self.messages += 1
        self.sent_bytes += 0 if sendbuf is None else sendbuf.nbytes
        if recvbuf is not None:
            recvbuf[...] = 0


# -- formulas by hand -----------------------------------------------------------------------

def test_ring_allreduce_by_hand():
    # 8 MiB on 4 ranks: 2 MiB segments, 2 chunks of 1 MiB per reduce-scatter step.
    a, b, g = LINK.alpha, LINK.beta, 1e-10
    n = 8 * MIB
    expected = (3 * (2 * a + 2 * MIB * b + 2 * MIB * g)   # reduce-scatter
                + 2 * MIB * g                               # mean of the owned segment
                + 3 * (a + 2 * MIB * b))                     # allgather
    assert costs.ring_allreduce(n, 4, LINK, g) == pytest.approx(expected)
    # the textbook bandwidth term 2 (p-1)/p n beta, with 9 messages instead of 2 (p-1) = 6
    assert costs.ring_allreduce(n, 4, Link("l", a, 0.0), 0.0) == pytest.approx(9 * a)
    assert costs.ring_allreduce(n, 4, Link("l", 0.0, b), 0.0) == pytest.approx(2 * 3 / 4 * n * b)
    assert costs.ring_allreduce(n, 1, LINK, g) == 0.0


def test_fp16_ring_by_hand():
    a, b, cast, widen = LINK.alpha, LINK.beta, 2e-10, 3e-10
    n, p = 8 * MIB, 2                 # 4 MiB float32 segments, 2 MiB on the wire: 2 chunks
    segment, wire = 4 * MIB, 2 * MIB
    expected = (1 * (2 * a + wire * b + wire * widen)         # reduce-scatter, float16 in
                + segment * 0.0                               # mean (gamma = 0 here)
                + 1 * (a + wire * b)                          # allgather of the float16 copy
                + (segment + segment) * cast                  # sent chunks + owned segment
                + n / 2 * widen)                              # result back into float32
    got = costs.ring_allreduce(n, p, LINK, 0.0, cast, widen, compression="fp16")
    assert got == pytest.approx(expected)
    assert costs.ring_allreduce(n, p, LINK, 0.0, compression="fp16") < \
        costs.ring_allreduce(n, p, LINK, 0.0)


def test_hierarchical_by_hand():
    intra, inter = Link("intra", 1e-6, 1e-10), Link("inter", 1e-5, 1e-9)
    n, L, N, g = 4 * MIB, 4, 2, 1e-11
    s = n / L                         # 1 MiB per local rank
    inner = s / N                     # 512 KiB per node in the cross ring
    shared_beta = inter.beta * L      # the node's 4 cross rings share its port
    expected = (3 * (intra.alpha + s * intra.beta + s * g)           # intra reduce-scatter
                + 1 * (inter.alpha + inner * shared_beta + inner * g)  # cross reduce-scatter
                + 1 * (inter.alpha + inner * shared_beta)              # cross allgather
                + s * g                                                # mean
                + 3 * (intra.alpha + s * intra.beta))                  # intra allgather
    assert costs.hierarchical_allreduce(n, L, N, intra, inter, g) == pytest.approx(expected)


def test_dgc_by_hand():
    sizes = (1000, 10, 123457)
    buckets = Buckets((4 * sum(sizes),), sizes)
    device = Device("d", gamma=0.0, cast=0.0, widen=0.0, select=1e-9, scatter=2e-9,
                    call_overhead=5e-5)
    cluster = Cluster(8, LINK, LINK, device)
    pairs = keep_count(1000, 0.999) + keep_count(10, 0.999) + keep_count(123457, 0.999)
    assert pairs == 1 + 1 + 124
    payload = 8 * pairs               # float32 value + int32 index
    p = 8
    expected = (sum(sizes) * 1e-9                        # top-k selection
                + 5e-5 + 2 * 3 * LINK.alpha              # one call and its agreement
                + (p - 1) * (LINK.alpha + payload * LINK.beta)   # ring allgather
                + p * pairs * 2e-9)                      # scatter-add of every rank's pairs
    got = predict(Workload(buckets, 1.0), cluster, p, "dgc", sparsity=0.999)
    assert got.comm_s == pytest.approx(expected)
    assert got.step_s == pytest.approx(1.0 + expected)


def test_efficiency_and_comm_share():
    buckets = Buckets((8 * MIB, 8 * MIB), (4 * MIB,))
    device = Device("d", gamma=0.0, cast=0.0, widen=0.0, select=0.0, scatter=0.0,
                    call_overhead=0.0)
    cluster = Cluster(4, FREE, Link("net", 0.0, 1e-9), device)
    got = predict(Workload(buckets, 0.1, batch=32), cluster, 16, "ring")
    per_bucket = 2 * 15 / 16 * 8 * MIB * 1e-9   # ring bound by the inter-node link
    assert got.nodes == 4
    assert got.comm_s == pytest.approx(2 * per_bucket)
    assert got.efficiency == pytest.approx(0.1 / (0.1 + 2 * per_bucket))
    assert got.comm_share == pytest.approx(2 * per_bucket / (0.1 + 2 * per_bucket))
    assert got.samples_per_s == pytest.approx(16 * 32 / (0.1 + 2 * per_bucket))
    assert predict(Workload(buckets, 0.1), cluster, 1).efficiency == 1.0
    # Overlapped with backward: the first bucket's reduction hides behind the rest of backward.
    overlapped = predict(Workload(buckets, 0.1), cluster, 16, "ring", overlap="backward")
    assert overlapped.step_s < got.step_s
    assert overlapped.step_s >= 0.1 + per_bucket - 1e-12


def test_small_buckets_use_the_library_allreduce():
    cluster = Cluster(4, LINK, LINK, GPU)
    small = predict(Workload(Buckets((1024,), (256,)), 0.1), cluster, 8, "ring")
    big = predict(Workload(Buckets((2 * MIB,), (MIB // 2,)), 0.1), cluster, 8, "ring")
    assert small.bucket_algorithms == ("native",)
    assert big.bucket_algorithms == ("ring",)
    assert predict(Workload(Buckets((1024,), (256,)), 0.1), cluster, 8,
                   "fp16").bucket_algorithms == ("ring",)


# -- formulas against the messages the comm layer sends ------------------------------------

@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("mib", [1, 6])
@pytest.mark.parametrize("compression", [None, "fp16"])
def test_ring_messages_and_bytes_match_the_implementation(p, mib, compression):
    n = mib * MIB
    transport = CountingTransport(p)
    allreduce_ring(transport, np.zeros(n // 4, np.float32), "mean", compression)
    ratio = 0.5 if compression else 1.0
    wire_segment = n / p * ratio
    assert transport.messages == (p - 1) * (math.ceil(wire_segment / DEFAULT_CHUNK_BYTES) + 1)
    assert transport.sent_bytes == pytest.approx(2 * (p - 1) / p * n * ratio, abs=8 * p)
    model = costs.ring_allreduce(n, p, Link("count", 1.0, 0.0), 0.0, compression=compression)
    assert model == transport.messages
    model_bytes = costs.ring_allreduce(n, p, Link("bytes", 0.0, 1.0), 0.0,
                                       compression=compression)
    assert model_bytes == pytest.approx(transport.sent_bytes, abs=8 * p)


@pytest.mark.parametrize("local_size,nodes", [(2, 2), (4, 2), (2, 3)])
def test_hierarchical_messages_match_the_implementation(local_size, nodes):
    n = 4 * MIB
    local, cross = CountingTransport(local_size), CountingTransport(nodes)
    allreduce_hierarchical(local, cross, np.zeros(n // 4, np.float32), "mean")
    counted = Link("count", 1.0, 0.0)
    expected_local = costs.reduce_scatter_ring(n, local_size, counted, 0.0) + \
        costs.allgather_ring(0, local_size, counted)
    assert local.messages == expected_local
    assert cross.messages == costs.ring_allreduce(n / local_size, nodes, counted, 0.0)
    assert local.sent_bytes + cross.sent_bytes == pytest.approx(
        2 * (local_size - 1) / local_size * n + 2 * (nodes - 1) / nodes * n / local_size,
        abs=16 * local_size * nodes)


# -- buckets --------------------------------------------------------------------------------

@pytest.mark.parametrize("fields", [{}, {"fuse_grad_size_in_MB": 1},
                                    {"fuse_grad_size_in_TFLOPS": 1},
                                    {"fuse_all_reduce_ops": False}])
def test_buckets_match_the_trainer(fields):
    model = nn.MLP([300, 600, 600, 300, 10])
    strategy = DistributedStrategy()
    for name, value in fields.items():
        setattr(strategy, name, value)
    opt = optimizer.Momentum(learning_rate=0.1, momentum=0.9, parameters=model.parameters())
    trainer = GradientAllreduce(strategy, opt, None)
    planned = gradient_buckets(model, strategy)
    assert planned.nbytes == tuple(int(b.grad.nbytes) for b in trainer.buckets)
    assert planned.total_bytes == sum(p.size * 4 for p in model.parameters())
    assert sorted(planned.tensor_sizes) == sorted(p.size for p in model.parameters())
    if fields.get("fuse_all_reduce_ops") is False:
        assert len(planned.nbytes) == len(model.parameters())


def test_resnet50_has_its_published_parameter_count():
    buckets = gradient_buckets(model_from_spec("resnet50"))
    assert buckets.total_bytes == 4 * 25_557_032
    assert max(buckets.nbytes) <= 32 * MIB


# -- command line and bad input -------------------------------------------------------------

def _png_size(path):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_cli_prints_tables_and_writes_a_png(tmp_path, capsys):
    png = tmp_path / "curves.png"
    rc = plan_main(["--model", "mlp:784,1024,1024,10", "--compute-ms", "20", "--batch", "64",
                    "--gpus-per-node", "4", "--intra", "pcie3", "--inter", "ib100", "eth25",
                    "--max-ranks", "64", "--png", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    for algorithm in ("ring", "hierarchical", "fp16", "dgc"):
        assert f"| {algorithm} | 64 | 16 |" in out
    assert "eth25" in out and "ib100" in out
    width, height = _png_size(png)
    assert width == 840 and height == 360
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("argv,message", [
    (["--inter", "token-ring"], "link preset 'token-ring' is not known"),
    (["--intra", "carrier-pigeon"], "link preset 'carrier-pigeon' is not known"),
    (["--gpus-per-node", "0"], "gpus_per_node=0 must be a positive integer"),
    (["--max-ranks", "0"], "--max-ranks=0 must be at least 1"),
    (["--algorithms", "ring", "gossip"], "algorithm 'gossip' is not known"),
    (["--compute-ms", "-3"], "--compute-ms=-3.0 must be positive"),
    (["--model", "vgg"], "model 'vgg' is not known"),
    (["--model", "mlp:3,x"], "model 'mlp:3,x' is not known"),
    (["--intra", "local", "--inter", "ib100"], "use --intra local --inter local together"),
    (["--inter-bandwidth", "0"], "bandwidth=0.0 must be a positive number"),
])
def test_cli_bad_arguments(argv, message, tmp_path, capsys):
    args = ["--model", "mlp:8,8", "--compute-ms", "1", "--png", str(tmp_path / "x.png")]
    assert plan_main(args + argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_predict_bad_arguments():
    workload = Workload(Buckets((MIB,), (MIB // 4,)), 0.1)
    cluster = Cluster(4, preset("nvlink"), preset("ib100"))
    with pytest.raises(ValueError, match="ranks=0 must be a positive integer"):
        predict(workload, cluster, 0)
    with pytest.raises(ValueError, match=r"ranks=6 is not a whole number of nodes of "
                                         r"gpus_per_node=4; use a multiple of 4"):
        predict(workload, cluster, 6)
    with pytest.raises(ValueError, match="algorithm='allgossip' is not known"):
        predict(workload, cluster, 8, "allgossip")
    with pytest.raises(ValueError, match="overlap='always' is not known"):
        predict(workload, cluster, 8, overlap="always")
    with pytest.raises(ValueError, match="sparsity=1.0 must lie in"):
        predict(workload, cluster, 8, "dgc", sparsity=1.0)
    with pytest.raises(ValueError, match="compute_s=0 must be a positive number"):
        Workload(Buckets((MIB,), (MIB // 4,)), 0)
    with pytest.raises(ValueError, match="link 'x': beta=-1 must be a number >= 0"):
        Link("x", 0.0, -1)
    with pytest.raises(ValueError, match="transport='tcp' is not known"):
        Cluster(4, preset("nvlink"), preset("ib100"), transport="tcp")


# -- against a measurement ------------------------------------------------------------------

def test_a_calibrated_prediction_for_two_ranks_is_made_from_measured_parts():
    """Calibrate this machine, measure one rank's step (the planner's compute input) and
    predict two ranks from them. How close the prediction comes to a measured two-rank step is
    a timing, so ``benchmarks/plan_validation.py`` prints it; here the parts must be measured
    and put together: positive times, the compute as measured, communication on top of it."""
    from fleetmpi.plan import calibrate
    from fleetmpi.plan.measure import measure_step

    spec, batch = "mlp:784,1024,1024,10", 64
    cluster = calibrate(repeats=3)
    compute = measure_step(spec, batch, 1, steps=3, windows=2, statistic="best")
    assert math.isfinite(compute) and compute > 0, compute
    buckets = gradient_buckets(model_from_spec(spec))
    workload = Workload(buckets, compute, batch)
    predicted = predict(workload, cluster, 2)
    assert len(predicted.bucket_algorithms) == len(buckets.nbytes)
    assert set(predicted.bucket_algorithms) <= {"shm", "ring"}, predicted.bucket_algorithms
    assert math.isfinite(predicted.step_s) and predicted.step_s > 0, predicted
    alone = predict(workload, cluster, 1)
    assert predicted.step_s >= alone.step_s, (predicted, alone)


def test_compute_is_stretched_by_the_ranks_of_a_node_over_its_cores_not_the_job():
    """A cluster calibrated on this machine has its cores on every node: at 4096 ranks, 8 per
    node on 2 cores, compute is stretched by 8 / 2, as at 8 ranks, never by 4096 / 2."""
    link = Link("local", 1e-6, 1e-10)
    cluster = Cluster(8, link, link, device=GPU, transport="mpi", cores=2)
    workload = Workload(Buckets((4 << 20,), (1 << 20,)), 0.1, 32)
    for ranks, stretch in [(1, 1.0), (2, 1.0), (8, 4.0), (64, 4.0), (4096, 4.0)]:
        assert predict(workload, cluster, ranks).compute_s == pytest.approx(0.1 * stretch)
    assert predict(workload, cluster, 4096).efficiency > 0.1

"""The scaling planner against measurements: this machine at 2, 3 and 4 ranks, and two published
results.

    python benchmarks/plan_validation.py [--steps 10] [--windows 5]

Part 1 calibrates this machine (``fleetmpi.plan.calibrate``, a two-rank job), measures each
model's step time on one rank (the planner's compute input) and at 2, 3 and 4 ranks under
``mpiexec`` (fleetmpi data parallel, Momentum, one BLAS thread per rank), and prints the
prediction next to the measurement with the error. Only the one-rank time and the two-rank
calibration go into the prediction; 3 and 4 ranks are extrapolated (on a machine of fewer
cores the ranks share them, which the planner models as compute slowing by ranks / cores).
The load average is printed: on a shared machine other jobs' load shows up as error.

Part 2 predicts two published results from the inputs listed with them: Horovod's ResNet-101 on
128 servers x 4 Pascal GPUs over 25 Gbit/s RoCE (Sergeev and Del Balso 2018, about 90%
scaling efficiency at 512 GPUs) and ChainerMN's ResNet-50 at 128 GPUs (Akiba, Fukuda and
Suzuki 2017, 90% parallel efficiency). The per-GPU speeds are not measured here: they are the
stated assumptions, and rows at other speeds show how much the answer depends on them.
"""
import argparse
import os

from fleetmpi.config.distributed_strategy import DistributedStrategy
from fleetmpi.plan import (Cluster, Workload, calibrate, gradient_buckets, model_from_spec,
                           predict, preset)
from fleetmpi.plan.measure import measure_step
from fleetmpi.plan.predict import GPU

LOCAL_CASES = [
    # (label, model spec, per-rank batch, algorithm)
    ("digits MLP 64-256-256-10", "mlp:64,256,256,10", 64, "ring"),
    ("MLP 784-2048-2048-10", "mlp:784,2048,2048,10", 64, "ring"),
    ("MLP 784-2048-2048-10", "mlp:784,2048,2048,10", 64, "fp16"),
]

PUBLISHED = [
    {
        "name": "Horovod, ResNet-101 (Sergeev & Del Balso 2018)",
        "model": "resnet101", "ranks": 512, "gpus_per_node": 4, "intra": "pcie3",
        "inter": "roce25", "batch": 64, "images_per_s": [120, 90, 150], "reported": 0.90,
        "fusion_mb": 64, "algorithms": [("ring", "backward"), ("ring", "none")],
        "inputs": "128 servers x 4 Pascal GPUs (PCIe), 25 Gbit/s RoCE, batch 64 per GPU "
                  "(tf_cnn_benchmarks' default for ResNet-101), ~120 images/s per P100 "
                  "(assumed; fp32), 64 MB Tensor Fusion buffer (no layer limit), NCCL ring over "
                  "all GPUs, allreduce overlapped with backward",
    },
    {
        "name": "ChainerMN, ResNet-50 (Akiba, Fukuda & Suzuki 2017)",
        "model": "resnet50", "ranks": 128, "gpus_per_node": 4, "intra": "pcie3",
        "inter": "ib56", "batch": 32, "images_per_s": [180, 135, 225], "reported": 0.90,
        "fusion_mb": 128, "algorithms": [("ring", "none"), ("hierarchical", "none")],
        "inputs": "32 nodes x 4 P100 (PCIe), InfiniBand FDR 56 Gbit/s, batch 32 per GPU, "
                  "~180 images/s per P100 in Chainer (assumed; fp32), all gradients packed into "
                  "one buffer and allreduced after backward (no overlap)",
    },
]


def local_validation(steps, windows):
    cluster = calibrate(local_ranks=4)
    print(f"this machine: {os.cpu_count()} cores; calibrated at 2 ranks: our ring "
          f"{cluster.intra.describe()}, MPI's allreduce {cluster.native.describe()}, "
          f"shared memory {1 / max(cluster.shm.copy_beta, 1e-15) / 1e9:.2f} GB/s copy, "
          f"call overhead {cluster.device.call_overhead * 1e6:.0f} us, reduction "
          f"{1 / cluster.device.gamma / 1e9:.1f} GB/s, fp16 cast {cluster.device.cast * 1e9:.2f} "
          f"ns/B, compute {cluster.concurrent_slowdown:.2f}x slower beside another rank; "
          f"load average {os.getloadavg()[0]:.2f}")
    print()
    print("| model | algorithm | ranks | compute, 1 rank (ms) | predicted step (ms) | "
          "measured step (ms) | error | allreduce per bucket |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    errors = []
    for label, spec, batch, algorithm in LOCAL_CASES:
        buckets = gradient_buckets(model_from_spec(spec))
        compute = measure_step(spec, batch, 1, steps=steps, windows=windows)
        workload = Workload(buckets, compute, batch)
        for ranks in (2, 3, 4):
            predicted = predict(workload, cluster, ranks, algorithm)
            measured = measure_step(spec, batch, ranks, algorithm, steps=steps, windows=windows)
            error = predicted.step_s / measured - 1
            errors.append(abs(error))
            print(f"| {label} | {algorithm} | {ranks} | {compute * 1e3:.2f} | "
                  f"{predicted.step_s * 1e3:.2f} | {measured * 1e3:.2f} | {100 * error:+.0f}% | "
                  f"{', '.join(sorted(set(predicted.bucket_algorithms)))} |")
    print()
    print(f"median |error| {100 * sorted(errors)[len(errors) // 2]:.0f}%, largest "
          f"{100 * max(errors):.0f}%; load average at the end {os.getloadavg()[0]:.2f}")


def published_validation():
    print()
    for case in PUBLISHED:
        print(f"{case['name']}: {case['inputs']}")
    print()
    print("| result | per-GPU images/s | algorithm | overlap | predicted step (ms) | "
          "comm share | predicted efficiency | reported | error (points) |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for case in PUBLISHED:
        strategy = DistributedStrategy()
        strategy.fuse_grad_size_in_MB = case["fusion_mb"]
        strategy.fuse_grad_size_in_TFLOPS = 10_000   # as layers per bucket: no limit
        buckets = gradient_buckets(model_from_spec(case["model"]), strategy)
        cluster = Cluster(case["gpus_per_node"], preset(case["intra"]), preset(case["inter"]),
                          GPU)
        for speed in case["images_per_s"]:
            workload = Workload(buckets, case["batch"] / speed, case["batch"])
            for algorithm, overlap in case["algorithms"]:
                p = predict(workload, cluster, case["ranks"], algorithm, overlap)
                error = 100 * (p.efficiency - case["reported"])
                print(f"| {case['name']} at {case['ranks']} GPUs | {speed} | "
                      f"{algorithm} | {overlap} | {p.step_s * 1e3:.1f} | "
                      f"{100 * p.comm_share:.1f}% | {100 * p.efficiency:.1f}% | "
                      f"~{100 * case['reported']:.0f}% | {error:+.1f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per timed window")
    parser.add_argument("--windows", type=int, default=5, help="timed windows (median)")
    parser.add_argument("--skip-local", action="store_true")
    args = parser.parse_args()
    if not args.skip_local:
        local_validation(args.steps, args.windows)
    published_validation()


if __name__ == "__main__":
    main()

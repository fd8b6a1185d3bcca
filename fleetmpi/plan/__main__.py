"""Predict step time, communication share and scaling efficiency of data-parallel training.

    python -m fleetmpi.plan --model resnet50 --compute-ms 160 --batch 32 --gpus-per-node 4 \\
        --intra nvlink --inter ib100 eth25 --png plan.png

The model's gradient buckets come from the trainer's own bucketing (``--fuse-grad-size-in-MB``,
``--fuse-grad-size-in-TFLOPS``); its compute time per step is ``--compute-ms`` or, without it,
measured by a one-rank job on this machine (minutes for an ImageNet model on a CPU).
``--inter local`` (with ``--intra local``) is this machine as calibrated by a short two-rank
job. Links are presets or explicit ``--intra-bandwidth``/``--intra-latency`` and
``--inter-bandwidth``/``--inter-latency`` (GB/s and microseconds). Prints one table per
inter-node link and draws every curve into ``--png`` (``plan.png``); without matplotlib it
says in one line how to get it instead.

Hybrid layouts of a GPT (``fleetmpi.plan.hybrid``):

    python -m fleetmpi.plan --gpt 24,2048,16,50304,1024 --global-batch 64 --ranks 32 \
        --gpus-per-node 8 --tflops 100 --layout dp=2,pp=2,mp=8 --memory-GB 32

prints the predicted step time (compute, tensor-parallel, pipeline and data-parallel parts)
and memory per rank of ``--layout``, and every layout of ``--ranks`` ranks ranked by step time
(those within ``--memory-GB`` first).
"""
import argparse
import sys

from ..config.distributed_strategy import DistributedStrategy
from ..core import extras
from .buckets import gradient_buckets, model_from_spec
from .links import LOCAL, PRESETS, Link, preset
from .predict import ALGORITHMS, GPU, OVERLAPS, Cluster, Workload, powers_of_two, scaling

DEFAULT_PNG = "plan.png"


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m fleetmpi.plan",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50",
                        help="resnet50, resnet101, resnet20 or mlp:SIZES (default resnet50)")
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch (default 32)")
    parser.add_argument("--compute-ms", type=float,
                        help="compute time per step on one rank; measured here when left out")
    parser.add_argument("--backward-fraction", type=float, default=2 / 3)
    parser.add_argument("--fuse-grad-size-in-MB", type=float, default=32)
    parser.add_argument("--fuse-grad-size-in-TFLOPS", type=int, default=20)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--intra", default="nvlink",
                        help=f"intra-node link: {', '.join(sorted(PRESETS))} or {LOCAL}")
    parser.add_argument("--inter", nargs="+", default=["ib100", "eth25"],
                        help=f"inter-node link(s): {', '.join(sorted(PRESETS))} or {LOCAL}")
    for level in ("intra", "inter"):
        parser.add_argument(f"--{level}-bandwidth", type=float, help="GB/s (replaces the preset)")
        parser.add_argument(f"--{level}-latency", type=float, help="microseconds")
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS))
    parser.add_argument("--overlap", choices=OVERLAPS, default="none")
    parser.add_argument("--sparsity", type=float, default=0.999, help="dgc's final sparsity")
    parser.add_argument("--max-ranks", type=int, default=4096)
    parser.add_argument("--png", help=f"where to draw the curves (default {DEFAULT_PNG}; "
                                      "needs matplotlib, pip install 'fleetmpi[plan]')")
    parser.add_argument("--gpt", metavar="LAYERS,WIDTH,HEADS,VOCAB,SEQ",
                        help="hybrid layouts of a GPT")
    parser.add_argument("--global-batch", type=int, default=64, metavar="B")
    parser.add_argument("--ranks", type=int, default=8, metavar="N")
    parser.add_argument("--layout", metavar="dp=..,pp=..,sharding=..,mp=..",
                        help="the layout to predict")
    parser.add_argument("--tflops", type=float, default=100.0, metavar="T",
                        help="sustained TFLOPS of one device (default 100)")
    parser.add_argument("--memory-GB", type=float, metavar="M", help="memory per device")
    parser.add_argument("--micro-batches", type=int,
                        help="pipeline micro-batches (default: pp_degree)")
    parser.add_argument("--value-bytes", type=int, default=2,
                        help="bytes per parameter and activation value (default 2)")
    return parser.parse_args(argv)


def _parse_layout(text):
    layout = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if not value.isdigit():
            raise ValueError(f"--layout item {item!r} is not DEGREE=N (dp, pp, sharding, mp)")
        layout[key.strip()] = int(value)
    return layout


def plan_hybrid(args):
    """The ``--gpt`` report: the given layout's prediction and the ranking."""
    from . import hybrid

    try:
        numbers = [int(v) for v in args.gpt.split(",")]
        if len(numbers) != 5:
            raise ValueError
    except ValueError:
        raise ValueError(f"--gpt {args.gpt!r} must be LAYERS,WIDTH,HEADS,VOCAB,SEQ") from None
    if args.tflops <= 0:
        raise ValueError(f"--tflops={args.tflops} must be positive")
    model = hybrid.GPTShape(*numbers, batch=args.global_batch, value_bytes=args.value_bytes)
    memory = None if args.memory_GB is None else args.memory_GB * 2 ** 30
    flops = args.tflops * 1e12
    lines = [f"GPT {args.gpt}: {model.parameters / 1e6:.1f} M parameters, global batch "
             f"{model.batch}, {args.ranks} ranks, {args.tflops:g} TFLOPS per device"]
    header = ["| layout | step (ms) | compute | tensor parallel | pipeline | data parallel | "
              "memory (GiB) |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def row(p):
        return (f"| {hybrid.describe(p.layout)} | {p.step_s * 1e3:.2f} | "
                f"{p.compute_s * 1e3:.2f} | {p.tensor_parallel_s * 1e3:.2f} | "
                f"{p.pipeline_s * 1e3:.2f} | {p.data_parallel_s * 1e3:.2f} | "
                f"{p.memory_bytes / 2 ** 30:.2f}"
                f"{' (over)' if memory is not None and p.memory_bytes > memory else ''} |")
    for label, cluster in clusters(args).items():
        lines += ["", label]
        if args.layout:
            given = _parse_layout(args.layout)
            hybrid.check_layout(given, args.ranks, model)
            lines += ["", "given layout:"] + header + [
                row(hybrid.predict_layout(model, given, cluster, flops, args.micro_batches))]
        lines += ["", "every layout, fastest first" + (" (within --memory-GB first)"
                                                      if memory is not None else "") + ":"]
        lines += header + [row(p) for p in hybrid.rank_layouts(
            model, args.ranks, cluster, flops, memory, args.micro_batches)]
    return "\n".join(lines)


def _link(level, name, args):
    bandwidth = getattr(args, f"{level}_bandwidth")
    latency = getattr(args, f"{level}_latency")
    if bandwidth is None and latency is None:
        return preset(name)
    base = preset(name)
    return Link.from_bandwidth(f"{level} {bandwidth or base.bandwidth / 1e9:g} GB/s",
                               base.alpha if latency is None else latency * 1e-6,
                               base.bandwidth if bandwidth is None else bandwidth * 1e9)


def _check(args):
    for algorithm in args.algorithms:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm {algorithm!r} is not known; allowed: "
                             f"{', '.join(ALGORITHMS)}")
    if args.max_ranks < 1:
        raise ValueError(f"--max-ranks={args.max_ranks} must be at least 1")
    if args.compute_ms is not None and args.compute_ms <= 0:
        raise ValueError(f"--compute-ms={args.compute_ms} must be positive")
    if (LOCAL in args.inter) != (args.intra == LOCAL) or (LOCAL in args.inter
                                                          and len(args.inter) > 1):
        raise ValueError(f"{LOCAL!r} describes this machine as a whole: use --intra {LOCAL} "
                         f"--inter {LOCAL} together and alone")
    if args.intra != LOCAL:
        _link("intra", args.intra, args)
        for name in args.inter:
            _link("inter", name, args)


def clusters(args):
    """``{label: Cluster}`` for each inter-node link asked for."""
    if args.intra == LOCAL:
        from .calibrate import calibrate

        local = calibrate(local_ranks=args.gpus_per_node)
        return {f"this machine (calibrated), {args.gpus_per_node} ranks per node": local}
    intra = _link("intra", args.intra, args)
    result = {}
    for name in args.inter:
        inter = _link("inter", name, args)
        cluster = Cluster(args.gpus_per_node, intra, inter, GPU)
        result[f"{args.gpus_per_node} x {intra.describe()}, {inter.describe()}"] = cluster
    return result


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.gpt:
        try:
            print(plan_hybrid(args))
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        _check(args)
        strategy = DistributedStrategy()
        strategy.fuse_grad_size_in_MB = args.fuse_grad_size_in_MB
        strategy.fuse_grad_size_in_TFLOPS = args.fuse_grad_size_in_TFLOPS
        buckets = gradient_buckets(model_from_spec(args.model), strategy)
        compute_s = args.compute_ms / 1e3 if args.compute_ms is not None else None
        if compute_s is None:
            from .measure import measure_step

            compute_s = measure_step(args.model, args.batch, 1, steps=5, windows=3,
                                     timeout=1800)
        workload = Workload(buckets, compute_s, args.batch, args.backward_fraction)
        ranks = powers_of_two(1, args.max_ranks)
        curves = {}
        for label, cluster in clusters(args).items():
            curves[label] = {a: scaling(workload, cluster, ranks, a, args.overlap, args.sparsity)
                             for a in args.algorithms}
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.model}: {len(buckets.nbytes)} gradient bucket(s), "
          f"{buckets.total_bytes / 2 ** 20:.1f} MiB; compute {compute_s * 1e3:.2f} ms per step "
          f"at batch {args.batch} per rank; overlap {args.overlap}")
    for label, by_algorithm in curves.items():
        print()
        print(label)
        print("| algorithm | ranks | nodes | step (ms) | comm (ms) | comm share | efficiency |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for algorithm, predictions in by_algorithm.items():
            for p in predictions:
                print(f"| {algorithm} | {p.ranks} | {p.nodes} | {p.step_s * 1e3:.2f} | "
                      f"{p.comm_s * 1e3:.2f} | {100 * p.comm_share:.1f}% | "
                      f"{100 * p.efficiency:.1f}% |")
    return draw(curves, args, f"{args.model}, batch {args.batch} per rank, compute "
                              f"{compute_s * 1e3:.1f} ms, overlap {args.overlap}")


def draw(curves, args, title):
    """The PNG of ``curves``; without matplotlib one line naming the extra instead, and exit
    status 1 where ``--png`` was asked for (0 where it was only the default)."""
    from .plot import plot_scaling

    png = args.png or DEFAULT_PNG
    try:
        plot_scaling(curves, png, title)
    except extras.MissingExtra as missing:
        extras.report(missing)
        return 1 if args.png else 0
    print(f"\nscaling curves: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

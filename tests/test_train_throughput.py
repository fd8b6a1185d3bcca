"""benchmarks/train_throughput.py's arithmetic and bookkeeping, without running a job: GPT FLOPs
and MFU against hand computations, the device peak table, the rows and their JSON fields, the
reason a row gives for a precision fleetmpi lacks, the plan of jobs, and the kernel count of a
captured graph through a stand-in driver."""
import ctypes
import importlib
import os
import subprocess
import sys
import time
import types

import numpy as np
import pytest

from job_limits import HANG_SECONDS

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks")
H100 = "NVIDIA H100 80GB HBM3"
JSON_FIELDS = {"model", "batch", "precision", "graphs", "fleetmpi", "pytorch", "ratio", "unit",
               "mfu_fleetmpi", "mfu_pytorch", "peak_bytes_fleetmpi", "peak_bytes_pytorch",
               "kernels_per_step", "host_ms_per_step"}


@pytest.fixture
def part(monkeypatch):
    """``part(name)``: the module ``benchmarks/<name>`` (dotted), imported as the script
    imports it."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    return importlib.import_module


def report(rate, device_name=H100, **extra):
    return dict({"samples_per_s": rate, "steps": 3, "host_ms": 12.5,
                 "peak_bytes": 3 * 2 ** 30, "device_name": device_name}, **extra)


def test_gpt2_small_flops_by_hand(part):
    flops = part("throughput_run.flops")
    sizes = part("throughput_run.models").GPT2_SMALL
    # wte 50257 x 768 + wpe 1024 x 768 + 12 blocks of (12 x 768^2 + 13 x 768) + ln_f 2 x 768
    assert flops.gpt_parameters(**sizes) == 38_597_376 + 786_432 + 12 * 7_087_872 + 1_536
    assert flops.gpt_parameters(**sizes) == 124_439_808
    # 6 x (124,439,808 - 786,432) + 12 x 12 layers x 1024 tokens x 768 wide
    assert flops.gpt_flops_per_token(**sizes) == 741_920_256 + 113_246_208
    rows = part("throughput_run.rows")
    row = rows.assemble_row("gpt2", 1, "amp-bf16", "gpu", 30, report(10.0), report(20.0))
    # 10 sequences/s of 1024 tokens on an H100 (989 TFLOP/s dense 16-bit)
    assert row["mfu_fleetmpi"] == pytest.approx(10 * 1024 * 855_166_464 / 989e12)
    assert row["mfu_pytorch"] == pytest.approx(2 * row["mfu_fleetmpi"])
    # two ranks at the same rate over both: each device did half the work
    two = rows.assemble_row("gpt2", 2, "amp-bf16", "gpu", 30, report(10.0), report(20.0))
    assert two["mfu_fleetmpi"] == pytest.approx(row["mfu_fleetmpi"] / 2)


def test_gpt_parameters_as_the_model_has_them(part):
    from fleetmpi import nn

    sizes = part("throughput_run.models").GPT_TINY
    model = nn.GPT(**sizes)
    assert sum(p.size for p in model.parameters()) == \
        part("throughput_run.flops").gpt_parameters(**sizes) == 813_824


def test_peak_of_each_listed_device_and_unknown_ones(part):
    peak_flops = part("throughput_run.flops").peak_flops
    assert peak_flops(H100, "amp-fp16") == peak_flops(H100, "amp-bf16") == 989e12
    assert peak_flops(H100, "fp32") == 67e12
    assert peak_flops("NVIDIA H100 PCIe", "amp-fp16") == 756e12
    assert peak_flops("NVIDIA H200", "amp-bf16") == 989e12
    assert peak_flops("NVIDIA H200 NVL", "amp-bf16") == 835e12
    for unknown in ("Tesla V100-SXM2-16GB", "Intel(R) Xeon(R) Processor", None):
        assert peak_flops(unknown, "amp-fp16") is None
    rows = part("throughput_run.rows")
    row = rows.assemble_row("gpt", 1, "fp32", "cpu", 2, report(50.0, "AMD EPYC"),
                            report(40.0, "AMD EPYC"))
    assert row["mfu_fleetmpi"] is None and row["mfu_pytorch"] is None
    mlp = rows.assemble_row("mlp", 1, "fp32", "gpu", 2, report(5e4), report(4e4))
    assert mlp["mfu_fleetmpi"] is None  # MFU is the GPTs'


def test_row_keeps_both_trainers_figures(part):
    rows = part("throughput_run.rows")
    row = rows.assemble_row("resnet50", 1, "amp-fp16", "gpu", 30,
                            report(900.0, kernels=1234, kernels_reason=None),
                            report(1200.0, peak_bytes=2 * 2 ** 30, host_ms=3.0))
    assert set(row) >= JSON_FIELDS
    assert (row["model"], row["batch"], row["precision"], row["graphs"]) == \
        ("resnet50", 64, "amp-fp16", False)
    assert row["ratio"] == pytest.approx(0.75) and row["unit"] == "samples/s"
    assert (row["peak_bytes_fleetmpi"], row["peak_bytes_pytorch"]) == (3 * 2 ** 30, 2 * 2 ** 30)
    assert (row["kernels_per_step"], row["host_ms_per_step"]) == (1234, 12.5)
    assert row["host_ms_per_step_pytorch"] == 3.0
    assert row["fleetmpi_reason"] is None and row["pytorch_reason"] is None
    cpu = rows.assemble_row("resnet50", 1, "fp32", "cpu", 30, report(1.0), report(1.0))
    assert cpu["batch"] == 8  # ResNet-50's batch on the CPU


class Strategy:
    """A stand-in DistributedStrategy whose amp_configs takes only the keys ``known``."""

    def __init__(self, known):
        self.known, self.amp, self.configs = known, False, {}

    @property
    def amp_configs(self):
        return self.configs

    @amp_configs.setter
    def amp_configs(self, configs):
        unknown = set(configs) - set(self.known)
        if unknown:
            raise KeyError(f"amp_configs has no key {sorted(unknown)[0]!r}")
        self.configs.update(configs)


def test_bf16_is_asked_for_by_paddles_names_or_refused_with_the_reason(part):
    precision = part("throughput_run.precision")
    for name in ("fp32", "amp-fp16"):
        strategy = Strategy(known=())
        precision.request_amp(strategy, name)
        assert strategy.amp == (name != "fp32") and strategy.configs == {}
    strategy = Strategy(known=("use_pure_bf16",))
    precision.request_amp(strategy, "amp-bf16")
    assert strategy.amp and strategy.configs == {"use_pure_bf16": True}
    strategy = Strategy(known=("dtype", "use_pure_bf16"))
    precision.request_amp(strategy, "amp-bf16")
    assert strategy.configs == {"dtype": "bfloat16"}
    with pytest.raises(precision.Unsupported, match="dtype='bfloat16', use_pure_bf16=True"):
        precision.request_amp(Strategy(known=()), "amp-bf16")


class Optimizer:
    """A stand-in distributed optimizer whose amp computes matmul in ``dtype``."""

    def __init__(self, dtype):
        policy = type("Policy", (), {"dtype_for": lambda self, op: np.dtype(dtype)})()
        self.strategies = {"amp": type("AMP", (), {"policy": policy})()}


def test_an_amp_config_taken_but_not_acted_on_is_refused(part):
    precision = part("throughput_run.precision")
    precision.check_amp_dtype(Optimizer("float16"), "amp-fp16")
    precision.check_amp_dtype(Optimizer("float16"), "fp32")
    with pytest.raises(precision.Unsupported, match="matmul computes in float16"):
        precision.check_amp_dtype(Optimizer("float16"), "amp-bf16")


def test_reason_row_for_a_missing_feature(part, capsys):
    rows, table = part("throughput_run.rows"), part("throughput_run.table")
    why = "fleetmpi's amp_configs takes none of Paddle's bfloat16 settings"
    row = rows.assemble_row("gpt2", 1, "amp-bf16", "gpu", 30, rows.not_measured(why),
                            report(20.0))
    assert set(row) >= JSON_FIELDS
    assert row["fleetmpi"] is None and row["ratio"] is None and row["mfu_fleetmpi"] is None
    assert row["peak_bytes_fleetmpi"] is None and row["kernels_per_step"] is None
    assert row["fleetmpi_reason"] == why and row["pytorch"] == 20.0
    measured = rows.assemble_row("gpt2", 1, "amp-fp16", "gpu", 30, report(
        8.0, kernels=None, kernels_reason="the step does not capture"), report(16.0))
    table.print_tables([measured, row], "gpu")
    printed = capsys.readouterr().out
    assert "| gpt2 | amp-bf16 | 1 | n/a [1] | 20 | - |" in printed
    assert f"[1] {why}" in printed and "[2] the step does not capture" in printed
    # 8 and 16 sequences/s of 855,166,464 x 1024 FLOPs over 989 TFLOP/s
    assert "| gpt2 | amp-fp16 | 1 | 0.7% | 1.4% | 3,072 MiB | 3,072 MiB | 1.00x | n/a [2] |" \
        in printed
    cpu = rows.assemble_row("mlp", 1, "fp32", "cpu", 2, report(10.0, "a CPU"),
                            rows.not_measured("torch not installed"))
    table.print_tables([cpu], "cpu")
    printed = capsys.readouterr().out
    assert "n/a on the CPU" in printed and "[1] torch not installed" in printed


def test_a_failed_run_says_where_it_was_raised(part):
    """The H200's bfloat16 row said only ``TypeError: data type 'E' not understood``; a
    failure's reason now names the raising line and fleetmpi's last line before it."""
    training = part("throughput_run.training")
    from fleetmpi.core import backend

    try:
        backend.asarray([1.0], dtype="not a dtype")
    except TypeError as exc:
        reason = training.failure(exc)
    assert reason.startswith("failed: TypeError: data type 'not a dtype' not understood")
    assert "backend.py:" in reason and "(raised at " in reason
    assert len(reason) <= 400


def test_scaling_efficiency_per_model_and_precision(part):
    rows = part("throughput_run.rows")
    one = rows.assemble_row("mlp", 1, "fp32", "cpu", 2, report(100.0), report(50.0))
    two = rows.assemble_row("mlp", 2, "fp32", "cpu", 2, report(180.0), report(100.0))
    other = rows.assemble_row("mlp", 2, "amp-fp16", "cpu", 2, report(30.0),
                              rows.not_measured("torch not installed"))
    found = rows.scaling_efficiency([one, two, other])
    assert found[id(one)] == (1.0, 1.0)
    assert found[id(two)] == (pytest.approx(0.9), pytest.approx(1.0))
    assert found[id(other)] == (1.0, None)


def test_steps_that_fit_before_the_deadline(part):
    steps_that_fit = part("throughput_run.timing").steps_that_fit
    assert steps_that_fit(2.0, 7.0, 10) == 3
    assert steps_that_fit(2.0, 30.0, 10) == 10
    assert steps_that_fit(2.0, -5.0, 10) == 1  # a late model still times one step
    assert steps_that_fit(0.0, 1.0, 4) == 4


def test_jobs_leave_out_what_fleetmpi_lacks_and_rows_say_why(part, monkeypatch):
    script = part("train_throughput")
    why = "no bfloat16 here"
    monkeypatch.setattr(script, "fleetmpi_reason",
                        lambda precision: why if precision == "amp-bf16" else None)
    launched = []

    def launch(trainer, model, ranks, precisions, args, port, seconds):
        launched.append((trainer, model, ranks, tuple(precisions)))
        return {p: report(10.0 if trainer == "ours" else 20.0) for p in precisions}

    monkeypatch.setattr(script, "launch", launch)
    args = script.parse_args(["--models", "mlp", "gpt2", "--precisions", "amp-fp16", "amp-bf16",
                              "--ranks", "1", "2", "--device", "gpu"])
    found = script.measure(args, have_torch=True)
    assert launched == [("ours", "mlp", 1, ("amp-fp16",)), ("torch", "mlp", 1, ("amp-fp16",
                        "amp-bf16")), ("ours", "mlp", 2, ("amp-fp16",)),
                        ("torch", "mlp", 2, ("amp-fp16", "amp-bf16")),
                        ("ours", "gpt2", 1, ("amp-fp16",)),
                        ("torch", "gpt2", 1, ("amp-fp16", "amp-bf16"))]  # GPT-2 at one rank
    assert [(r["model"], r["ranks"], r["precision"]) for r in found] == [
        ("mlp", 1, "amp-fp16"), ("mlp", 1, "amp-bf16"), ("mlp", 2, "amp-fp16"),
        ("mlp", 2, "amp-bf16"), ("gpt2", 1, "amp-fp16"), ("gpt2", 1, "amp-bf16")]
    for row in found:
        bf16 = row["precision"] == "amp-bf16"
        assert row["fleetmpi_reason"] == (why if bf16 else None)
        assert (row["fleetmpi"] is None) == bf16 and row["pytorch"] == 20.0
    without = script.measure(args, have_torch=False)
    assert all(row["pytorch_reason"] == "torch not installed" for row in without)
    launched.clear()
    on_the_cpu = script.parse_args(["--models", "mlp", "--precisions", "fp32", "amp-fp16",
                                    "--ranks", "1"])
    assert len(script.measure(on_the_cpu, have_torch=True)) == 2
    assert launched == [(trainer, "mlp", 1, (precision,)) for trainer in ("ours", "torch")
                        for precision in ("fp32", "amp-fp16")]  # a job per precision
    launched.clear()
    nothing = script.parse_args(["--models", "gpt2", "--precisions", "amp-bf16"])
    [row] = script.measure(nothing, have_torch=False)  # no job at all, still its row
    assert launched == [] and (row["fleetmpi_reason"], row["pytorch_reason"]) == \
        (why, "torch not installed")


class Driver:
    """A stand-in for the driver API's graph queries over ``graphs``: ``{graph: [(node,
    CUgraphNodeType, child graph or None)]}``."""

    def __init__(self, graphs):
        self.graphs = graphs
        self.nodes = {node: (kind, child) for entries in graphs.values()
                      for node, kind, child in entries}

    def cuGraphGetNodes(self, graph, nodes, count):
        entries = self.graphs[graph.value if isinstance(graph, ctypes.c_void_p) else graph]
        if nodes is not None:
            for index, (node, _, _) in enumerate(entries):
                nodes[index] = node
        count._obj.value = len(entries)
        return 0

    def cuGraphNodeGetType(self, node, kind):
        kind._obj.value = self.nodes[node][0]
        return 0

    def cuGraphChildGraphNodeGetGraph(self, node, child):
        child._obj.value = self.nodes[node][1]
        return 0


def test_kernel_nodes_of_a_captured_graph_with_a_child_graph(part):
    kernels = part("throughput_run.kernels")
    kernel, memset, child = kernels.KERNEL_NODE, 2, kernels.CHILD_GRAPH_NODE
    driver = Driver({100: [(1, kernel, None), (2, memset, None), (3, child, 200),
                           (4, kernel, None)],
                     200: [(5, kernel, None), (6, kernel, None), (7, 1, None)]})
    assert kernels.graph_kernels(driver, ctypes.c_void_p(100)) == 4
    failing = Driver({100: [(1, kernel, None)]})
    failing.cuGraphNodeGetType = lambda node, kind: 700
    with pytest.raises(RuntimeError, match="cuGraphNodeGetType returned CUresult 700"):
        kernels.graph_kernels(failing, ctypes.c_void_p(100))


def test_resident_peak_of_a_window():
    """In a fresh process: in this one, earlier tests leave freed memory in the heap
    (fleetmpi.core.host_memory keeps it), from which the block could come without new pages."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("/proc/self/clear_refs cannot be written here")
    code = ("import numpy as np\n"
            "from throughput_run import memory\n"
            "window = memory.ResidentPeak(memory.resident_bytes())\n"
            "with window:\n"
            "    block = np.ones(2 ** 23)  # 64 MiB, every page touched\n"
            "    del block\n"
            "print(window.peak)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=BENCHMARKS, timeout=HANG_SECONDS)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) >= 60 * 2 ** 20, done.stdout


class Stream:
    """A stand-in CuPy stream whose capture gives the graph 100."""

    def __init__(self, non_blocking=False):
        self.non_blocking = non_blocking

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def begin_capture(self):
        pass

    def end_capture(self):
        return types.SimpleNamespace(graph=100)


def stand_in_cupy(used):
    """A CuPy with capture (``Stream``), memory hooks and a pool whose in-use bytes are
    ``used[0]``."""
    class MemoryHook:
        def __enter__(self):
            hooks.append(self)
            return self

        def __exit__(self, *exc):
            hooks.remove(self)

    hooks = []
    pool = types.SimpleNamespace(used_bytes=lambda: used[0])
    cuda = types.SimpleNamespace(Stream=Stream, MemoryHook=MemoryHook)
    return types.SimpleNamespace(cuda=cuda, get_default_memory_pool=lambda: pool,
                                 hooks=hooks)


def test_kernel_count_of_a_step_and_the_reason_a_step_does_not_capture(part, monkeypatch):
    kernels = part("throughput_run.kernels")
    monkeypatch.setitem(sys.modules, "cupy", stand_in_cupy([0]))
    monkeypatch.setattr(kernels, "_driver", lambda: Driver({100: [
        (1, kernels.KERNEL_NODE, None), (2, kernels.KERNEL_NODE, None)]}))
    assert kernels.count_kernels(lambda: None) == (2, None)

    def reads_the_device():
        raise RuntimeError("cudaErrorStreamCaptureUnsupported: operation not permitted")

    count, why = kernels.count_kernels(reads_the_device)
    assert count is None
    assert why == ("the step does not capture (RuntimeError: "
                   "cudaErrorStreamCaptureUnsupported: operation not permitted)")
    monkeypatch.setattr(kernels, "_driver", lambda: (_ for _ in ()).throw(
        OSError("libcuda.so.1: cannot open shared object file")))
    count, why = kernels.count_kernels(lambda: None)
    assert count is None and why.startswith("the captured graph was not counted (OSError")


def test_pool_peak_is_the_high_water_mark_of_bytes_in_use(part, monkeypatch):
    memory = part("throughput_run.memory")
    used = [1000]
    cupy = stand_in_cupy(used)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    window = memory.cupy_peak()
    with window:
        for now in (5000, 3000, 9000, 2000):  # an allocation from the pool, then frees
            used[0] = now
            for hook in cupy.hooks:
                hook.malloc_postprocess(device_id=0, size=now, mem_size=now)
    assert window.peak == 9000 and cupy.hooks == []


class Window:
    """A stand-in memory window that counts the steps inside it."""

    def __init__(self, steps):
        self.steps, self.peak = steps, None

    def __enter__(self):
        self.before = len(self.steps)
        return self

    def __exit__(self, *exc):
        self.peak = len(self.steps) - self.before


def test_measure_trains_warmup_probe_timed_steps_then_the_window(part):
    timing = part("throughput_run.timing")
    steps, synchronized = [], []
    window = Window(steps)
    found = timing.measure(steps.append, lambda: synchronized.append(len(steps)), window,
                           time.time() + 3600, warmup=2, wanted=5)
    # 2 warm-up steps, the probe (3rd), 5 timed, 1 in the window: consecutive batches
    assert steps == list(range(9)) and found["steps"] == 5 and window.peak == 1
    assert found["peak_bytes"] == 1 and found["host_ms"] >= 0 and found["seconds"] >= 0
    assert synchronized[:2] == [2, 3]  # the probe starts and ends on an idle device
    steps.clear()
    late = timing.measure(steps.append, lambda: None, Window(steps), time.time() - 60,
                          warmup=1, wanted=5)
    assert late["steps"] == 1 and steps == [0, 1, 2, 3]  # past its deadline: one timed step

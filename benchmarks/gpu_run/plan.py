"""What ``benchmarks/gpu_check.py`` runs: the one list of test files, the multi-rank selection,
the throughput models, and how the time budget is shared between the stages.

Single-process test files on the GPU: each one below has a branch that runs differently on
CuPy, or exists for the GPU. Files with a ``FLEETMPI_DEVICE`` or ``cupy`` mention that are left
out only make sense on the CPU: ``test_comm_async``, ``test_transport_choice`` and
``test_kernels_host`` put a stand-in for CuPy into ``sys.modules`` or patch
``backend.on_gpu``; ``test_elastic``, ``test_environment``, ``test_failure``,
``test_host_memory``, ``test_stall`` and ``test_timeline`` start their jobs with
``FLEETMPI_DEVICE=cpu``; ``test_knobs``, ``test_never_silent``, ``test_pserver_units`` and
``test_comm_safety`` check names, refusals and imports, not device arithmetic.
"""

STAGES = ("install", "gpu_tests", "multi_rank", "throughput", "nonfinite_cost")
# Shares of the time budget; a stage that ends early leaves its time to the ones after it.
# "setup" is the MPI launcher's choice and the version probe, between install and the tests.
BUDGET_WEIGHTS = {"install": 1.0, "setup": 1.0, "gpu_tests": 4.5, "multi_rank": 1.5,
                  "throughput": 2.5, "nonfinite_cost": 0.7}

GPU_TEST_FILES = (
    ("tests/test_gpu_device.py", "NCCL at world size 1, every collective, async handles, "
     "streams and events, transport auto and its fallback warning, checkpoints, optimizers, "
     "AMP, recompute and sharding stages 1-3 on one GPU"),
    ("tests/test_cudnn_frontend.py", "cuDNN through nvidia-cudnn-frontend against im2col and "
     "the attention reference"),
    ("tests/test_products.py", "matrix products through cuBLASLt (nvmath-python) against the "
     "host's, and a planned product captured in a CUDA graph and replayed"),
    ("tests/test_kernels.py", "the fused RawKernels against the unfused layers"),
    ("tests/test_fused_kernels.py", "LayerNorm, cross-entropy, dropout + add and bias + GELU "
     "kernels in a GPT step against the NumPy references"),
    ("tests/test_attention_kernels.py", "attention.cu's forward and backward, compiled by "
     "NVRTC, against the NumPy reference on the host"),
    ("tests/test_amp.py", "float16 products through cuBLASLt and the fused kernels"),
    ("tests/test_amp_precision.py", "amp in float16 and bfloat16, levels O1 and O2, on tensor "
     "cores against float32"),
    ("tests/test_auto.py", "recompute offload, which applies on a GPU only"),
    ("tests/test_checkpoint.py", "CuPy's generator state saved and restored bit for bit"),
    ("tests/test_cuda_graphs.py", "whole steps captured as CUDA graphs through CuPy and "
     "replayed bit for bit as eager ones; the graph's memory pool and its refusals"),
    ("tests/test_gpt.py", "attention, and the embedding's scatter-add of atomic additions"),
    ("tests/test_optim.py", "the fused optimizer kernel against CuPy's unfused update"),
    ("tests/test_paddle_flags.py", "GPU memory flags, read on a GPU only"),
    ("tests/test_recompute.py", "recompute bit for bit on CuPy"),
    ("tests/test_sharding_stages.py", "sharding stages 1-3 at world size 1 on CuPy"),
    ("tests/test_sync_batch_norm.py", "batch statistics against CuPy's own reductions"),
    ("tests/test_tensor_places.py", "a host tensor moved to the GPU with to('gpu')"),
)
# Per-test limit inside the single-process stage (pytest-timeout): it catches a hang, and
# names the test, without failing a slow test on a busy machine.
TEST_TIMEOUT_S = 300
# The dry run's gpu_tests stage runs this many tests of each file (gpu_run/sample.py): every
# file imports, collects and runs on the CPU, and the stage records what ran, in a minute
# rather than the whole list's twenty.
DRY_RUN_SAMPLE_PER_FILE = 3

# Data parallel at 2 ranks on the one GPU over the MPI transport equals one process on the
# global batch: the data-parallel part of tests/run's 8-rank selection.
MULTI_RANK_RANKS = 2
MULTI_RANK_SELECTION = "test_n_ranks_match_one_process and (default or overlapped)"

# benchmarks/train_throughput.py, one run per model: (model, precisions, weight), in order. Each
# run gets its weight's share of the stage's time left (what one leaves goes to the next) and
# times as many steps as fit; a run stopped at the end of its share loses only its own rows.
# --steps is the MLP's measured steps (the other models a share of it). The dry run trains no
# GPU model: GPT-2 there is scaled down, and only asks for bfloat16, which fleetmpi may lack
# (its row then gives the reason).
THROUGHPUT = {
    "gpu": {"steps": 30, "runs": (
        ("mlp", ("fp32", "amp-fp16"), 1.0),
        ("gpt", ("fp32", "amp-fp16"), 1.0),
        ("resnet20", ("fp32", "amp-fp16"), 1.5),
        ("resnet50", ("amp-fp16",), 2.0),
        ("gpt2", ("amp-fp16", "amp-bf16"), 3.5),
    )},
    "cpu": {"steps": 2, "runs": (
        ("mlp", ("fp32", "amp-fp16"), 1.0),
        ("gpt", ("fp32",), 1.0),
        ("gpt2", ("amp-bf16",), 1.0),
    )},
}


# benchmarks/nonfinite_cost.py at one rank, one run per model: (model, steps timed with the
# default non-finite check and without it, each), in order, the stage's time shared equally.
NONFINITE_COST = {
    "gpu": (("mlp", 200), ("gpt", 40)),
    "cpu": (("mlp", 10), ("gpt", 2)),
}


def fleetmpi_device(dry_run):
    """``FLEETMPI_DEVICE`` of the run: the dry run is the same plan on the CPU."""
    return "cpu" if dry_run else "gpu"

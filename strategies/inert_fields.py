"""Fields of DistributedStrategy that change nothing in this trainer, and why.

Every other field changes real behaviour: the strategy switches and their configs (the classes
in this package) and the fields of ``EFFECTIVE``. A field of ``NO_EFFECT`` that a user set away
from its default is reported once per process, on the first worker, so it is never silently
ignored.
"""
from ..log import logger

_NO_CUDNN = "convolutions run as im2col and matrix multiply, without cuDNN"
_IN_ORDER = "the trainer runs one layer at a time, in program order"

EFFECTIVE = {
    "fuse_all_reduce_ops": "gradient buckets: off gives one allreduce per parameter",
    "fuse_grad_size_in_MB": "gradient buckets: the most bytes per fused allreduce",
    "fuse_grad_size_in_TFLOPS": "gradient buckets: the most layers per fused allreduce",
    "nccl_comm_num": "communicator: buckets spread over this many communicators",
    "use_hierarchical_allreduce": "communicator: two-level allreduce",
    "hierarchical_allreduce_inter_nranks": "communicator: ranks per group of the two-level "
                                           "allreduce",
    "build_strategy.fuse_elewise_add_act_ops": "fused bias+activation kernels",
    "build_strategy.fuse_bn_act_ops": "fused batch-norm+ReLU kernels",
    "build_strategy.fuse_all_optimizer_ops": "one optimizer kernel per flat buffer",
    "hybrid_configs": "the hybrid layout: ranks over data x pipeline x sharding x "
                      "model-parallel degrees (fleetmpi.hybrid)",
    "elastic": "fleetmpirun --elastic restarts the job after a failure and "
               "fleetmpi.elastic.State resumes it; reported as not applied in a job that "
               "fleetmpirun --elastic did not start",
}

NO_EFFECT = {
    "sync_nccl_allreduce": "every collective of this trainer completes before the step goes on",
    "cudnn_exhaustive_search": _NO_CUDNN,
    "conv_workspace_size_limit": _NO_CUDNN,
    "cudnn_batchnorm_spatial_persistent": _NO_CUDNN,
    "a_sync": "collective training ignores it; it selects synchronous or asynchronous "
              "training in parameter-server mode (fleet.init(is_collective=False))",
    "a_sync_configs": "collective training ignores it; it configures parameter-server mode "
                      "(fleet.init(is_collective=False))",
    "build_strategy.enable_sequential_execution": _IN_ORDER,
    "build_strategy.fuse_relu_depthwise_conv": "the trainer has no depthwise convolution",
    "build_strategy.fuse_broadcast_ops": "parameter broadcasts are always fused, one per flat "
                                         "buffer",
    "build_strategy.enable_inplace": "gradients are always written in place into the flat "
                                     "gradient buffer",
    "build_strategy.enable_backward_optimizer_op_deps": _IN_ORDER,
    "build_strategy.cache_runtime_context": "there is no operator runtime context to cache",
    "build_strategy.enable_auto_fusion": "fusion is chosen by the fuse_* fields, not searched",
    "execution_strategy.num_threads": _IN_ORDER + "; BLAS threads follow OMP_NUM_THREADS",
    "execution_strategy.num_iteration_per_drop_scope": "there are no variable scopes to drop",
    "execution_strategy.num_iteration_per_run": "each minimize call runs exactly one step",
    "execution_strategy.use_thread_barrier": _IN_ORDER,
}

_reported = set()


def _value(strategy, path):
    value = strategy
    for part in path.split("."):
        value = getattr(value, part)
    return dict(value) if hasattr(value, "keys") else value


def inert_fields_set(strategy):
    """The ``NO_EFFECT`` fields ``strategy`` holds at something other than their default."""
    from ..distributed_strategy import DistributedStrategy

    default = DistributedStrategy()
    return [path for path in NO_EFFECT if _value(strategy, path) != _value(default, path)]


def report_once(path, why, first_worker):
    """Warn (where ``first_worker``) that ``DistributedStrategy.<path>`` has no effect, once
    per process."""
    if path in _reported:
        return
    _reported.add(path)
    if first_worker:
        logger.warning("DistributedStrategy.%s is set but has no effect in fleetmpi: %s",
                       path, why)

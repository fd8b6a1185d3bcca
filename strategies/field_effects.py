"""What each field of DistributedStrategy does in fleetmpi: the one table.

The strategy switches (``compose.ORDER``, and ``auto``) and their ``*_configs`` act in
collective training. Every other field has a row of ``FIELDS``: ``(where, text)``, ``where``
being the mode in which it takes effect (``COLLECTIVE``, ``PARAMETER_SERVER``, ``EVERY_MODE``)
with ``text`` saying what it does, or ``NOWHERE`` with ``text`` saying why it changes nothing.
A row names a field (``"a_sync"``), a key of a message (``"build_strategy.enable_inplace"``),
or a whole message (``"hybrid_configs"``); in collective training a message with a row of its
own is judged as a whole, so ``a_sync_configs`` is reported once there, and key by key in
parameter-server mode.

The views below are what the rest reads: ``EFFECTIVE`` and ``NO_EFFECT`` (collective
training, ``inert_fields`` and ``applied.not_applied``), ``IN_PARAMETER_SERVER_MODE``,
``EFFECTIVE_KEYS`` and ``NO_EFFECT_KEYS`` (parameter-server mode,
``applied.parameter_server_not_applied``), and ``never_effective()`` (the fields that change
nothing in any mode, which tests/test_never_silent.py expects reported wherever they are set).
"""
from fleetmpi.nn.functional import cudnn

COLLECTIVE = "collective"
PARAMETER_SERVER = "parameter-server"
EVERY_MODE = "every mode"
NOWHERE = None

_CUDNN = ("on a GPU with cuDNN (fleetmpi.nn.functional.cudnn; reported as not applied where "
          "there is none): ")
_IN_ORDER = "the trainer runs one layer at a time, in program order"
_PS_MODE = "(fleet.init(is_collective=False))"

FIELDS = {
    "fuse_all_reduce_ops": (COLLECTIVE, "gradient buckets: off gives one allreduce per "
                                        "parameter"),
    "fuse_grad_size_in_MB": (COLLECTIVE, "gradient buckets: the most bytes per fused "
                                         "allreduce"),
    "fuse_grad_size_in_TFLOPS": (COLLECTIVE, "gradient buckets: the most layers per fused "
                                             "allreduce"),
    "last_comm_group_size_MB": (COLLECTIVE, "gradient buckets: the most bytes of the last "
                                            "bucket, reduced after backward"),
    "find_unused_parameters": (COLLECTIVE, "data parallel: parameters without a gradient are "
                                           "reduced as zeros; off warns once naming them"),
    "nccl_comm_num": (COLLECTIVE, "communicator: buckets spread over this many communicators"),
    "use_hierarchical_allreduce": (COLLECTIVE, "communicator: two-level allreduce"),
    "hierarchical_allreduce_inter_nranks": (COLLECTIVE, "communicator: ranks per group of the "
                                                        "two-level allreduce"),
    "build_strategy.fuse_elewise_add_act_ops": (COLLECTIVE, "fused bias+activation kernels"),
    "build_strategy.fuse_bn_act_ops": (COLLECTIVE, "fused batch-norm+ReLU kernels"),
    "build_strategy.fuse_all_optimizer_ops": (COLLECTIVE, "one optimizer kernel per flat "
                                                          "buffer"),
    "hybrid_configs": (COLLECTIVE, "the hybrid layout: ranks over data x pipeline x sharding x "
                                   "model-parallel degrees (fleetmpi.hybrid)"),
    "elastic": (EVERY_MODE, "fleetmpirun --elastic restarts the job after a failure and "
                            "fleetmpi.training.elastic.State resumes it; reported as not "
                            "applied in a job that fleetmpirun --elastic did not start"),
    "a_sync": (PARAMETER_SERVER, f"selects synchronous or asynchronous training in "
                                 f"parameter-server mode {_PS_MODE}"),
    "a_sync_configs": (PARAMETER_SERVER, f"configures parameter-server mode {_PS_MODE}"),
    "a_sync_configs.k_steps": (PARAMETER_SERVER, "selects asynchronous (-1, 0) or GEO (> 0) "
                                                 "training and GEO's push interval"),
    "a_sync_configs.max_merge_var_num": (NOWHERE, "every step's gradient is pushed on its own"),
    "a_sync_configs.send_queue_size": (NOWHERE, "a worker has one push per server in flight, "
                                                "sent as soon as it is made"),
    "a_sync_configs.independent_recv_thread": (NOWHERE, "each push is answered with the "
                                                        "parameters; there is no receiving "
                                                        "thread"),
    "a_sync_configs.min_send_grad_num_before_recv": (NOWHERE, "each push is answered with the "
                                                              "parameters"),
    "a_sync_configs.thread_pool_size": (NOWHERE, "a server handles its messages one at a time"),
    "a_sync_configs.send_wait_times": (NOWHERE, "pushes are never held back"),
    "a_sync_configs.runtime_split_send_recv": (NOWHERE, "parameters are always cut into blocks "
                                                        "when the servers start"),
    "a_sync_configs.launch_barrier": (NOWHERE, "a worker's first pull waits for its servers "
                                               "anyway"),
    "a_sync_configs.heter_worker_device_guard": (NOWHERE, "there are no heterogeneous workers"),
    "a_sync_configs.lr_decay_steps": (NOWHERE, "each push carries the learning rate of the "
                                               "worker's optimizer, so a scheduler steps where "
                                               "the script steps it"),
    "a_sync_configs.use_ps_gpu": (NOWHERE, "servers keep their shards in host memory"),
    "sync_nccl_allreduce": (NOWHERE, "every collective of this trainer completes before the "
                                     "step goes on"),
    "cudnn_exhaustive_search": (EVERY_MODE, _CUDNN + "every plan cuDNN has for a convolution, "
                                                       "batch norm or attention graph is timed "
                                                       "once and the fastest kept; off: cuDNN's "
                                                       "heuristics"),
    "conv_workspace_size_limit": (EVERY_MODE, _CUDNN + "the most scratch memory (MB) a cuDNN "
                                                         "plan may use"),
    "cudnn_batchnorm_spatial_persistent": (NOWHERE, cudnn.PERSISTENT_NOT_IN_GRAPH_API),
    "build_strategy.enable_sequential_execution": (NOWHERE, _IN_ORDER),
    "build_strategy.fuse_relu_depthwise_conv": (NOWHERE, "the trainer has no depthwise "
                                                         "convolution"),
    "build_strategy.fuse_broadcast_ops": (NOWHERE, "parameter broadcasts are always fused, one "
                                                   "per flat buffer"),
    "build_strategy.enable_inplace": (NOWHERE, "gradients are always written in place into "
                                               "the flat gradient buffer"),
    "build_strategy.enable_backward_optimizer_op_deps": (NOWHERE, _IN_ORDER),
    "build_strategy.cache_runtime_context": (NOWHERE, "there is no operator runtime context to "
                                                      "cache"),
    "build_strategy.enable_auto_fusion": (NOWHERE, "fusion is chosen by the fuse_* fields, not "
                                                   "searched"),
    "execution_strategy.num_threads": (NOWHERE, _IN_ORDER + "; BLAS threads follow "
                                                             "OMP_NUM_THREADS"),
    "execution_strategy.num_iteration_per_drop_scope": (NOWHERE, "there are no variable scopes "
                                                                 "to drop"),
    "execution_strategy.num_iteration_per_run": (NOWHERE, "each minimize call runs exactly one "
                                                          "step"),
    "execution_strategy.use_thread_barrier": (NOWHERE, _IN_ORDER),
}


def _judged_in_collective_training(path):
    """False for a key of a message that has a row of its own (judged as a whole there)."""
    owner, dot, _ = path.partition(".")
    return not dot or owner not in FIELDS


def _keys(owner, mode):
    """``{key: text}`` of the keys of message ``owner`` whose rows say ``mode``."""
    return {path.split(".", 1)[1]: text for path, (where, text) in FIELDS.items()
            if path.startswith(owner + ".") and where == mode}


# Collective training: what a field does, or why it changes nothing.
EFFECTIVE = {path: text for path, (where, text) in FIELDS.items()
             if where in (COLLECTIVE, EVERY_MODE)}
NO_EFFECT = {path: (text if where is NOWHERE else f"collective training ignores it; it {text}")
             for path, (where, text) in FIELDS.items()
             if where in (NOWHERE, PARAMETER_SERVER) and _judged_in_collective_training(path)}
# Parameter-server mode: the fields that act there (every other one set is reported), and the
# a_sync_configs keys that act and those that change nothing.
IN_PARAMETER_SERVER_MODE = frozenset(path for path, (where, _) in FIELDS.items()
                                     if where in (PARAMETER_SERVER, EVERY_MODE))
EFFECTIVE_KEYS = _keys("a_sync_configs", PARAMETER_SERVER)
NO_EFFECT_KEYS = _keys("a_sync_configs", NOWHERE)


def never_effective():
    """The field paths that change nothing in any mode."""
    return {path for path, (where, _) in FIELDS.items() if where is NOWHERE}

"""Fields of Paddle 2.0-2.2's ``DistributedStrategy`` message that fleetmpi's schema does not
have, and why each changes nothing here.

A prototxt file Paddle wrote may hold them. ``load_from_prototxt`` keeps each one as it was
written (so ``save_to_prototxt`` writes it back and Paddle reads the file again), and
``applied_strategy().not_applied`` lists it with the reason below, warned once. A name that is
neither a field of fleetmpi's schema nor one of these is refused as a typo, naming file and
line. A field fleetmpi later implements moves from this table into ``distributed_strategy.proto``
(``tests/test_never_silent.py`` fails while a name is in both).
"""

_HYBRID = ("fleetmpi lays ranks out over data, model, pipeline and sharding degrees from "
           "hybrid_configs; set the degrees there")

PADDLE_ONLY = {
    "mode": "fleetmpi takes the mode from fleet.init (is_collective or the role maker), as "
            "Paddle's fleet.init does",
    "without_graph_optimization": "the trainer runs define-by-run; there is no program graph "
                                  "to optimize",
    "fuse_grad_size_in_num": "gradient buckets are bounded by fuse_grad_size_in_MB and "
                             "fuse_grad_size_in_TFLOPS",
    "calc_comm_same_stream": "communication runs on the comm layer's own stream or MPI "
                             "progress, chosen by the transport",
    "asp": "automatic sparsity (2:4 pruning) is not implemented",
    "fuse_grad_merge": "gradient_merge accumulates into the flat gradient buffer, which is "
                       "already one fused buffer",
    "semi_auto": "semi-automatic parallel needs tensor annotations this trainer does not have",
    "heter_ccl_mode": "there are no heterogeneous devices in one job",
    "trainer_desc_configs": "parameter-server workers train in the script's own loop, with no "
                            "trainer descriptor",
    "downpour_table_param": "sparse tables are the model's Embedding(sparse=True) layers, "
                            "configured in Python",
    "fs_client_param": "shards are saved to and loaded from local paths",
    "gradient_scale_configs": "gradients are averaged over the ranks (the mean loss over the "
                              "global batch), Paddle's default scale",
    "amp_configs.custom_black_varnames": "amp casts by operation name, not by variable "
                                         "name",
    "amp_configs.use_fp16_guard": "amp casts by operation, not by fp16_guard blocks",
    "pipeline_configs.p2p_cache_shape": "stage boundaries always exchange shapes with the "
                                        "activations",
    "sharding_configs.sharding_segment_strategy": "parameters are broadcast in buckets of "
                                                  "sharding_configs.fuse_broadcast_MB",
    "sharding_configs.segment_broadcast_MB": "set sharding_configs.fuse_broadcast_MB, Paddle "
                                             "2.0's name, which fleetmpi applies",
    "sharding_configs.segment_anchors": "parameters are broadcast in buckets of "
                                        "sharding_configs.fuse_broadcast_MB",
    "sharding_configs.mp_degree": _HYBRID,
    "sharding_configs.dp_degree": "sharding_configs.hybrid_dp sets data parallelism beside "
                                  "sharding",
    "sharding_configs.pp_degree": _HYBRID,
    "sharding_configs.gradient_merge_acc_step": "set gradient_merge_configs.k_steps",
    "sharding_configs.optimize_offload": "optimizer state stays on the device",
    "sharding_configs.pp_allreduce_in_optimize": _HYBRID,
    "sharding_configs.optimize_cast": "amp keeps float32 master parameters in the optimizer",
    "build_strategy.fuse_bn_add_act_ops": "the trainer fuses batch-norm+ReLU "
                                          "(fuse_bn_act_ops), not batch-norm+add+ReLU",
    "build_strategy.enable_addto": "gradients are always accumulated in place in the flat "
                                   "gradient buffer",
    "build_strategy.fix_op_run_order": "the trainer runs one layer at a time, in program "
                                       "order",
    "build_strategy.allow_cuda_graph_capture": "there is no CUDA graph capture",
}

"""Every example code block of the seed documents that concerns DistributedStrategy.

Each test is the seed's code with ``paddle.distributed.fleet`` (and ``paddle.static`` /
``fluid``'s strategy classes) replaced by ``fleetmpi``; the seed file is named in the docstring.
"""
import pytest

import fleetmpi as fleet


def test_recompute_checkpoints():
    """000, 002: recompute with checkpoint names."""
    strategy = fleet.DistributedStrategy()
    strategy.recompute = True
    # suppose x and y are names of checkpoint tensors for recomputation
    strategy.recompute_configs = {"checkpoints": ["x", "y"]}
    assert strategy.recompute is True
    assert strategy.recompute_configs["checkpoints"] == ["x", "y"]
    assert strategy.recompute_configs["enable_offload"] is False


def test_recompute_offload():
    """001: recompute with offload and checkpoint_shape."""
    strategy = fleet.DistributedStrategy()
    strategy.recompute = True
    strategy.recompute_configs = {
        "enable_offload": True,
        "checkpoint_shape": [100, 512, 1024]
    }
    assert strategy.recompute_configs["enable_offload"] is True
    assert strategy.recompute_configs["checkpoint_shape"] == [100, 512, 1024]
    assert strategy.recompute_configs["checkpoints"] == []


def test_pipeline():
    """000, 001: pipeline, then pipeline with micro_batch."""
    strategy = fleet.DistributedStrategy()
    strategy.pipeline = True
    assert strategy.pipeline is True
    assert strategy.pipeline_configs["micro_batch"] == 1

    strategy = fleet.DistributedStrategy()
    strategy.pipeline = True
    strategy.pipeline_configs = {"micro_batch": 12}
    assert strategy.pipeline_configs["micro_batch"] == 12


def test_gradient_merge():
    """000, 002: gradient_merge with k_steps and avg."""
    strategy = fleet.DistributedStrategy()
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": 4, "avg": True}
    assert strategy.gradient_merge is True
    assert dict(strategy.gradient_merge_configs) == {"k_steps": 4, "avg": True}


def test_lars():
    """000, 001: lars with every config key (epsilon given as the int 0)."""
    strategy = fleet.DistributedStrategy()
    strategy.lars = True
    strategy.lars_configs = {
        "lars_coeff": 0.001,
        "lars_weight_decay": 0.0005,
        "epsilon": 0,
        "exclude_from_weight_decay": ["batch_norm", ".b"],
    }
    assert dict(strategy.lars_configs) == {
        "lars_coeff": 0.001, "lars_weight_decay": 0.0005, "epsilon": 0.0,
        "exclude_from_weight_decay": ["batch_norm", ".b"]}


def test_lamb():
    """000, 001: lamb with its config keys."""
    strategy = fleet.DistributedStrategy()
    strategy.lamb = True
    strategy.lamb_configs = {
        'lamb_weight_decay': 0.01,
        'exclude_from_weight_decay': [],
    }
    assert strategy.lamb is True
    assert dict(strategy.lamb_configs) == {"lamb_weight_decay": 0.01,
                                           "exclude_from_weight_decay": []}


def test_localsgd():
    """000, 001: localsgd, then localsgd_configs."""
    strategy = fleet.DistributedStrategy()
    strategy.localsgd = True  # by default this is false
    assert strategy.localsgd is True

    strategy = fleet.DistributedStrategy()
    strategy.localsgd = True
    strategy.localsgd_configs = {"k_steps": 4,
                                 "begin_step": 30}
    assert dict(strategy.localsgd_configs) == {"k_steps": 4, "begin_step": 30}


def test_adaptive_localsgd():
    """000, 001: adaptive_localsgd, then adaptive_localsgd_configs."""
    strategy = fleet.DistributedStrategy()
    strategy.adaptive_localsgd = True  # by default this is false
    assert strategy.adaptive_localsgd is True

    strategy = fleet.DistributedStrategy()
    strategy.adaptive_localsgd = True
    strategy.adaptive_localsgd_configs = {"init_k_steps": 1,
                                          "begin_step": 30}
    assert dict(strategy.adaptive_localsgd_configs) == {"init_k_steps": 1, "begin_step": 30}


def test_execution_strategy():
    """001: an ExecutionStrategy assigned to the strategy."""
    exe_strategy = fleet.ExecutionStrategy()
    exe_strategy.num_threads = 10
    exe_strategy.num_iteration_per_drop_scope = 10
    exe_strategy.num_iteration_per_run = 10
    strategy = fleet.DistributedStrategy()
    strategy.execution_strategy = exe_strategy
    assert strategy.execution_strategy.num_threads == 10
    assert strategy.execution_strategy.num_iteration_per_drop_scope == 10
    assert strategy.execution_strategy.num_iteration_per_run == 10
    assert strategy.execution_strategy == exe_strategy


def test_build_strategy():
    """001: a BuildStrategy with every switch of the example assigned to the strategy."""
    build_strategy = fleet.BuildStrategy()
    build_strategy.enable_sequential_execution = True
    build_strategy.fuse_elewise_add_act_ops = True
    build_strategy.fuse_bn_act_ops = True
    build_strategy.enable_auto_fusion = True
    build_strategy.fuse_relu_depthwise_conv = True
    build_strategy.fuse_broadcast_ops = True
    build_strategy.fuse_all_optimizer_ops = True
    build_strategy.enable_inplace = True
    strategy = fleet.DistributedStrategy()
    strategy.build_strategy = build_strategy
    for name in ("enable_sequential_execution", "fuse_elewise_add_act_ops", "fuse_bn_act_ops",
                 "enable_auto_fusion", "fuse_relu_depthwise_conv", "fuse_broadcast_ops",
                 "fuse_all_optimizer_ops", "enable_inplace"):
        assert getattr(strategy.build_strategy, name) is True, name
    assert strategy.build_strategy.cache_runtime_context is False


def test_auto():
    """001, 003: auto alone."""
    strategy = fleet.DistributedStrategy()
    strategy.auto = True
    # if set other strategy at the same time, auto will not apply
    # strategy.amp = True
    assert strategy.auto is True
    assert strategy.amp is False


def test_amp():
    """001: amp with init_loss_scaling and a custom white list."""
    strategy = fleet.DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {
        "init_loss_scaling": 32768,
        "custom_white_list": ['conv2d']}
    assert strategy.amp_configs["init_loss_scaling"] == 32768.0
    assert strategy.amp_configs["custom_white_list"] == ["conv2d"]
    assert strategy.amp_configs["decr_ratio"] == 0.5


def test_dgc():
    """001: dgc, then dgc_configs."""
    strategy = fleet.DistributedStrategy()
    strategy.dgc = True  # by default this is false
    assert strategy.dgc is True

    strategy = fleet.DistributedStrategy()
    strategy.dgc = True
    strategy.dgc_configs = {"rampup_begin_step": 1252}
    assert dict(strategy.dgc_configs) == {"rampup_begin_step": 1252, "rampup_step": 1,
                                          "sparsity": [0.999]}


def test_fp16_allreduce():
    """001: fp16_allreduce."""
    strategy = fleet.DistributedStrategy()
    strategy.fp16_allreduce = True  # by default this is false
    assert strategy.fp16_allreduce is True


def test_sharding():
    """001: sharding, then sharding_configs."""
    strategy = fleet.DistributedStrategy()
    strategy.sharding = True
    assert strategy.sharding is True

    strategy = fleet.DistributedStrategy()
    strategy.sharding = True
    strategy.sharding_configs = {
        "fuse_broadcast_MB": 32,
        "hybrid_dp": True,
    }
    assert dict(strategy.sharding_configs) == {"fuse_broadcast_MB": 32.0, "hybrid_dp": True,
                                               "sharding_group_size": 8, "sharding_degree": 8,
                                               "stage": 1, "prefetch_depth": 0,
                                               "unit_size_MB": 0.0}


def test_amp_recompute_lars_combination():
    """003: the amp + recompute + lars combination (checkpoints given by the model)."""
    checkpoints = ["res2a", "res3a", "res4a", "res5a"]
    dist_strategy = fleet.DistributedStrategy()
    dist_strategy.amp = True
    dist_strategy.recompute = True
    dist_strategy.recompute_configs = {"checkpoints": checkpoints}
    dist_strategy.lars = True
    dist_strategy.lars_configs = {
        "lars_coeff": 0.001,
        "lars_weight_decay": 0.0005,
        "exclude_from_weight_decay": ['batch_norm', '.b_0']
    }
    assert dist_strategy.amp and dist_strategy.recompute and dist_strategy.lars
    assert dist_strategy.recompute_configs["checkpoints"] == checkpoints
    assert dist_strategy.lars_configs["exclude_from_weight_decay"] == ["batch_norm", ".b_0"]
    assert dist_strategy.lars_configs["epsilon"] == 0.0


def test_op_fusion_switches_on_the_strategy():
    """004: the guide sets BuildStrategy's fusion switches on the strategy itself."""
    dist_strategy = fleet.DistributedStrategy()
    dist_strategy.fuse_all_optimizer_ops = True
    dist_strategy.fuse_bn_act_ops = True
    dist_strategy.fuse_elewise_add_act_ops = True
    assert dist_strategy.build_strategy.fuse_all_optimizer_ops is True
    assert dist_strategy.build_strategy.fuse_bn_act_ops is True
    assert dist_strategy.build_strategy.fuse_elewise_add_act_ops is True
    assert dist_strategy.fuse_bn_act_ops is True


def test_allreduce_fusion():
    """004: AllReduce fusion sizes."""
    dist_strategy = fleet.DistributedStrategy()
    dist_strategy.fuse_grad_size_in_MB = 16
    dist_strategy.fuse_grad_size_in_TFLOPS = 50
    dist_strategy.fuse_all_reduce_ops = True
    assert dist_strategy.fuse_grad_size_in_MB == 16
    assert dist_strategy.fuse_grad_size_in_TFLOPS == 50
    assert dist_strategy.fuse_all_reduce_ops is True


def test_hierarchical_allreduce():
    """004: hierarchical allreduce with 8 ranks per low-level group."""
    dist_strategy = fleet.DistributedStrategy()
    dist_strategy.use_hierarchical_allreduce = True
    dist_strategy.hierarchical_allreduce_inter_nranks = 8
    assert dist_strategy.use_hierarchical_allreduce is True
    assert dist_strategy.hierarchical_allreduce_inter_nranks == 8


def test_sync_allreduce_and_nccl_comm_num():
    """004: sync_nccl_allreduce, and nccl_comm_num = 2."""
    dist_strategy = fleet.DistributedStrategy()
    dist_strategy.sync_nccl_allreduce = True
    assert dist_strategy.sync_nccl_allreduce is True

    dist_strategy = fleet.DistributedStrategy()
    dist_strategy.nccl_comm_num = 2
    assert dist_strategy.nccl_comm_num == 2


def test_thread_num():
    """004: the guide's thread_num is execution_strategy.num_threads."""
    dist_strategy = fleet.DistributedStrategy()
    dist_strategy.thread_num = 3
    assert dist_strategy.execution_strategy.num_threads == 3
    assert dist_strategy.thread_num == 3


def test_drop_scope_example_names_the_right_place():
    """004: the guide's ``dist_strategy.BuildStrategy = {'num_iteration_per_drop_scope': 30}``
    names neither a field nor the right message; fleetmpi says so, and the intended setting
    works through execution_strategy."""
    dist_strategy = fleet.DistributedStrategy()
    with pytest.raises(AttributeError, match="did you mean 'build_strategy'"):
        dist_strategy.BuildStrategy = {'num_iteration_per_drop_scope': 30}
    with pytest.raises(fleet.ConfigError, match="num_iteration_per_drop_scope"):
        dist_strategy.build_strategy = {'num_iteration_per_drop_scope': 30}
    dist_strategy.execution_strategy = {'num_iteration_per_drop_scope': 30}
    assert dist_strategy.execution_strategy.num_iteration_per_drop_scope == 30


def test_resnet50_example_strategy(tmp_path, monkeypatch):
    """004: the ResNet50 example's strategy, saved to dist_strategy.prototxt."""
    monkeypatch.chdir(tmp_path)
    dist_strategy = fleet.DistributedStrategy()

    # distributed strategy
    dist_strategy.sync_nccl_allreduce = True
    dist_strategy.nccl_comm_num = 2
    dist_strategy.fuse_all_reduce_ops = True

    # build strategy
    build_strategy = fleet.BuildStrategy()
    build_strategy.enable_sequential_execution = True
    build_strategy.fuse_elewise_add_act_ops = True
    build_strategy.fuse_bn_act_ops = True
    build_strategy.enable_auto_fusion = True
    build_strategy.fuse_all_optimizer_ops = True
    dist_strategy.build_strategy = build_strategy

    # execute strategy
    execution_strategy = fleet.ExecutionStrategy()
    execution_strategy.num_threads = 3
    execution_strategy.num_iteration_per_drop_scope = 100
    execution_strategy.num_iteration_per_run = 1
    dist_strategy.execution_strategy = execution_strategy

    # amp
    dist_strategy.amp = True
    dist_strategy.amp_configs = {
        "init_loss_scaling": 128,
        "decr_every_n_nan_or_inf": 2,
        "incr_every_n_steps": 1000,
        "incr_ratio": 2.0,
        "use_dynamic_loss_scaling": True,
        "decr_ratio": 0.5,
        "custom_white_list": [],
        "custom_black_list": [],
    }

    dist_strategy.save_to_prototxt("dist_strategy.prototxt")

    loaded = fleet.DistributedStrategy().load_from_prototxt("dist_strategy.prototxt")
    assert loaded == dist_strategy
    assert loaded.nccl_comm_num == 2
    assert loaded.build_strategy == build_strategy
    assert loaded.execution_strategy == execution_strategy
    assert loaded.amp_configs["init_loss_scaling"] == 128.0

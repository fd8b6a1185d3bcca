"""DistributedStrategy: every field and config key of the seeds, their defaults, and the errors."""
import copy
import math

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.config import schema_view

# The seeds' field tables and references (004, 000, 001), written out independently of the schema.
TOP_LEVEL_DEFAULTS = {
    "auto": False,
    "a_sync": True,
    "sync_nccl_allreduce": True,
    "nccl_comm_num": 1,
    "use_hierarchical_allreduce": False,
    "hierarchical_allreduce_inter_nranks": 1,
    "sync_batch_norm": False,
    "fuse_all_reduce_ops": True,
    "fuse_grad_size_in_MB": 32,
    "fuse_grad_size_in_TFLOPS": 20.0,
    "last_comm_group_size_MB": 1.0,
    "find_unused_parameters": False,
    "cudnn_exhaustive_search": True,
    "conv_workspace_size_limit": 4000,
    "cudnn_batchnorm_spatial_persistent": True,
    "recompute": False,
    "pipeline": False,
    "gradient_merge": False,
    "lars": False,
    "lamb": False,
    "localsgd": False,
    "adaptive_localsgd": False,
    "amp": False,
    "dgc": False,
    "fp16_allreduce": False,
    "sharding": False,
    "elastic": False,
    "tensor_parallel": False,
}

CONFIG_DEFAULTS = {
    "recompute_configs": {"checkpoints": [], "enable_offload": False, "checkpoint_shape": []},
    "pipeline_configs": {"micro_batch": 1, "accumulate_steps": 1, "schedule_mode": "1F1B",
                         "micro_batch_size": 1},
    "gradient_merge_configs": {"k_steps": 1, "avg": True},
    "lars_configs": {"lars_coeff": 0.001, "lars_weight_decay": 0.0005, "epsilon": 0.0,
                     "exclude_from_weight_decay": []},
    "lamb_configs": {"lamb_weight_decay": 0.01, "exclude_from_weight_decay": []},
    "localsgd_configs": {"k_steps": 1, "begin_step": 1},
    "adaptive_localsgd_configs": {"init_k_steps": 1, "begin_step": 1},
    "amp_configs": {"init_loss_scaling": 32768.0, "use_dynamic_loss_scaling": True,
                    "incr_every_n_steps": 1000, "decr_every_n_nan_or_inf": 2,
                    "incr_ratio": 2.0, "decr_ratio": 0.5,
                    "custom_white_list": [], "custom_black_list": [],
                    "use_pure_fp16": False, "use_pure_bf16": False, "dtype": "float16",
                    "level": "O1"},
    "dgc_configs": {"rampup_begin_step": 0, "rampup_step": 1, "sparsity": [0.999]},
    "sharding_configs": {"fuse_broadcast_MB": 32.0, "hybrid_dp": False, "sharding_group_size": 8,
                         "sharding_degree": 8, "stage": 1, "prefetch_depth": 0,
                         "unit_size_MB": 0.0},
    "hybrid_configs": {"dp_degree": -1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 1},
    "tensor_parallel_configs": {"tensor_parallel_degree": 1, "tensor_init_seed": -1},
    "a_sync_configs": {"k_steps": -1, "max_merge_var_num": 1, "send_queue_size": 16,
                       "independent_recv_thread": False, "min_send_grad_num_before_recv": 1,
                       "thread_pool_size": 1, "send_wait_times": 1,
                       "runtime_split_send_recv": False, "launch_barrier": True,
                       "heter_worker_device_guard": "cpu", "lr_decay_steps": 10,
                       "use_ps_gpu": 0},
}

BUILD_STRATEGY_DEFAULTS = {
    "enable_sequential_execution": False, "fuse_elewise_add_act_ops": False,
    "fuse_bn_act_ops": False, "fuse_relu_depthwise_conv": False, "fuse_broadcast_ops": False,
    "fuse_all_optimizer_ops": False, "enable_inplace": False,
    "enable_backward_optimizer_op_deps": True, "cache_runtime_context": False,
    "enable_auto_fusion": False,
}

EXECUTION_STRATEGY_DEFAULTS = {
    "num_threads": 1, "num_iteration_per_drop_scope": 10, "num_iteration_per_run": 3,
    "use_thread_barrier": False,
}

# Values a user could try that the seeds' semantics make impossible: (configs, key, value).
IMPOSSIBLE_CONFIG_VALUES = [
    ("gradient_merge_configs", "k_steps", 0),
    ("localsgd_configs", "k_steps", 0),
    ("localsgd_configs", "begin_step", -1),
    ("adaptive_localsgd_configs", "init_k_steps", 0),
    ("pipeline_configs", "micro_batch", 0),
    ("amp_configs", "init_loss_scaling", 0.0),
    ("amp_configs", "incr_ratio", 1.0),
    ("amp_configs", "incr_ratio", 0.5),
    ("amp_configs", "decr_ratio", 1.0),
    ("amp_configs", "decr_ratio", 2.0),
    ("amp_configs", "decr_ratio", 0.0),
    ("amp_configs", "incr_every_n_steps", 0),
    ("amp_configs", "decr_every_n_nan_or_inf", 0),
    ("amp_configs", "dtype", "float64"),
    ("amp_configs", "level", "O3"),
    ("dgc_configs", "sparsity", [1.0]),
    ("dgc_configs", "sparsity", [0.9, -0.1]),
    ("dgc_configs", "rampup_step", 0),
    ("dgc_configs", "rampup_begin_step", -5),
    ("lars_configs", "lars_coeff", 0.0),
    ("lars_configs", "lars_weight_decay", -0.1),
    ("lars_configs", "epsilon", -1e-9),
    ("lamb_configs", "lamb_weight_decay", -0.01),
    ("sharding_configs", "fuse_broadcast_MB", -1),
    ("sharding_configs", "fuse_broadcast_MB", 0),
    ("sharding_configs", "sharding_group_size", 0),
    ("sharding_configs", "prefetch_depth", -1),
    ("sharding_configs", "unit_size_MB", -0.5),
    ("sharding_configs", "sharding_degree", 0),
    ("sharding_configs", "stage", 0),
    ("sharding_configs", "stage", 4),
    ("hybrid_configs", "dp_degree", -2),
    ("hybrid_configs", "mp_degree", 0),
    ("hybrid_configs", "pp_degree", 0),
    ("hybrid_configs", "sharding_degree", 0),
    ("tensor_parallel_configs", "tensor_parallel_degree", 0),
    ("tensor_parallel_configs", "tensor_init_seed", -2),
    ("recompute_configs", "checkpoint_shape", [100, -1, 1024]),
    ("a_sync_configs", "k_steps", -2),
    ("a_sync_configs", "send_queue_size", 0),
    ("a_sync_configs", "heter_worker_device_guard", "tpu"),
]

IMPOSSIBLE_TOP_LEVEL_VALUES = [
    ("nccl_comm_num", 0),
    ("hierarchical_allreduce_inter_nranks", 0),
    ("fuse_grad_size_in_MB", -16),
    ("fuse_grad_size_in_TFLOPS", 0),
    ("last_comm_group_size_MB", 0),
    ("conv_workspace_size_limit", -1),
    ("nccl_comm_num", 2**31),
]

WRONG_TYPES = [
    ("amp", 1),
    ("amp", "True"),
    ("nccl_comm_num", 2.0),
    ("nccl_comm_num", True),
    ("fuse_grad_size_in_MB", "16"),
    ("recompute_configs", ["x"]),
    ("amp_configs", None),
]


def test_top_level_defaults():
    strategy = fleet.DistributedStrategy()
    for name, default in TOP_LEVEL_DEFAULTS.items():
        value = getattr(strategy, name)
        assert value == default and type(value) is type(default), name


@pytest.mark.parametrize("name", sorted(CONFIG_DEFAULTS))
def test_config_defaults(name):
    configs = getattr(fleet.DistributedStrategy(), name)
    assert dict(configs) == CONFIG_DEFAULTS[name]


def test_build_and_execution_strategy_defaults():
    strategy = fleet.DistributedStrategy()
    for obj in (fleet.BuildStrategy(), strategy.build_strategy):
        assert {k: getattr(obj, k) for k in BUILD_STRATEGY_DEFAULTS} == BUILD_STRATEGY_DEFAULTS
    for obj in (fleet.ExecutionStrategy(), strategy.execution_strategy):
        assert ({k: getattr(obj, k) for k in EXECUTION_STRATEGY_DEFAULTS}
                == EXECUTION_STRATEGY_DEFAULTS)


def test_the_schema_has_exactly_the_fields_of_the_seeds():
    strategy = fleet.DistributedStrategy()
    schema_fields = set(strategy._message.DESCRIPTOR.fields_by_name)
    assert schema_fields == (set(TOP_LEVEL_DEFAULTS) | set(CONFIG_DEFAULTS)
                             | {"build_strategy", "execution_strategy"})
    for name, keys in CONFIG_DEFAULTS.items():
        assert set(getattr(strategy, name)) == set(keys), name
    assert set(fleet.BuildStrategy()._message.DESCRIPTOR.fields_by_name) == set(
        BUILD_STRATEGY_DEFAULTS)
    assert set(fleet.ExecutionStrategy()._message.DESCRIPTOR.fields_by_name) == set(
        EXECUTION_STRATEGY_DEFAULTS)


@pytest.mark.parametrize("name", sorted(TOP_LEVEL_DEFAULTS))
def test_every_switch_can_be_set_and_read_back(name):
    strategy = fleet.DistributedStrategy()
    default = TOP_LEVEL_DEFAULTS[name]
    new = (not default) if isinstance(default, bool) else default + 3
    setattr(strategy, name, new)
    assert getattr(strategy, name) == new
    assert getattr(fleet.DistributedStrategy(), name) == default


def test_assigning_a_configs_dict_updates_only_the_given_keys():
    strategy = fleet.DistributedStrategy()
    strategy.amp_configs = {"init_loss_scaling": 128, "custom_white_list": ["conv2d"]}
    strategy.amp_configs = {"decr_ratio": 0.25}
    expected = dict(CONFIG_DEFAULTS["amp_configs"], init_loss_scaling=128.0,
                    custom_white_list=["conv2d"], decr_ratio=0.25)
    assert dict(strategy.amp_configs) == expected


def test_configs_are_live_views():
    strategy = fleet.DistributedStrategy()
    strategy.gradient_merge_configs["k_steps"] = 8
    assert strategy.gradient_merge_configs["k_steps"] == 8
    strategy.build_strategy.fuse_bn_act_ops = True
    assert strategy.build_strategy.fuse_bn_act_ops is True
    strategy.execution_strategy.num_threads = 4
    assert strategy.execution_strategy.num_threads == 4


def test_list_edits_through_a_live_view_are_kept_or_refused():
    strategy = fleet.DistributedStrategy()
    checkpoints = strategy.recompute_configs["checkpoints"]
    checkpoints.append("act3")
    checkpoints += ["act5", "act7"]
    checkpoints[0] = "act1"
    checkpoints.remove("act5")
    assert checkpoints.pop() == "act7"
    checkpoints.insert(0, "act0")
    assert strategy.recompute_configs["checkpoints"] == ["act0", "act1"] == checkpoints
    strategy.amp_configs["custom_white_list"].extend(["conv2d", "matmul"])
    strategy.amp_configs["custom_white_list"].sort()
    assert strategy.amp_configs["custom_white_list"] == ["conv2d", "matmul"]
    strategy.dgc_configs["sparsity"].append(0.99)
    assert strategy.dgc_configs["sparsity"] == [0.999, 0.99]
    for edit, error in ((lambda: checkpoints.append(5), TypeError),
                        (lambda: checkpoints.extend([None]), TypeError),
                        (lambda: strategy.dgc_configs["sparsity"].__setitem__(0, 1.5),
                         fleet.ConfigError)):
        with pytest.raises(error, match="allowed"):
            edit()
    assert strategy.recompute_configs["checkpoints"] == ["act0", "act1"] == checkpoints
    assert strategy.dgc_configs["sparsity"] == [0.999, 0.99]
    other = fleet.DistributedStrategy()
    other.recompute_configs = strategy.recompute_configs
    assert other.recompute_configs == strategy.recompute_configs


def test_loss_scaling_must_be_finite_in_float32():
    strategy = fleet.DistributedStrategy()
    with pytest.raises(fleet.ConfigError, match=r"init_loss_scaling.*3.4028234663852886e\+38"):
        strategy.amp_configs = {"init_loss_scaling": 1e39}
    strategy.amp_configs = {"init_loss_scaling": float(np.finfo(np.float32).max)}
    assert np.isfinite(np.float32(strategy.amp_configs["init_loss_scaling"]))


def test_an_integer_too_large_for_a_double_is_refused_by_key_value_and_range():
    """A Python integer beyond a double's range (float() overflows) is a ConfigError naming
    the key, the value and the range, set whole or as one key, and changes nothing; so is
    one too large for an integer field, and one Python will not write out in full."""
    strategy = fleet.DistributedStrategy()
    expected = (r"amp_configs\['init_loss_scaling'\] = 1\.000e\+400 does not fit in a double; "
                r"allowed: a number in \(0, 3\.4028234663852886e\+38\]")
    with pytest.raises(fleet.ConfigError, match=expected):
        strategy.amp_configs = {"init_loss_scaling": 10**400}
    with pytest.raises(fleet.ConfigError, match=expected):
        strategy.amp_configs["init_loss_scaling"] = 10**400
    assert strategy.amp_configs["init_loss_scaling"] == 32768.0
    with pytest.raises(fleet.ConfigError, match=r"k_steps'\] = -1\.000e\+5000 does not fit"):
        strategy.gradient_merge_configs = {"k_steps": -10**5000}
    assert strategy.gradient_merge_configs["k_steps"] == 1


def test_numpy_scalars_and_ints_for_floats_are_accepted():
    strategy = fleet.DistributedStrategy()
    strategy.lars_configs = {"epsilon": 0, "lars_coeff": np.float32(0.5)}
    strategy.nccl_comm_num = np.int64(2)
    assert strategy.lars_configs["epsilon"] == 0.0
    assert type(strategy.lars_configs["epsilon"]) is float
    assert strategy.lars_configs["lars_coeff"] == 0.5
    assert strategy.nccl_comm_num == 2 and type(strategy.nccl_comm_num) is int


def test_float_values_are_kept_exactly():
    strategy = fleet.DistributedStrategy()
    strategy.lars_configs = {"lars_coeff": 0.001}
    assert strategy.lars_configs["lars_coeff"] == 0.001


@pytest.mark.parametrize("configs,key,value", IMPOSSIBLE_CONFIG_VALUES)
def test_impossible_config_values_are_refused_by_name_and_range(configs, key, value):
    strategy = fleet.DistributedStrategy()
    before = dict(getattr(strategy, configs))
    with pytest.raises(fleet.ConfigError) as info:
        setattr(strategy, configs, {key: value})
    message = str(info.value)
    assert configs in message and key in message and "allowed" in message
    assert dict(getattr(strategy, configs)) == before


@pytest.mark.parametrize("name,value", IMPOSSIBLE_TOP_LEVEL_VALUES)
def test_impossible_top_level_values_are_refused(name, value):
    strategy = fleet.DistributedStrategy()
    with pytest.raises(fleet.ConfigError, match=name):
        setattr(strategy, name, value)
    assert getattr(strategy, name) == TOP_LEVEL_DEFAULTS[name]


def test_range_is_named_in_the_error():
    strategy = fleet.DistributedStrategy()
    with pytest.raises(fleet.ConfigError, match=r"incr_ratio.*\(1, inf\)"):
        strategy.amp_configs = {"incr_ratio": 0.9}
    with pytest.raises(fleet.ConfigError, match=r"decr_ratio.*\(0, 1\)"):
        strategy.amp_configs = {"decr_ratio": 1.5}
    with pytest.raises(fleet.ConfigError, match=r"sparsity'\]\[0\].*\[0, 1\)"):
        strategy.dgc_configs = {"sparsity": [1.5]}


def test_fuse_grad_size_in_tflops_takes_any_positive_float_as_paddle():
    strategy = fleet.DistributedStrategy()
    strategy.fuse_grad_size_in_TFLOPS = 0.5
    assert strategy.fuse_grad_size_in_TFLOPS == 0.5
    for bad in (0, -0.5):
        with pytest.raises(fleet.ConfigError, match=r"fuse_grad_size_in_TFLOPS.*\(0, inf\)"):
            strategy.fuse_grad_size_in_TFLOPS = bad


def test_nan_is_refused():
    strategy = fleet.DistributedStrategy()
    with pytest.raises(fleet.ConfigError, match="lars_coeff"):
        strategy.lars_configs = {"lars_coeff": math.nan}


@pytest.mark.parametrize("name,value", WRONG_TYPES)
def test_wrong_types_are_refused(name, value):
    strategy = fleet.DistributedStrategy()
    before = copy.deepcopy(strategy)
    with pytest.raises(TypeError, match=name):
        setattr(strategy, name, value)
    assert strategy == before


def test_wrong_types_inside_configs_are_refused():
    strategy = fleet.DistributedStrategy()
    with pytest.raises(TypeError, match="checkpoints"):
        strategy.recompute_configs = {"checkpoints": "x"}
    with pytest.raises(TypeError, match=r"custom_white_list'\]\[1\]"):
        strategy.amp_configs = {"custom_white_list": ["conv2d", 3]}
    with pytest.raises(TypeError, match="avg"):
        strategy.gradient_merge_configs = {"avg": "sum"}
    with pytest.raises(TypeError, match="k_steps"):
        strategy.gradient_merge_configs = {"k_steps": 2.5}


def test_unknown_config_key_is_named_with_the_valid_ones():
    strategy = fleet.DistributedStrategy()
    with pytest.raises(fleet.ConfigError) as info:
        strategy.gradient_merge_configs = {"k_step": 4}
    message = str(info.value)
    assert "'k_step'" in message and "k_steps" in message and "avg" in message
    assert "did you mean 'k_steps'" in message
    with pytest.raises(KeyError, match="k_step"):
        strategy.gradient_merge_configs["k_step"]


def test_unknown_attribute_is_named_with_a_suggestion():
    strategy = fleet.DistributedStrategy()
    with pytest.raises(AttributeError, match="did you mean 'amp_configs'"):
        strategy.amp_config = {"init_loss_scaling": 1.0}
    with pytest.raises(AttributeError, match="recomputee"):
        strategy.recomputee
    assert not hasattr(strategy, "no_such_field")


def test_a_failed_assignment_changes_nothing():
    strategy = fleet.DistributedStrategy()
    strategy.amp_configs = {"init_loss_scaling": 1024}
    before = copy.deepcopy(strategy)
    with pytest.raises(fleet.ConfigError):
        strategy.amp_configs = {"init_loss_scaling": 64, "incr_ratio": 0.5}
    with pytest.raises(fleet.ConfigError):
        strategy.amp_configs = {"init_loss_scaling": 64, "no_such_key": 1}
    with pytest.raises(TypeError):
        strategy.amp_configs = {"init_loss_scaling": 64, "custom_black_list": "softmax"}
    with pytest.raises(fleet.ConfigError):
        strategy.build_strategy = {"fuse_bn_act_ops": True, "num_threads": 2}
    assert strategy == before
    assert strategy.amp_configs["init_loss_scaling"] == 1024


def test_setting_order_does_not_matter():
    def configure(order):
        strategy = fleet.DistributedStrategy()
        steps = {
            "a_sync": lambda s: setattr(s, "a_sync", True),
            "a_sync_configs": lambda s: setattr(s, "a_sync_configs", {"k_steps": 100}),
            "amp": lambda s: setattr(s, "amp", True),
            "amp_configs": lambda s: setattr(s, "amp_configs", {"init_loss_scaling": 8}),
            "sharding_configs": lambda s: setattr(s, "sharding_configs", {"hybrid_dp": True}),
            "sharding": lambda s: setattr(s, "sharding", True),
        }
        for name in order:
            steps[name](strategy)
        return strategy

    names = ["a_sync", "a_sync_configs", "amp", "amp_configs", "sharding_configs", "sharding"]
    forward, backward = configure(names), configure(list(reversed(names)))
    assert forward == backward
    assert forward.a_sync_configs["k_steps"] == 100


def test_build_and_execution_strategy_assignment():
    build = fleet.BuildStrategy()
    build.fuse_elewise_add_act_ops = True
    execution = fleet.ExecutionStrategy()
    execution.num_threads = 10
    strategy = fleet.DistributedStrategy()
    strategy.build_strategy = build
    strategy.execution_strategy = execution
    build.fuse_bn_act_ops = True  # the strategy holds a copy, not the user's object
    assert strategy.build_strategy.fuse_elewise_add_act_ops is True
    assert strategy.build_strategy.fuse_bn_act_ops is False
    assert strategy.execution_strategy.num_threads == 10
    strategy.execution_strategy = {"num_iteration_per_run": 5}
    assert strategy.execution_strategy.num_threads == 10
    assert strategy.execution_strategy.num_iteration_per_run == 5
    with pytest.raises(TypeError, match="build_strategy"):
        strategy.build_strategy = execution
    with pytest.raises(fleet.ConfigError, match="num_threads"):
        fleet.ExecutionStrategy().num_threads = 0


def test_configs_keys_cannot_be_deleted():
    strategy = fleet.DistributedStrategy()
    with pytest.raises(TypeError, match="cannot be deleted"):
        del strategy.amp_configs["incr_ratio"]


def test_empty_sparsity_means_the_default_list():
    strategy = fleet.DistributedStrategy()
    strategy.dgc_configs = {"sparsity": [0.75, 0.9375]}
    assert strategy.dgc_configs["sparsity"] == [0.75, 0.9375]
    strategy.dgc_configs = {"sparsity": []}
    assert strategy.dgc_configs["sparsity"] == [0.999]


def test_print_shows_only_the_fields_that_differ():
    strategy = fleet.DistributedStrategy()
    assert str(strategy) == "DistributedStrategy: all defaults"
    strategy.amp = True
    strategy.amp_configs = {"init_loss_scaling": 128, "incr_ratio": 2.0}
    strategy.build_strategy.fuse_bn_act_ops = True
    lines = str(strategy).splitlines()
    assert lines[0] == "DistributedStrategy: defaults, except"
    body = [" ".join(line.split()) for line in lines[1:]]
    assert body == ["amp = True", "amp_configs.init_loss_scaling = 128.0",
                    "build_strategy.fuse_bn_act_ops = True"]
    assert repr(strategy) == str(strategy)


def test_copies_and_equality():
    strategy = fleet.DistributedStrategy()
    strategy.recompute = True
    strategy.recompute_configs = {"checkpoints": ["fc_1", "fc_3"]}
    clone = copy.deepcopy(strategy)
    assert clone == strategy
    clone.recompute_configs["checkpoints"] = ["fc_2"]
    assert strategy.recompute_configs["checkpoints"] == ["fc_1", "fc_3"]
    assert clone != strategy


def test_describe_allowed_covers_every_field():
    for message_class in (fleet.DistributedStrategy, fleet.BuildStrategy,
                          fleet.ExecutionStrategy):
        for field in message_class()._message.DESCRIPTOR.fields:
            if field.message_type is None:
                assert schema_view.describe_allowed(field)


def test_a_mistyped_name_is_suggested_by_case_then_fewest_edits_at_most_three():
    from fleetmpi.config.suggest import close_names

    strategy = fleet.DistributedStrategy()
    with pytest.raises(AttributeError) as refused:
        strategy.fuse_grad_size_in_mb = 16
    message = str(refused.value)
    assert "(did you mean 'fuse_grad_size_in_MB'?)" in message  # case first, not _in_num
    assert message.index("did you mean") < message.index("valid keys")
    assert close_names("K_Steps", ["avg", "k_steps"]) == ["k_steps"]
    # ties at the fewest edits, at most three; nothing where every name is far
    assert close_names("ab", ["ax", "xb", "ay", "yb", "abcdef"]) == ["ax", "xb", "ay"]
    assert close_names("recompute_config", ["recompute_configs", "recompute"]) == \
        ["recompute_configs"]
    assert close_names("zzzz", ["amp", "lars"]) == []

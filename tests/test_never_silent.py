"""No strategy field is ever silently ignored.

Which fields change behaviour and which never do is ``fleetmpi.strategies.field_effects``'
table; ``FIELDS`` here gives every field of the schema a value to set and, for each field that
table says acts, the test that proves it (``Effect``). A field it says changes nothing
anywhere (``field_effects.never_effective()``) must appear in
``applied_strategy().not_applied`` whenever it is set. A field added to the proto without a
row fails ``test_every_field_of_the_schema_has_one_row``; a field the table says acts without a
proving test, or one with a proof the table says changes nothing, fails
``test_the_fields_with_a_proof_are_those_the_table_says_act``.

In each mode (plain collective, each strategy on its own path, auto, parameter-server), the tests
set every field to a non-default value and check each one: reported as not applied with a
reason, or an ``Effect`` row whose proving test exists. They run at one process and, marked
``mpi``, on every rank of a world of several.
"""
import ast
import os
from dataclasses import dataclass

import pytest

import fleetmpi as fleet
from fleetmpi.config import schema_view
from fleetmpi import nn, optimizer
from fleetmpi.config.paddle_fields import PADDLE_ONLY
from fleetmpi.proto import distributed_strategy_pb2 as schema
from fleetmpi.strategies import applied, field_effects
from fleetmpi.strategies.compose import ORDER

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Effect:
    """The field changes behaviour where it is not reported; ``proof`` is the test showing
    it (``file.py::test_name``)."""
    value: object
    proof: str


@dataclass(frozen=True)
class Value:
    """A field that changes nothing anywhere (``field_effects``): the value it is set to."""
    value: object


def _t(name):
    return f"test_{name}"


FIELDS = {
    "auto": Effect(True, "test_auto.py::" + _t("auto_in_one_process_recomputes_over_budget_"
                                               "and_trains_as_set_by_hand")),
    "a_sync": Effect(False, "test_pserver.py::" + _t("sync_equals_data_parallel_with_uneven_"
                                                     "batches")),
    "sync_nccl_allreduce": Value(False),
    "nccl_comm_num": Effect(2, "test_comm_fusion.py::" + _t("buckets_spread_over_several_"
                                                            "communicators")),
    "use_hierarchical_allreduce": Effect(True, "test_comm_hierarchical.py::"
                                         + _t("emulated_nodes_of_every_size")),
    "hierarchical_allreduce_inter_nranks": Effect(lambda ranks: ranks if ranks > 1 else 2,
                                                  "test_comm_hierarchical.py::"
                                                  + _t("every_inter_nranks_group_size")),
    "sync_batch_norm": Effect(True, "test_sync_batch_norm.py::"
                              + _t("training_at_n_ranks_equals_one_process")),
    "fuse_all_reduce_ops": Effect(False, "test_seed_examples.py::" + _t("allreduce_fusion")),
    "fuse_grad_size_in_MB": Effect(8, "test_comm_fusion.py::"
                                   + _t("buckets_respect_size_and_dtype")),
    "fuse_grad_size_in_TFLOPS": Effect(3.0, "test_composition.py::"
                                       + _t("fuse_grad_size_in_tflops_caps_the_layers_per_"
                                            "bucket")),
    "last_comm_group_size_MB": Effect(0.5, "test_bucket_fields.py::"
                                      + _t("last_comm_group_size_mb_bounds_the_last_bucket_at_"
                                           "n_ranks")),
    "find_unused_parameters": Effect(True, "test_bucket_fields.py::"
                                     + _t("find_unused_parameters_off_warns_once_naming_them")),
    # on a GPU with cuDNN; on the CPU, or without cuDNN, reported (test_cudnn_frontend.py)
    "cudnn_exhaustive_search": Effect(False, "test_cudnn_frontend.py::"
                                      + _t("strategy_fields_reach_the_cudnn_graphs")),
    "conv_workspace_size_limit": Effect(100, "test_cudnn_frontend.py::"
                                        + _t("strategy_fields_reach_the_cudnn_graphs")),
    "cudnn_batchnorm_spatial_persistent": Value(False),
    "recompute": Effect(True, "test_recompute.py::" + _t("measured_peak_activation_memory_"
                                                         "falls_for_a_16_layer_mlp")),
    "recompute_configs.checkpoints": Effect(["1"], "test_recompute.py::"
                                            + _t("checkpoints_of_a_user_model_are_bit_for_bit")),
    "recompute_configs.enable_offload": Effect(True, "test_recompute.py::"
                                               + _t("offload_is_bit_for_bit_and_keeps_"
                                                    "checkpoints_on_the_host")),
    "recompute_configs.checkpoint_shape": Effect([4, 8], "test_recompute.py::"
                                                 + _t("offload_refuses_a_checkpoint_of_another_"
                                                      "shape")),
    "pipeline": Effect(True, "test_pipeline.py::"
                       + _t("stages_x_replicas_equal_accumulated_gradients")),
    "pipeline_configs.micro_batch": Effect(2, "test_pipeline.py::"
                                           + _t("all_stages_in_one_process_equal_accumulated_"
                                                "gradients")),
    "pipeline_configs.accumulate_steps": Effect(2, "test_pipeline_layer.py::"
                                                + _t("accumulate_steps_and_micro_batch_size_"
                                                     "cut_the_batch_as_paddle")),
    "pipeline_configs.micro_batch_size": Effect(2, "test_pipeline_layer.py::"
                                                + _t("accumulate_steps_and_micro_batch_size_"
                                                     "cut_the_batch_as_paddle")),
    "pipeline_configs.schedule_mode": Effect("F-then-B", "test_pipeline.py::"
                                             + _t("schedules_run_each_pass_once_in_dependency_"
                                                  "order")),
    "gradient_merge": Effect(True, "test_gradient_merge.py::"
                             + _t("parameters_change_and_gradients_travel_only_every_k_steps")),
    "gradient_merge_configs.k_steps": Effect(2, "test_gradient_merge.py::"
                                             + _t("k_steps_equal_one_step_of_k_times_the_batch_"
                                                  "in_one_process")),
    "gradient_merge_configs.avg": Effect(False, "test_gradient_merge.py::"
                                         + _t("k_steps_equal_one_step_of_k_times_the_batch_in_"
                                              "one_process")),
    "lars": Effect(True, "test_lars_lamb.py::" + _t("update_matches_the_transcription_over_"
                                                    "steps")),
    "lars_configs.lars_coeff": Effect(0.01, "test_lars_lamb.py::"
                                      + _t("update_matches_the_transcription_over_steps")),
    "lars_configs.lars_weight_decay": Effect(0.001, "test_lars_lamb.py::"
                                             + _t("update_matches_the_transcription_over_steps")),
    "lars_configs.epsilon": Effect(1e-8, "test_lars_lamb.py::"
                                   + _t("update_matches_the_transcription_over_steps")),
    "lars_configs.exclude_from_weight_decay": Effect(["bias"], "test_lars_lamb.py::"
                                                     + _t("exclude_from_weight_decay_matches_"
                                                          "names_by_substring")),
    "lamb": Effect(True, "test_lars_lamb.py::" + _t("update_matches_the_transcription_over_"
                                                    "steps")),
    "lamb_configs.lamb_weight_decay": Effect(0.02, "test_lars_lamb.py::"
                                             + _t("update_matches_the_transcription_over_steps")),
    "lamb_configs.exclude_from_weight_decay": Effect(["bias"], "test_lars_lamb.py::"
                                                     + _t("exclude_from_weight_decay_matches_"
                                                          "names_by_substring")),
    "localsgd": Effect(True, "test_localsgd.py::" + _t("local_steps_after_begin_step_and_"
                                                       "averaging_every_k_steps")),
    "localsgd_configs.k_steps": Effect(2, "test_localsgd.py::"
                                       + _t("local_steps_after_begin_step_and_averaging_every_"
                                            "k_steps")),
    "localsgd_configs.begin_step": Effect(2, "test_localsgd.py::"
                                          + _t("local_steps_after_begin_step_and_averaging_"
                                               "every_k_steps")),
    "adaptive_localsgd": Effect(True, "test_localsgd.py::"
                                + _t("adaptive_period_follows_adacomm_from_the_averaged_loss")),
    "adaptive_localsgd_configs.init_k_steps": Effect(2, "test_localsgd.py::"
                                                     + _t("adaptive_period_follows_adacomm_"
                                                          "from_the_averaged_loss")),
    "adaptive_localsgd_configs.begin_step": Effect(2, "test_localsgd.py::"
                                                   + _t("adaptive_period_follows_adacomm_from_"
                                                        "the_averaged_loss")),
    "amp": Effect(True, "test_amp.py::" + _t("linear_computes_in_float16_and_writes_float32_"
                                             "master_gradients")),
    "amp_configs.init_loss_scaling": Effect(1024.0, "test_amp.py::"
                                            + _t("scale_schedule_and_exactly_the_overflowing_"
                                                 "steps_skipped")),
    "amp_configs.incr_every_n_steps": Effect(10, "test_amp.py::"
                                             + _t("scale_schedule_and_exactly_the_overflowing_"
                                                  "steps_skipped")),
    "amp_configs.decr_every_n_nan_or_inf": Effect(3, "test_amp.py::"
                                                  + _t("scale_schedule_and_exactly_the_"
                                                       "overflowing_steps_skipped")),
    "amp_configs.incr_ratio": Effect(3.0, "test_amp.py::"
                                     + _t("scale_schedule_and_exactly_the_overflowing_steps_"
                                          "skipped")),
    "amp_configs.decr_ratio": Effect(0.25, "test_amp.py::"
                                     + _t("scale_schedule_and_exactly_the_overflowing_steps_"
                                          "skipped")),
    "amp_configs.use_dynamic_loss_scaling": Effect(False, "test_amp.py::"
                                                   + _t("fixed_loss_scaling_still_skips_"
                                                        "overflowing_steps")),
    "amp_configs.custom_white_list": Effect(["tanh"], "test_amp.py::"
                                            + _t("custom_lists_move_operators")),
    "amp_configs.custom_black_list": Effect(["mul"], "test_amp.py::"
                                            + _t("custom_lists_move_operators")),
    # Set together they contradict each other: the row values select bfloat16 at level O2 in
    # both of Paddle's ways, and leave use_pure_fp16 at its default.
    "amp_configs.use_pure_fp16": Effect(False, "test_amp_precision.py::"
                                        + _t("level_o2_computes_gray_operators_in_the_low_"
                                             "precision_dtype")),
    "amp_configs.use_pure_bf16": Effect(True, "test_amp_precision.py::"
                                        + _t("bfloat16_scales_no_loss_and_checks_nothing")),
    "amp_configs.dtype": Effect("bfloat16", "test_amp_precision.py::"
                                + _t("bfloat16_scales_no_loss_and_checks_nothing")),
    "amp_configs.level": Effect("O2", "test_amp_precision.py::"
                                + _t("level_o2_computes_gray_operators_in_the_low_precision_"
                                     "dtype")),
    "dgc": Effect(True, "test_dgc.py::" + _t("matches_simulation")),
    "dgc_configs.rampup_begin_step": Effect(1, "test_dgc.py::"
                                            + _t("schedule_counts_from_rampup_begin_step")),
    "dgc_configs.rampup_step": Effect(2, "test_dgc.py::" + _t("schedule_of_the_seed_example")),
    "dgc_configs.sparsity": Effect([0.5], "test_dgc.py::" + _t("schedule_of_the_seed_example")),
    "fp16_allreduce": Effect(True, "test_fp16_allreduce.py::"
                             + _t("fp16_allreduce_stays_within_the_stated_bound_and_halves_the_"
                                  "bytes")),
    "sharding": Effect(True, "test_sharding.py::"
                       + _t("n_ranks_equal_data_parallel_with_1_over_n_of_the_state")),
    "sharding_configs.fuse_broadcast_MB": Effect(16.0, "test_sharding.py::"
                                                 + _t("parameters_travel_back_in_messages_of_"
                                                      "at_most_fuse_broadcast_mb")),
    "sharding_configs.hybrid_dp": Effect(True, "test_sharding.py::"
                                         + _t("hybrid_dp_equals_data_parallel_for_every_group_"
                                              "size")),
    "sharding_configs.sharding_group_size": Effect(1, "test_sharding.py::"
                                                   + _t("hybrid_dp_equals_data_parallel_for_"
                                                        "every_group_size")),
    "sharding_configs.sharding_degree": Effect(1, "test_sharding_stages.py::"
                                               + _t("sharding_degree_is_the_group_size_and_"
                                                    "conflicts_with_a_different_group_size")),
    "sharding_configs.stage": Effect(2, "test_sharding_stages.py::"
                                     + _t("n_ranks_equal_one_process_on_a_user_model")),
    "sharding_configs.prefetch_depth": Effect(1, "test_sharding_prefetch.py::"
                                              + _t("prefetch_changes_no_result_bit_for_bit")),
    "sharding_configs.unit_size_MB": Effect(1.0, "test_sharding_prefetch.py::"
                                            + _t("units_join_adjacent_layers_up_to_unit_size_"
                                                 "mb")),
    "elastic": Effect(True, "test_elastic.py::" + _t("a_run_that_lost_a_rank_resumes_at_two_and_"
                                                     "ends_as_an_uninterrupted_one")),
    "a_sync_configs.k_steps": Effect(0, "test_pserver.py::"
                                     + _t("async_and_geo_reach_95_percent_on_digits")),
    "hybrid_configs.dp_degree": Effect(lambda ranks: ranks, "test_hybrid.py::"
                                       + _t("degree_products_that_are_not_the_world_are_"
                                            "refused_at_distributed_optimizer")),
    # Degrees above 1 need a world they divide, with the others set to match: set here to
    # 1 explicitly; the layouts of test_hybrid.py prove what each does above 1.
    "hybrid_configs.mp_degree": Effect(1, "test_hybrid.py::"
                                       + _t("tensor_parallel_gpt_at_mp2_equals_the_serial_gpt")),
    "hybrid_configs.pp_degree": Effect(1, "test_hybrid.py::"
                                       + _t("gpt_in_pipeline_stages_equals_one_process")),
    "hybrid_configs.sharding_degree": Effect(1, "test_hybrid.py::"
                                             + _t("gpt_layouts_of_four_ranks_equal_one_"
                                                  "process")),
    "tensor_parallel": Effect(True, "test_hybrid.py::"
                              + _t("tensor_parallel_gpt_at_mp2_equals_the_serial_gpt")),
    "tensor_parallel_configs.tensor_parallel_degree": Effect(
        1, "test_hybrid.py::" + _t("tensor_parallel_gpt_at_mp2_equals_the_serial_gpt")),
    "tensor_parallel_configs.tensor_init_seed": Effect(
        7, "test_hybrid.py::" + _t("tensor_init_seed_reseeds_the_tensor_parallel_weights")),
    "a_sync_configs.max_merge_var_num": Value(2),
    "a_sync_configs.send_queue_size": Value(8),
    "a_sync_configs.independent_recv_thread": Value(True),
    "a_sync_configs.min_send_grad_num_before_recv": Value(2),
    "a_sync_configs.thread_pool_size": Value(2),
    "a_sync_configs.send_wait_times": Value(2),
    "a_sync_configs.runtime_split_send_recv": Value(True),
    "a_sync_configs.launch_barrier": Value(False),
    "a_sync_configs.heter_worker_device_guard": Value("gpu"),
    "a_sync_configs.lr_decay_steps": Value(5),
    "a_sync_configs.use_ps_gpu": Value(1),
    "build_strategy.enable_sequential_execution": Value(True),
    "build_strategy.fuse_elewise_add_act_ops": Effect(True, "test_kernels.py::"
                                                      + _t("fused_equals_unfused")),
    "build_strategy.fuse_bn_act_ops": Effect(True, "test_kernels.py::"
                                             + _t("fused_equals_unfused")),
    "build_strategy.fuse_relu_depthwise_conv": Value(True),
    "build_strategy.fuse_broadcast_ops": Value(True),
    "build_strategy.fuse_all_optimizer_ops": Effect(True, "test_optim.py::"
                                                    + _t("fused_and_unfused_updates_are_"
                                                         "identical")),
    "build_strategy.enable_inplace": Value(True),
    "build_strategy.enable_backward_optimizer_op_deps": Value(False),
    "build_strategy.cache_runtime_context": Value(True),
    "build_strategy.enable_auto_fusion": Value(True),
    "execution_strategy.num_threads": Value(2),
    "execution_strategy.num_iteration_per_drop_scope": Value(5),
    "execution_strategy.num_iteration_per_run": Value(2),
    "execution_strategy.use_thread_barrier": Value(True),
}

SWITCHES = tuple(ORDER) + ("auto",)
NEVER_EFFECTIVE = field_effects.never_effective()
# The collective modes checked when the optimizer is built; auto, which decides on its first
# step, has a test of its own below.
MODES = ("collective",) + tuple(ORDER)


def _leaf_paths(descriptor, prefix=""):
    paths = []
    for field in descriptor.fields:
        if field.message_type is not None:
            paths += _leaf_paths(field.message_type, f"{prefix}{field.name}.")
        else:
            paths.append(prefix + field.name)
    return paths


def test_every_field_of_the_schema_has_one_row():
    assert sorted(_leaf_paths(schema.DistributedStrategy.DESCRIPTOR)) == sorted(FIELDS)
    in_both = {path for path in PADDLE_ONLY if path in FIELDS
               or path.split(".")[0] in schema.DistributedStrategy.DESCRIPTOR.fields_by_name
               and "." not in path}
    assert not in_both, f"implemented now: remove {in_both} from fleetmpi.config.paddle_fields"


def test_the_fields_with_a_proof_are_those_the_table_says_act():
    proven = {path for path, row in FIELDS.items() if isinstance(row, Effect)}
    assert NEVER_EFFECTIVE <= set(FIELDS), sorted(NEVER_EFFECTIVE - set(FIELDS))
    assert proven == set(FIELDS) - NEVER_EFFECTIVE, sorted(proven ^ (set(FIELDS)
                                                                     - NEVER_EFFECTIVE))


def test_every_proving_test_exists():
    for path, row in FIELDS.items():
        if isinstance(row, Effect):
            file_name, test_name = row.proof.split("::")
            with open(os.path.join(HERE, file_name)) as f:
                names = {node.name for node in ast.walk(ast.parse(f.read()))
                         if isinstance(node, ast.FunctionDef)}
            assert test_name in names, f"{path}: {row.proof} does not exist"


def _value(row, ranks):
    return row.value(ranks) if callable(row.value) else row.value


def every_field_set(mode, ranks):
    """A strategy with every field away from its default, the switches of other modes off."""
    strategy = fleet.DistributedStrategy()
    for path, row in FIELDS.items():
        if path in SWITCHES and path != mode:
            continue
        owner, _, key = path.rpartition(".")
        if owner in ("build_strategy", "execution_strategy"):
            setattr(getattr(strategy, owner), key, _value(row, ranks))
        elif owner:
            getattr(strategy, owner)[key] = _value(row, ranks)
        else:
            setattr(strategy, path, _value(row, ranks))
    return strategy


def _default(path):
    owner, _, key = path.rpartition(".")
    default = fleet.DistributedStrategy()
    if owner in ("build_strategy", "execution_strategy"):
        return getattr(getattr(default, owner), key)
    return getattr(default, owner)[key] if owner else getattr(default, path)


def _model():
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1D(8), nn.ReLU(), nn.Linear(8, 2))


def _reported(path, reasons):
    return path in reasons or path.split(".")[0] in reasons


def check_mode(mode, ranks, reasons, strategy):
    set_paths = [path for path, _ in schema_view.differences(strategy._message,
                                                   fleet.DistributedStrategy()._message)]
    at_default = sum(1 for path, row in FIELDS.items() if path not in SWITCHES
                     and _value(row, ranks) == _default(path))
    assert len(set_paths) == len(FIELDS) - len(SWITCHES) + (mode in SWITCHES) - at_default
    for path in set_paths:
        # an Effect field that is not reported is shown to act by its proving test
        if path in NEVER_EFFECTIVE:
            assert _reported(path, reasons), f"{mode} at {ranks} rank(s): {path} is not reported"
    for path, why in reasons.items():
        assert why and isinstance(why, str), path


def _collective(mode):
    from mpi4py import MPI

    fleet.init()
    ranks = MPI.COMM_WORLD.Get_size()
    strategy = every_field_set(mode, ranks)
    model = _model()
    inner = (optimizer.Adam(learning_rate=0.01, parameters=model.parameters()) if mode == "lamb"
             else optimizer.Momentum(learning_rate=0.01, momentum=0.9,
                                     parameters=model.parameters()))
    fleet.distributed_optimizer(inner, strategy)
    reasons = dict(fleet.applied_strategy().not_applied)
    check_mode(mode, ranks, reasons, strategy)
    return ranks, reasons


_BETWEEN_RANKS = ("fp16_allreduce", "sync_batch_norm", "localsgd", "adaptive_localsgd",
                  "sharding")


@pytest.mark.parametrize("mode", MODES)
def test_every_field_is_applied_or_reported_at_one_process(mode):
    ranks, reasons = _collective(mode)
    assert ranks == 1
    if mode in _BETWEEN_RANKS:
        assert "trains alone" in reasons[mode]
    # alone, nothing that travels between ranks has an effect
    for path in ("nccl_comm_num", "use_hierarchical_allreduce", "fuse_grad_size_in_MB"):
        assert "trains alone" in reasons[path]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
def test_every_field_is_applied_or_reported_on_every_rank(mode):
    from mpi4py import MPI

    ranks, reasons = _collective(mode)
    assert MPI.COMM_WORLD.allgather(sorted(reasons)) == [sorted(reasons)] * ranks
    if mode in _BETWEEN_RANKS:
        assert mode not in reasons and f"{mode}_configs" not in reasons
    if mode == "collective":
        for path in ("nccl_comm_num", "use_hierarchical_allreduce",
                     "hierarchical_allreduce_inter_nranks", "fuse_all_reduce_ops"):
            assert path not in reasons, path
    if mode == "amp":
        assert "use_dynamic_loss_scaling is off" in reasons["amp_configs.incr_ratio"]
        assert "amp_configs.init_loss_scaling" not in reasons
    if mode == "sharding":
        for path in ("use_hierarchical_allreduce", "hierarchical_allreduce_inter_nranks",
                     "nccl_comm_num", "sharding_configs.fuse_broadcast_MB"):
            assert path in reasons, path


def test_every_field_is_applied_or_reported_in_parameter_server_mode():
    strategy = every_field_set("parameter-server", 1)
    reasons = applied.parameter_server_not_applied(strategy, on_gpu=False)
    check_mode("parameter-server", 1, reasons, strategy)
    assert "a_sync" not in reasons
    assert "not started by fleetmpirun --elastic" in reasons["elastic"]
    assert "a_sync is off" in reasons["a_sync_configs.k_steps"]
    acting = field_effects.IN_PARAMETER_SERVER_MODE
    assert {"a_sync", "a_sync_configs.k_steps"} <= acting
    for path in FIELDS:
        owner = path.split(".")[0]
        if path not in SWITCHES and owner not in acting and path not in acting \
                and _value(FIELDS[path], 1) != _default(path):
            assert reasons[path].startswith("parameter-server mode trains with a_sync"), path


def test_the_cases_of_the_issue_are_reported():
    fleet.init()
    model = _model()
    strategy = fleet.DistributedStrategy()
    strategy.recompute = True
    strategy.recompute_configs = {"checkpoints": ["1"], "checkpoint_shape": [4, 8]}
    strategy.lars = True
    strategy.build_strategy.fuse_all_optimizer_ops = True
    fleet.distributed_optimizer(optimizer.Momentum(learning_rate=0.1, momentum=0.9,
                                                   parameters=model.parameters()), strategy)
    reasons = fleet.applied_strategy().not_applied
    assert reasons["recompute_configs.checkpoint_shape"] == (
        "it sizes the host buffers of enable_offload, which is off")
    assert "lars scales each parameter's update by its own trust ratio" in \
        reasons["build_strategy.fuse_all_optimizer_ops"]


def test_every_field_is_applied_or_reported_under_auto():
    """auto resolves into the strategy its calibration chose; every field that changes
    nothing anywhere is still reported on what it chose."""
    import numpy as np

    fleet.init()
    strategy = every_field_set("auto", 1)
    model = _model()
    opt = fleet.distributed_optimizer(
        optimizer.Momentum(learning_rate=0.01, momentum=0.9, parameters=model.parameters()),
        strategy, auto_seconds=1)
    rng = np.random.default_rng(0)
    x = fleet.backend.asarray(rng.standard_normal((8, 4)).astype("float32"))
    opt.minimize(model, nn.CrossEntropyLoss(), x, rng.integers(0, 2, 8))
    chosen = fleet.applied_strategy()
    assert chosen.auto is False and chosen.calibration is not None
    check_mode("auto", 1, dict(chosen.not_applied), strategy)

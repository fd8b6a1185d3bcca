"""Strategy files both ways between fleetmpi and Paddle's own message, built from the schema
Paddle publishes (tests/paddle_distributed_strategy.proto, Paddle 2.2's field names, numbers
and types), parsed strictly as Paddle's ``load_from_prototxt`` parses them."""
import os
import tempfile

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format

import fleetmpi as fleet
from fleetmpi import nn, optimizer
from fleetmpi.config.paddle_fields import PADDLE_ONLY

HERE = os.path.dirname(os.path.abspath(__file__))
PADDLE_PROTO = "paddle_distributed_strategy.proto"


@pytest.fixture(scope="module")
def paddle_message():
    """Paddle's ``DistributedStrategy`` message class, in a descriptor pool of its own."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "paddle.pb")
        assert protoc.main(["protoc", f"--proto_path={HERE}", f"--descriptor_set_out={out}",
                            os.path.join(HERE, PADDLE_PROTO)]) == 0
        with open(out, "rb") as f:
            files = descriptor_pb2.FileDescriptorSet.FromString(f.read())
    pool = descriptor_pool.DescriptorPool()
    pool.Add(files.file[0])
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName("paddle.fleet.DistributedStrategy"))


def _set_fields(message, prefix=""):
    """``{dotted path: value}`` of every field that holds a value, recursively."""
    found = {}
    for field, value in message.ListFields():
        if field.message_type is not None:
            found.update(_set_fields(value, f"{prefix}{field.name}."))
        else:
            found[prefix + field.name] = list(value) if field.is_repeated else value
    return found


def _paddle_fields_only_strategy():
    strategy = fleet.DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {"init_loss_scaling": 1024.0, "custom_white_list": ["matmul"],
                            "use_dynamic_loss_scaling": False}
    strategy.recompute = True
    strategy.recompute_configs = {"checkpoints": ["fc_0", "fc_1"]}
    strategy.dgc_configs = {"sparsity": [0.75, 0.5], "rampup_step": 10}
    strategy.lars_configs = {"lars_coeff": 0.5, "exclude_from_weight_decay": ["bias"]}
    strategy.a_sync = False
    strategy.a_sync_configs = {"k_steps": 4, "heter_worker_device_guard": "gpu"}
    strategy.fuse_grad_size_in_TFLOPS = 12.5
    strategy.nccl_comm_num = 2
    strategy.sharding_configs = {"sharding_degree": 4, "hybrid_dp": True}
    strategy.pipeline_configs = {"schedule_mode": "F-then-B"}
    strategy.elastic = True
    strategy.build_strategy.fuse_all_optimizer_ops = True
    strategy.execution_strategy.num_threads = 4
    return strategy


def test_a_file_fleetmpi_writes_loads_into_paddles_message(tmp_path, paddle_message):
    strategy = _paddle_fields_only_strategy()
    path = tmp_path / "fleetmpi.config.prototxt"
    strategy.save_to_prototxt(str(path))
    paddle = paddle_message()
    text_format.Parse(path.read_text(), paddle)   # strict: any field Paddle lacks fails
    ours = _set_fields(strategy._message)
    assert _set_fields(paddle) == ours   # values exact in float32 too
    assert len(ours) == 21


PADDLE_22_FILE = {
    "mode": 1, "fuse_grad_size_in_TFLOPS": 50.0, "last_comm_group_size_MB": 2.0,
    "find_unused_parameters": True, "fuse_grad_size_in_num": 4, "a_sync": False,
    "amp_configs": {"init_loss_scaling": 256.0, "use_pure_fp16": True, "use_fp16_guard": False},
    "sharding_configs": {"sharding_degree": 8, "sharding_segment_strategy": "segment_anchors",
                         "segment_anchors": ["a", "b"]},
    "hybrid_configs": {"dp_degree": 2, "mp_degree": 1},
    "pipeline_configs": {"accumulate_steps": 4, "p2p_cache_shape": False},
    "build_strategy": {"fuse_bn_add_act_ops": True, "enable_inplace": True},
}
PADDLE_ONLY_IN_FILE = {
    "mode", "fuse_grad_size_in_num",
    "amp_configs.use_fp16_guard", "sharding_configs.sharding_segment_strategy",
    "sharding_configs.segment_anchors", "pipeline_configs.p2p_cache_shape",
    "build_strategy.fuse_bn_add_act_ops"}


def _paddle_file(paddle_message, tmp_path):
    paddle = paddle_message()
    for name, value in PADDLE_22_FILE.items():
        if isinstance(value, dict):
            for key, sub in value.items():
                sub_message = getattr(paddle, name)
                if isinstance(sub, list):
                    getattr(sub_message, key).extend(sub)
                else:
                    setattr(sub_message, key, sub)
        else:
            setattr(paddle, name, value)
    path = tmp_path / "paddle.prototxt"
    path.write_text(text_format.MessageToString(paddle))
    return paddle, path


def test_a_file_of_paddle_2_2_loads_and_writes_back_what_paddle_reads(tmp_path, paddle_message):
    paddle, path = _paddle_file(paddle_message, tmp_path)
    assert "fuse_grad_size_in_TFLOPS: 50.0" in path.read_text()
    strategy = fleet.DistributedStrategy().load_from_prototxt(str(path))
    assert strategy.fuse_grad_size_in_TFLOPS == 50.0 and strategy.a_sync is False
    assert strategy.amp_configs["init_loss_scaling"] == 256.0
    assert strategy.amp_configs["use_pure_fp16"] is True
    assert strategy.sharding_configs["sharding_degree"] == 8
    assert strategy.build_strategy.enable_inplace is True
    assert strategy.pipeline_configs["accumulate_steps"] == 4     # a field of fleetmpi's too
    assert strategy.last_comm_group_size_MB == 2.0 and strategy.find_unused_parameters is True
    assert set(strategy.paddle_only_fields()) == PADDLE_ONLY_IN_FILE
    assert strategy.paddle_only_fields()["sharding_configs.segment_anchors"] == [
        'segment_anchors: "a"', 'segment_anchors: "b"']

    again = tmp_path / "again.prototxt"
    strategy.save_to_prototxt(str(again))
    back = paddle_message()
    text_format.Parse(again.read_text(), back)
    assert _set_fields(back) == _set_fields(paddle)
    assert fleet.DistributedStrategy().load_from_prototxt(str(again)) == strategy


def test_each_paddle_only_field_is_reported_as_not_applied(tmp_path, paddle_message):
    _, path = _paddle_file(paddle_message, tmp_path)
    strategy = fleet.DistributedStrategy().load_from_prototxt(str(path))
    model = nn.Linear(4, 2)
    fleet.distributed_optimizer(optimizer.SGD(learning_rate=0.1,
                                              parameters=model.parameters()),
                                strategy, local=True)
    reasons = fleet.applied_strategy().not_applied
    for path_name in PADDLE_ONLY_IN_FILE:
        assert PADDLE_ONLY[path_name] in reasons[path_name], path_name
        assert reasons[path_name].startswith("a field of Paddle's DistributedStrategy")


def test_a_misspelt_name_is_still_refused_naming_the_line(tmp_path):
    path = tmp_path / "typo.prototxt"
    path.write_text("amp: true\nsharding_configs {\n  segment_broadcast_mb: 2\n}\n")
    with pytest.raises(fleet.ConfigError, match=r"typo.prototxt:3:\d+: sharding_configs."
                                                r"segment_broadcast_mb is neither a field of "
                                                r"fleetmpi's DistributedStrategy nor one of "
                                                r"Paddle 2.0-2.2's \(did you mean "
                                                r"'sharding_configs.segment_broadcast_MB'\?\)"):
        fleet.DistributedStrategy().load_from_prototxt(str(path))


def _set_as_attributes(trainer_desc=True):
    """Paddle 2.1-2.4's fields as a script sets them (``trainer_desc_configs`` came after
    2.2, whose message the strict parse uses)."""
    strategy = fleet.DistributedStrategy()
    strategy.find_unused_parameters = True
    strategy.last_comm_group_size_MB = 1.5
    strategy.fuse_grad_size_in_num = 4
    strategy.pipeline_configs["p2p_cache_shape"] = False
    strategy.pipeline_configs = {"schedule_mode": "1F1B", "accumulate_steps": 3}
    if trainer_desc:
        strategy.trainer_desc_configs = {"dump_fields_path": "out/", "dump_param": ["w", "b"]}
    return strategy


def test_paddle_only_fields_set_as_attributes_read_back_save_and_are_reported(tmp_path,
                                                                             paddle_message):
    strategy = _set_as_attributes()
    assert strategy.find_unused_parameters is True and strategy.last_comm_group_size_MB == 1.5
    assert strategy.pipeline_configs["p2p_cache_shape"] is False
    assert strategy.pipeline_configs["accumulate_steps"] == 3
    assert strategy.pipeline_configs["schedule_mode"] == "1F1B"
    assert strategy.trainer_desc_configs == {"dump_fields_path": "out/", "dump_param": ["w", "b"]}
    assert strategy.fuse_grad_size_in_num == 4
    assert fleet.DistributedStrategy().fuse_grad_size_in_num is None     # unset
    kept = {"fuse_grad_size_in_num", "trainer_desc_configs", "pipeline_configs.p2p_cache_shape"}
    assert set(strategy.paddle_only_fields()) == kept
    path = tmp_path / "set.prototxt"
    strategy.save_to_prototxt(str(path))
    assert fleet.DistributedStrategy().load_from_prototxt(str(path)) == strategy
    _set_as_attributes(trainer_desc=False).save_to_prototxt(str(path))
    paddle = paddle_message()
    text_format.Parse(path.read_text(), paddle)     # strict: Paddle 2.2's message reads it
    assert paddle.find_unused_parameters and paddle.pipeline_configs.p2p_cache_shape is False
    assert paddle.last_comm_group_size_MB == 1.5 and paddle.fuse_grad_size_in_num == 4
    assert paddle.pipeline_configs.accumulate_steps == 3
    model = nn.Linear(4, 2)
    fleet.distributed_optimizer(optimizer.SGD(learning_rate=0.1, parameters=model.parameters()),
                                strategy, local=True)
    reasons = fleet.applied_strategy().not_applied
    for name in kept:
        assert PADDLE_ONLY[name] in reasons[name], name


def test_a_misspelt_attribute_or_key_is_refused_with_the_nearest_name():
    strategy = fleet.DistributedStrategy()
    with pytest.raises(AttributeError, match="'find_unused_parameter' .*did you mean "
                                             "'find_unused_parameters'"):
        strategy.find_unused_parameter = True
    with pytest.raises(KeyError, match="'micro_batch_sise' .*did you mean 'micro_batch_size'"):
        strategy.pipeline_configs["micro_batch_sise"] = 2
    with pytest.raises(ValueError, match="fuse_grad_size_in_num = \\{1\\}: Paddle's field "
                                         "holds"):
        strategy.fuse_grad_size_in_num = {1}
    with pytest.raises(TypeError, match="last_comm_group_size_MB = \\{1\\} has type set"):
        strategy.last_comm_group_size_MB = {1}
    assert strategy.paddle_only_fields() == {}


def test_build_strategy_nccl_comm_num_sets_the_strategys_field():
    strategy = fleet.DistributedStrategy()
    strategy.build_strategy.nccl_comm_num = 3
    assert strategy.nccl_comm_num == 3 == strategy.build_strategy.nccl_comm_num
    build = fleet.BuildStrategy()           # Paddle's way: a BuildStrategy of its own, assigned
    build.nccl_comm_num = 2
    build.fuse_bn_act_ops = True
    strategy.build_strategy = build
    assert strategy.nccl_comm_num == 2 and strategy.build_strategy.fuse_bn_act_ops
    with pytest.raises(fleet.ConfigError, match=r"nccl_comm_num = 0 .*\[1, inf\)"):
        build.nccl_comm_num = 0

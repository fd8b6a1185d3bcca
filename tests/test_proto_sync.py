"""The generated strategy module is in sync with distributed_strategy.proto."""
from google.protobuf import descriptor_pb2

from fleetmpi.docs import proto_module
from fleetmpi.proto import distributed_strategy_pb2


def _normalized(file_descriptor):
    """Drop what differs only in spelling: JSON names (not embedded in generated Python)
    and the text of real-number defaults ("0.0005" vs "0.00050000000000000001")."""
    real = (descriptor_pb2.FieldDescriptorProto.TYPE_DOUBLE,
            descriptor_pb2.FieldDescriptorProto.TYPE_FLOAT)
    fields = [f for m in file_descriptor.message_type for f in m.field]
    for field in fields + list(file_descriptor.extension):
        field.ClearField("json_name")
        if field.type in real and field.HasField("default_value"):
            field.default_value = repr(float(field.default_value))
    return file_descriptor


def test_generated_descriptor_matches_the_proto():
    embedded = descriptor_pb2.FileDescriptorProto.FromString(
        distributed_strategy_pb2.DESCRIPTOR.serialized_pb)
    assert _normalized(embedded) == _normalized(proto_module.compile_descriptor())
    assert len(embedded.message_type) == 16


def test_generated_module_is_what_protoc_writes_today():
    with open(distributed_strategy_pb2.__file__) as f:
        committed = f.read()
    assert committed == proto_module.generate_source()

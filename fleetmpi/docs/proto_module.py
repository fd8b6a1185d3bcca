"""``proto/distributed_strategy_pb2.py``: the Python module protoc writes from
``distributed_strategy.proto``.

protoc comes from ``grpcio-tools`` (the ``test`` extra), so no system protoc is
needed. The .proto is compiled under the virtual path ``fleetmpi/proto/`` so its
descriptor cannot collide with another package's ``distributed_strategy.proto``
in protobuf's global descriptor pool.
"""
import os
import tempfile

from .. import proto

PROTO_DIR = os.path.dirname(os.path.abspath(proto.__file__))
PROTO_NAME = "distributed_strategy.proto"
VIRTUAL_DIR = "fleetmpi/proto"
GENERATED_NAME = "distributed_strategy_pb2.py"


def _protoc(args):
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError as exc:
        raise RuntimeError("regenerating the strategy module needs grpcio-tools: "
                           "pip install -e '.[test]'") from exc
    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    argv = ["protoc", f"--proto_path={VIRTUAL_DIR}={PROTO_DIR}", f"--proto_path={include}"]
    argv += args + [f"{VIRTUAL_DIR}/{PROTO_NAME}"]
    if protoc.main(argv) != 0:
        raise RuntimeError(f"protoc failed on {os.path.join(PROTO_DIR, PROTO_NAME)}")


def compile_descriptor():
    """The FileDescriptorProto protoc makes of the .proto today."""
    from google.protobuf import descriptor_pb2

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "set.pb")
        _protoc([f"--descriptor_set_out={out}"])
        with open(out, "rb") as f:
            fds = descriptor_pb2.FileDescriptorSet.FromString(f.read())
    return fds.file[0]


def generate_source():
    """The text of the generated Python module for the .proto today."""
    with tempfile.TemporaryDirectory() as tmp:
        _protoc([f"--python_out={tmp}"])
        with open(os.path.join(tmp, VIRTUAL_DIR, GENERATED_NAME)) as f:
            return f.read()


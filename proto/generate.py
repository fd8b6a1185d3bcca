"""Regenerate ``distributed_strategy_pb2.py`` from ``distributed_strategy.proto``.

    python -m fleetmpi.proto.generate          # rewrite the generated module
    python -m fleetmpi.proto.generate --check  # exit 1 if it is out of date

protoc comes from ``grpcio-tools`` (the ``test`` extra), so no system protoc is
needed. The .proto is compiled under the virtual path ``fleetmpi/proto/`` so its
descriptor cannot collide with another package's ``distributed_strategy.proto``
in protobuf's global descriptor pool.
"""
import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
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
    argv = ["protoc", f"--proto_path={VIRTUAL_DIR}={HERE}", f"--proto_path={include}"]
    argv += args + [f"{VIRTUAL_DIR}/{PROTO_NAME}"]
    if protoc.main(argv) != 0:
        raise RuntimeError(f"protoc failed on {os.path.join(HERE, PROTO_NAME)}")


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when the committed module differs from a fresh one")
    args = parser.parse_args(argv)
    target = os.path.join(HERE, GENERATED_NAME)
    fresh = generate_source()
    if args.check:
        with open(target) as f:
            current = f.read()
        if current != fresh:
            print(f"{target} is out of date: run python -m fleetmpi.proto.generate")
            return 1
        print(f"{target} is up to date")
        return 0
    with open(target, "w") as f:
        f.write(fresh)
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

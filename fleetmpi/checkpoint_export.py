"""One safetensors file of the whole model from a distributed checkpoint, written by any number
of ranks, for tools that know nothing of fleetmpi (PaddlePaddle, PyTorch, ``fleet.load``).

    python -m fleetmpi.checkpoint_export ckpt model.safetensors

or ``export_safetensors("ckpt", "model.safetensors")`` from Python: one process, no MPI job
needed. Every rank's file is checked against the manifest's digest first.

Which rank's value of each entry is exported:

* data parallel and sharding: every file holds the whole model (stage 3 gathers each
  parameter whole as it saves), equal on every rank; the first file's is taken;
* tensor parallel, saved with ``fleetmpi.training.hybrid_checkpoint``: its files hold the serial
model (the split parameters gathered whole), so the same;
* pipeline: every rank holds the whole model but trains only its stage's parameters, and
  ``fleetmpi.training.checkpoint.save`` records which (``trained`` in the file's metadata); each
  parameter comes from a rank that trains it, and a layer's buffers (batch-norm statistics)
  from the rank that trains the layer's parameters.

A tensor-parallel model saved with ``fleetmpi.training.checkpoint`` holds a different part of a
split parameter in each file (``parts`` in the metadata): such a checkpoint is refused, naming the
entry (save with ``fleetmpi.training.hybrid_checkpoint``). The model-parallel degree that
``hybrid_checkpoint`` stores beside the weights is not exported.
"""
import argparse
import sys

import numpy as np

from .core import archives
from .training import checkpoint, serialization
from .training.hybrid_checkpoint import DEGREE_KEY


def _sources(metas, names):
    """``{entry: index of the file to take it from}`` (module docstring)."""
    trained = [None if meta.get("trained") is None else set(meta["trained"]) for meta in metas]
    if all(t is None for t in trained):
        return dict.fromkeys(names, 0)
    owner = {}
    for index, keys in enumerate(trained):
        for key in keys if keys is not None else names:
            owner.setdefault(key, index)
    layer_owner = {key.rpartition(".")[0]: index for key, index in owner.items()}
    return {name: owner.get(name, layer_owner.get(name.rpartition(".")[0], 0))
            for name in names}


def export_safetensors(directory, path):
    """Write the model of the checkpoint in ``directory`` to ``path`` as one safetensors file
    (module docstring); returns ``{entry: shape}`` of what was written."""
    manifest = checkpoint.read_manifest(directory)
    files = [checkpoint.verified_file(directory, entry) for entry in manifest["files"]]
    metas = [checkpoint.read_meta(f) for f in files]
    for path_of_rank, meta in zip(files, metas):
        if meta.get("parts"):
            raise ValueError(
                f"{path_of_rank} holds its rank's part of the split (tensor-parallel) "
                f"parameter {meta['parts'][0]!r}, not the whole; save such a model with "
                "fleetmpi.training.hybrid_checkpoint, whose files hold the whole model")
    with archives.load_npz(files[0]) as stored:
        names = [key[len(checkpoint.MODEL_PREFIX):] for key in stored.files
                 if key.startswith(checkpoint.MODEL_PREFIX)
                 and key != checkpoint.MODEL_PREFIX + DEGREE_KEY]
    sources = _sources(metas, names)
    state = {}
    for index, path_of_rank in enumerate(files):
        wanted = [name for name in names if sources[name] == index]
        if wanted:
            with archives.load_npz(path_of_rank) as stored:
                for name in wanted:
                    state[name] = stored[checkpoint.MODEL_PREFIX + name]
    serialization.save({name: state[name] for name in names}, path)
    return {name: tuple(state[name].shape) for name in names}


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m fleetmpi.checkpoint_export",
        description="Write the model of a fleetmpi checkpoint, saved by any number of ranks, "
                    "as one safetensors file.")
    parser.add_argument("checkpoint", help="the checkpoint's folder (holding manifest.json)")
    parser.add_argument("output", help="the safetensors file to write")
    args = parser.parse_args(argv)
    try:
        written = export_safetensors(args.checkpoint, args.output)
    except (OSError, ValueError, ImportError) as error:
        print(f"fleetmpi.checkpoint_export: {error}", file=sys.stderr)
        return 1
    count = sum(int(np.prod(shape)) for shape in written.values())
    print(f"{args.output}: {len(written)} tensors, {count:,} values")
    return 0


if __name__ == "__main__":
    sys.exit(main())

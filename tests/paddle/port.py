"""Port Paddle's own dygraph unit tests to fleetmpi: the only change made to Paddle's files is
``EDITS``, which renames the modules their import statements name (never an assertion, an
expected value or any other line; ``test_port.py`` checks that every changed line is an import).

    python tests/paddle/port.py ORIGINALS_DIR   # write tests/paddle/ported/<file>
    python tests/paddle/port.py --table         # the left-out table of docs/paddle_compat.md

``ORIGINALS_DIR`` holds Paddle's files under their own names, as ``SOURCES`` records them
(path in Paddle's repository, the commit of the version read, its SHA-256): the port refuses a
file whose hash differs. The originals and the ported files are kept out of this repository
(``ported/`` is ignored): this workplace's rule for code read from public repositories.
"""
import argparse
import hashlib
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PORTED = os.path.join(HERE, "ported")
_UNITTESTS = "python/paddle/fluid/tests/unittests/"

# Each ported file: (Paddle's path, commit of the version read, SHA-256 of that version).
# The file index held one version of each file, not one release's tree: each is from before
# Paddle 2.5 moved its tests to test/ (2.4's layout and yapf formatting).
SOURCES = {
    "test_batch_sampler.py": (
        _UNITTESTS + "test_batch_sampler.py", "071a88a26048dd434920348ed668009ac9b50ad5",
        "230296230b8db2f031a1a86c451d4b6d2cfbb201173e30096e7994ec068c04bb"),
    "test_metrics.py": (
        "python/paddle/tests/test_metrics.py", "06d08f53f1296d76081f836c452f4896b96b2d2e",
        "8bd8a7dae386e5cc0be57bf1b11aa6e3a6905d5cd0c50bc1cc76b0b35b974d6a"),
}

# (start of an import statement in Paddle's file, what it becomes), applied at line starts in
# every file, in order.
EDITS = [
    ("import paddle\n", "import fleetmpi as paddle\n"),
    # Paddle 2.x keeps fluid's dygraph names at its top level, where fleetmpi has them.
    ("import paddle.fluid as fluid\n", "import fleetmpi as fluid\n"),
    ("from paddle.hapi.model import ", "from fleetmpi.hapi.model import "),
    ("from paddle.io import ", "from fleetmpi.io import "),
]

# Paddle's test files considered and not ported, with the reason.
NOT_PORTED = {
    _UNITTESTS + "test_dataloader_dataset.py": "imports paddle.vision.transforms at the top; "
        "its DataLoader tests read MNIST, a download",
    _UNITTESTS + "dygraph_group_sharded_api.py": "Paddle 1.x names throughout "
        "(fluid.dygraph.nn.Linear, fluid.Layer, paddle.batch, DataLoader.from_generator with "
        "set_sample_list_generator); a 1000-wide MLP in pure float16 is minutes on a CPU",
    _UNITTESTS + "test_lr_scheduler.py": "not ported yet: most of its tests build static "
        "programs (paddle.enable_static, Executor)",
    _UNITTESTS + "test_imperative_auto_mixed_precision.py": "not ported yet: needs CUDA "
        "for most tests (skipped by Paddle itself on a CPU build)",
    _UNITTESTS + "hybrid_parallel_mp_layers.py": "the version the index holds (10529870) is "
        "Paddle 2.2's: fleet.mpu, hybrid_configs num_model_parallel, fluid.dygraph.Layer",
    _UNITTESTS + "hybrid_parallel_pp_*.py, hybrid_parallel_mp_model.py, "
        "dygraph_group_sharded_stage2.py, dygraph_group_sharded_stage3.py": "not ported yet "
        "(tests/test_paddle_mp_model.py runs hybrid_parallel_mp_model's model and loop)",
}

# Paddle's tests in ported files that do not run here, each "file::Class" or
# "file::Class::test", with the reason (skipped, so they stay counted).
LEFT_OUT = {
    "test_metrics.py::TestAccuracyDynamic": "fluid.dygraph.guard and fluid.CPUPlace: "
        "Paddle 1.x's dygraph switch, no Paddle 2.x name",
    "test_metrics.py::TestAccuracyDynamicMultiTopk": "the same test as TestAccuracyDynamic",
    "test_metrics.py::TestAccuracyStatic": "static graph (fluid.Program, Executor)",
    "test_metrics.py::TestAccuracyStaticMultiTopk": "static graph (fluid.Program, Executor)",
}


def sha256(text):
    return hashlib.sha256(text.encode()).hexdigest()


def port(text):
    """Paddle's file ``text`` with ``EDITS`` applied."""
    for old, new in EDITS:
        text = re.sub("^" + re.escape(old), lambda _: new, text, flags=re.MULTILINE)
    return text


def read_original(originals, name):
    """The original of ``name`` from the folder ``originals``, refused unless its hash is the
    one recorded."""
    path, commit, digest = SOURCES[name]
    with open(os.path.join(originals, name)) as f:
        text = f.read()
    if sha256(text) != digest:
        raise ValueError(f"{os.path.join(originals, name)} is not Paddle's {path} at {commit} "
                         f"(SHA-256 {sha256(text)}, recorded {digest})")
    return text


def write_ported(originals, out=PORTED):
    os.makedirs(out, exist_ok=True)
    for name in SOURCES:
        with open(os.path.join(out, name), "w") as f:
            f.write(port(read_original(originals, name)))
    return sorted(SOURCES)


def left_out_table():
    rows = ["| Paddle test left out | why |", "| --- | --- |"]
    rows += [f"| `{where}` | {why} |" for where, why in NOT_PORTED.items()]
    rows += [f"| `{where}` | {why} |" for where, why in LEFT_OUT.items()]
    return "\n".join(rows) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python tests/paddle/port.py")
    parser.add_argument("originals", nargs="?", help="folder of Paddle's original files")
    parser.add_argument("--table", action="store_true", help="print the left-out table")
    args = parser.parse_args(argv)
    if args.table:
        sys.stdout.write(left_out_table())
    elif args.originals:
        for name in write_ported(args.originals):
            print(f"wrote {os.path.join(PORTED, name)}")
    else:
        parser.error("give ORIGINALS_DIR or --table")


if __name__ == "__main__":
    main()

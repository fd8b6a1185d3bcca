"""The FLEETMPI_* variables: one table of them, seconds with the zero rule, errors naming the
value, and the README's table rendered from the knobs."""
import ast
import os
import re

import pytest

import fleetmpi
from fleetmpi.core import knobs
from fleetmpi.docs import variables_table
from fleetmpi.core.knobs import env_seconds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_unset_or_empty_keeps_the_default():
    assert env_seconds("T", 5.0, environ={}) == 5.0
    assert env_seconds("T", 5.0, environ={"T": ""}) == 5.0


def test_a_number_of_seconds_is_read():
    assert env_seconds("T", 5.0, environ={"T": "0.25"}) == 0.25


def test_zero_only_where_it_means_something():
    assert env_seconds("T", 5.0, zero_means="no limit", environ={"T": "0"}) == 0.0
    with pytest.raises(ValueError, match=r"T='0' must be a positive number of seconds"):
        env_seconds("T", 5.0, environ={"T": "0"})


@pytest.mark.parametrize("text", ["-1", "soon", "inf", "nan"])
def test_bad_values_are_named_with_the_rule_and_default(text):
    with pytest.raises(ValueError, match=rf"T='{text}' must be a number of seconds >= 0 "
                                         r"\(0: no limit; unset: 5\)"):
        env_seconds("T", 5.0, zero_means="no limit", environ={"T": text})


def test_the_readme_table_has_a_row_for_every_knob():
    """One row per knob, with its default; that README.md holds this table today is
    ``tests/test_docs_tool.py``'s check of every generated file."""
    rows = variables_table.markdown_table().splitlines()
    for knob in knobs.KNOBS:
        mine = [row for row in rows if row.startswith(f"| `{knob.name}` |")]
        assert len(mine) == 1, (knob.name, mine)
        assert knob.doc in mine[0], (knob.name, mine[0])
    with open(os.path.join(ROOT, "README.md")) as f:
        assert variables_table.TABLE_START in f.read()


def test_every_variable_the_package_names_is_a_knob():
    """A FLEETMPI_* name written anywhere in the package's source is a knob's (where it is
    documented and parsed), and knobs.py imports nothing from fleetmpi."""
    names = {knob.name for knob in knobs.KNOBS}
    assert len(names) == len(knobs.KNOBS)
    package = os.path.dirname(fleetmpi.__file__)
    folders = [package] + [os.path.join(ROOT, name) for name in ("comm", "strategies",
                                                                   "launch")]
    written = set()
    for folder in folders:
        for directory, _, files in os.walk(folder):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(directory, name)) as f:
                        written |= set(re.findall(r"FLEETMPI_[A-Z_]*[A-Z]", f.read()))
    assert written <= names, f"not in fleetmpi.core.knobs: {sorted(written - names)}"
    with open(knobs.__file__) as f:
        tree = ast.parse(f.read())
    imported = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and (node.level or (node.module or "").startswith("fleetmpi"))]
    assert not imported


@pytest.mark.parametrize("knob", knobs.KNOBS, ids=lambda knob: knob.name)
def test_unset_or_empty_gives_the_default(knob):
    assert knob.value({}) == knob.default
    assert knob.value({knob.name: ""}) == knob.default


@pytest.mark.parametrize("knob, text, value", [
    (knobs.DEVICE, " GPU ", "gpu"), (knobs.NUM_THREADS, "3", 3),
    (knobs.KEEP_HOST_MEMORY, "0", False), (knobs.ABORT_ON_ERROR, "1", True),
    (knobs.CHECK_COLLECTIVES, "always", "always"), (knobs.CHECK_COLLECTIVES, "0", False),
    (knobs.TRANSPORT, "nccl", "nccl"), (knobs.LOG_LEVEL, "info", "INFO"),
    (knobs.STALL_TIMEOUT, "0", 0.0), (knobs.PS_TIMEOUT, "2.5", 2.5),
    (knobs.AUTO_ALLOW, "none", frozenset()), (knobs.AUTO_ALLOW, "dgc, amp", {"dgc", "amp"}),
    (knobs.AUTO_MEMORY_MB, "64", 64.0), (knobs.RESTART_COUNT, "2", 2),
    (knobs.TIMELINE, "t.json", "t.json"),
])
def test_values_are_parsed(knob, text, value):
    assert knob.value({knob.name: text}) == value


@pytest.mark.parametrize("knob, text, message", [
    (knobs.KEEP_HOST_MEMORY, "yes", "FLEETMPI_KEEP_HOST_MEMORY='yes' must be 0 or 1 (0: glibc's"),
    (knobs.OVERLAP_ALLREDUCE, "2", "FLEETMPI_OVERLAP_ALLREDUCE='2' must be 0 or 1 (0: reduce"),
    (knobs.CHECK_COLLECTIVES, "x", "FLEETMPI_CHECK_COLLECTIVES='x' must be 0, 1 or always"),
    (knobs.TRANSPORT, "gloo", "FLEETMPI_TRANSPORT='gloo' must be auto, mpi or nccl"),
    (knobs.DEVICE, "tpu", "FLEETMPI_DEVICE='tpu' is not a device"),
    (knobs.NUM_THREADS, "0", "FLEETMPI_NUM_THREADS='0' must be a positive integer"),
    (knobs.NUM_THREADS, "99999999999999999999",
     "FLEETMPI_NUM_THREADS='99999999999999999999' must be a positive integer up to 65536"),
    (knobs.LOCAL_SIZE, "two", "FLEETMPI_LOCAL_SIZE='two' must be a positive integer"),
    (knobs.LOG_LEVEL, "loud", "FLEETMPI_LOG_LEVEL='LOUD' is not a logging level"),
    (knobs.RESTART_COUNT, "-1", "FLEETMPI_RESTART_COUNT='-1' must be a whole number >= 0"),
    (knobs.PS_TIMEOUT, "0", "FLEETMPI_PS_TIMEOUT='0' must be a positive number of seconds"),
])
def test_bad_values_name_the_variable_the_value_and_what_is_allowed(knob, text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        knob.value({knob.name: text})


# -- the agreed knobs: the same meaning on every rank, checked at fleet.init ------------------

MISMATCHED_START = """
import os, sys
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
os.environ.update(dict(pair.split("=", 1) for pair in sys.argv[2 + rank].split(",") if pair))
import fleetmpi as fleet
from fleetmpi.core.knob_agreement import KnobMismatchError
try:
    fleet.init(is_collective=True)
    said = "started"
except KnobMismatchError as error:
    said = f"refused: {error}"
with open(os.path.join(sys.argv[1], f"rank-{rank}"), "w") as f:
    f.write(said)
"""


@pytest.mark.parametrize("settings, said", [
    (["", "FLEETMPI_CHECK_COLLECTIVES=0"],
     "FLEETMPI_CHECK_COLLECTIVES is unset on rank(s) 0, '0' on rank(s) 1"),
    (["FLEETMPI_NONFINITE=skip,FLEETMPI_OVERLAP_ALLREDUCE=0", "FLEETMPI_NONFINITE=stop"],
     "FLEETMPI_OVERLAP_ALLREDUCE is '0' on rank(s) 0, unset on rank(s) 1; "
     "FLEETMPI_NONFINITE is 'skip' on rank(s) 0, 'stop' on rank(s) 1"),
    (["FLEETMPI_CHECK_COLLECTIVES=1,FLEETMPI_LOG_LEVEL=DEBUG", ""], None),   # same meanings
], ids=["check_collectives", "two_variables", "default_spelled_out"])
def test_ranks_started_with_different_agreed_settings_are_refused_on_every_rank(tmp_path, settings,
                                                                            said):
    """Where the ranks would deadlock at their first collective, every rank is told at
    ``fleet.init`` which variable differs and where; the default written out and a per-rank
    knob (the log level) are no difference."""
    import subprocess
    import sys

    from fleetmpi.launch.mpi_command import local_command
    from job_limits import HANG_SECONDS

    environ = {name: value for name, value in os.environ.items()
               if name not in {knob.name for knob in knobs.AGREED}}
    done = subprocess.run(local_command(2, [sys.executable, "-c", MISMATCHED_START,
                                            str(tmp_path)] + settings),
                          capture_output=True, text=True, timeout=HANG_SECONDS, env=environ)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        text = (tmp_path / f"rank-{rank}").read_text()
        if said is None:
            assert text == "started", text
        else:
            assert text.startswith("refused: ") and said in text, text


def test_every_agreed_knob_is_a_knob():
    assert set(knobs.AGREED) <= set(knobs.KNOBS)

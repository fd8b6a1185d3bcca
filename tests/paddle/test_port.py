"""The port of Paddle's tests changes nothing but imports, reproduces the ported files from
Paddle's originals, and docs/paddle_compat.md lists what it leaves out.

Paddle's originals are read from the folder ``FLEETMPI_PADDLE_ORIGINALS`` names; without it the
checks that need them are skipped (the originals are not kept in this repository)."""
import os

import pytest

import port

ORIGINALS = os.environ.get("FLEETMPI_PADDLE_ORIGINALS")
needs_originals = pytest.mark.skipif(
    not ORIGINALS, reason="FLEETMPI_PADDLE_ORIGINALS names no folder of Paddle's originals")
DOC = os.path.join(os.path.dirname(os.path.dirname(port.HERE)), "docs", "paddle_compat.md")


def _is_import(line):
    return line.lstrip().startswith(("import ", "from "))


def test_every_edit_renames_an_import_and_nothing_else():
    for old, new in port.EDITS:
        assert _is_import(old) and _is_import(new), (old, new)
        assert old.count("\n") == new.count("\n"), (old, new)


def test_every_left_out_test_names_a_ported_file():
    assert {where.split("::")[0] for where in port.LEFT_OUT} <= set(port.SOURCES)


def test_the_docs_list_every_left_out_test():
    with open(DOC) as f:
        assert port.left_out_table() in f.read()


@needs_originals
@pytest.mark.parametrize("name", sorted(port.SOURCES))
def test_the_port_changes_only_import_lines_and_reproduces_the_ported_file(name):
    original = port.read_original(ORIGINALS, name)  # refused unless its SHA-256 is recorded
    ported = port.port(original)
    pairs = list(zip(original.splitlines(), ported.splitlines()))
    assert len(pairs) == len(original.splitlines()) == len(ported.splitlines())
    assert all(_is_import(a) and _is_import(b) for a, b in pairs if a != b)
    assert original.splitlines()[:13] == ported.splitlines()[:13]  # Paddle's license header
    with open(os.path.join(port.PORTED, name)) as f:
        assert f.read() == ported

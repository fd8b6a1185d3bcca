"""Paddle's ported tests (``ported/``, written by ``port.py``): each test that ``port.LEFT_OUT``
names is skipped with its reason, so the count of left-out tests stays visible."""
import os

import pytest

from port import LEFT_OUT, PORTED


def _left_out(item):
    """The reason ``item`` is left out, or None."""
    name = os.path.relpath(str(item.path), PORTED)
    parts = [name] + item.nodeid.split("::")[1:]
    for depth in range(len(parts), 0, -1):
        why = LEFT_OUT.get("::".join(parts[:depth]))
        if why:
            return why
    return None


def pytest_collection_modifyitems(items):
    for item in items:
        if str(item.path).startswith(PORTED + os.sep):
            why = _left_out(item)
            if why:
                item.add_marker(pytest.mark.skip(reason=f"left out of the port: {why}"))

"""The ``cluster`` fixture: two test hosts, h1 and h2 (``hosts.Cluster``), removed after the
test whatever its outcome, and checked to be gone with every link and process they had;
skipped where namespaces are refused."""
import glob
import os
import tempfile

import pytest

import hosts


@pytest.fixture
def cluster():
    reason = hosts.unavailable_reason()
    if reason:
        pytest.skip(reason)
    links = hosts.link_names()
    made = hosts.Cluster(("h1", "h2"))
    try:
        yield made
    finally:
        made.remove()
    assert hosts.namespaces(made.prefix) == [] and made.processes() == []
    assert made.guard.poll() is not None
    assert not glob.glob(os.path.join(hosts.ETC_NETNS, made.prefix + "*"))
    assert not glob.glob(os.path.join(tempfile.gettempdir(), made.prefix + "*"))
    assert hosts.link_names() == links

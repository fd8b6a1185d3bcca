"""Tests whose job mostly waits (a stall time, a report's linger) run it overlapped with the
test before: a test parametrized with ``job`` (an object with ``start()`` and ``end()``) gets
it started while the test before it in the same module runs, and its own body takes the result
as usual, so each test still checks its own job. Two jobs at a time at most; a job started
ahead for a test that then does not run (``-x``) is ended with the session.

    from job_prefetch import start_the_next_job  # noqa: F401 (an autouse fixture)
"""
import pytest


def _job(item):
    callspec = getattr(item, "callspec", None)
    job = callspec.params.get("job") if callspec is not None else None
    return job if hasattr(job, "start") else None


@pytest.fixture(autouse=True)
def start_the_next_job(request):
    items = request.session.items
    index = items.index(request.node) if request.node in items else len(items)
    for item in items[index + 1:index + 2]:
        job = _job(item)
        if job is not None and item.module is request.module:
            job.start()
            request.config.add_cleanup(job.end)

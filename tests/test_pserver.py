"""Parameter-server mode end to end: each test starts a job of servers and workers under
``mpiexec`` (tests/pserver_jobs.py, where every worker checks its results against
single-process math) and checks how it ended. Single-process tests: not marked ``mpi``."""
import json
import os
import re
import subprocess
import sys
import time

import pytest

from fleetmpi.launch.mpi_command import local_command

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "pserver_jobs.py")
JOB_TIMEOUT = 120


def run_job(ranks, servers, scenario, *args, env=None):
    """``(exit code, output, seconds)`` of one job; a job that outlives JOB_TIMEOUT fails."""
    command = local_command(ranks) + [sys.executable, JOB, scenario, "--servers", str(servers),
                                      *args]
    environ = dict(os.environ, **(env or {}))
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=JOB_TIMEOUT,
                          env=environ)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - start


def reports(output):
    """The servers' reports, by server index (the launcher may join lines of different
    ranks, so no line anchors)."""
    return {int(m.group(1)): json.loads(m.group(2))
            for m in re.finditer(r"report (\d+) (\{[^{}]*\})", output)}


def assert_workers_ok(output, check, workers):
    for w in range(workers):
        assert re.search(rf"ok {check}[^\n]* worker {w}\b", output), output


@pytest.mark.parametrize("ranks,servers", [(2, 1), (3, 1), (4, 2)])
def test_sync_equals_data_parallel_with_uneven_batches(ranks, servers):
    """Adam, float64, a parameter split over both servers; worker w has 6 - w batches."""
    code, output, _ = run_job(ranks, servers, "sync")
    workers = ranks - servers
    assert code == 0, output
    assert_workers_ok(output, "sync", workers)
    for report in reports(output).values():
        assert report["updates"] == 6
        assert report["pushes"] == [6 - w for w in range(workers)]
    assert len(reports(output)) == servers


@pytest.mark.parametrize("mode", ["async", "geo"])
def test_async_and_geo_reach_95_percent_on_digits(mode):
    code, output, _ = run_job(4, 2, "digits", "--mode", mode)
    assert code == 0, output
    assert_workers_ok(output, f"digits {mode}", 2)
    found = reports(output)
    assert sorted(found) == [0, 1]
    for report in found.values():
        assert report["mode"] == mode
        assert report["pushes"][0] > 0 and report["pushes"][1] > 0
        if mode == "async":
            # every push is applied on its own, and the other worker's pushes make it stale
            assert report["updates"] == sum(report["pushes"])
            assert report["staleness_max"] >= 1
        else:
            assert report["staleness_max"] == 0

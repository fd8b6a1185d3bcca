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

from job_limits import HANG_SECONDS

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "pserver_jobs.py")


def run_job(ranks, servers, scenario, *args, env=None, fleetmpirun=False):
    """``(exit code, output, seconds)`` of one job; a job that outlives HANG_SECONDS fails.
    ``fleetmpirun``: started by ``fleetmpirun --server_num --worker_num`` (roles from its
    variables) instead of ``mpiexec`` (roles from ``UserDefinedRoleMaker``)."""
    launcher = ([sys.executable, "-m", "fleetmpi.launch", "--server_num", str(servers),
                 "--worker_num", str(ranks - servers)] if fleetmpirun
                else local_command(ranks) + [sys.executable])
    command = launcher + [JOB, scenario, "--servers", str(servers), *args]
    environ = dict(os.environ, **(env or {}))
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=HANG_SECONDS,
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


@pytest.mark.parametrize("ranks,servers,fleetmpirun", [(3, 1, True), (4, 2, False)])
def test_sync_equals_data_parallel_with_uneven_batches(ranks, servers, fleetmpirun):
    """Adam, float64, a parameter split over both servers; worker w has 6 - w batches."""
    code, output, _ = run_job(ranks, servers, "sync", fleetmpirun=fleetmpirun)
    workers = ranks - servers
    assert code == 0, output
    assert_workers_ok(output, "sync", workers)
    for report in reports(output).values():
        assert report["updates"] == 6
        assert report["pushes"] == [6 - w for w in range(workers)]
    assert len(reports(output)) == servers


@pytest.mark.parametrize("ranks,servers,fleetmpirun", [(5, 2, True), (4, 1, False)])
def test_roles_endpoints_and_util_in_each_group(ranks, servers, fleetmpirun):
    code, output, _ = run_job(ranks, servers, "roles", fleetmpirun=fleetmpirun)
    assert code == 0, output
    assert_workers_ok(output, "roles", ranks - servers)
    for j in range(servers):
        assert re.search(rf"ok roles server {j}\b", output), output


@pytest.mark.parametrize("mode", ["sync", "geo"])
def test_the_parameter_server_example_trains_under_fleetmpirun(mode):
    example = os.path.join(os.path.dirname(HERE), "examples", "train_pserver.py")
    command = [sys.executable, "-m", "fleetmpi.launch", "--server_num", "2", "--worker_num",
               "2", example, "--mode", mode, "--epochs", "10", "--min-accuracy", "0.9"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=HANG_SECONDS)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert re.search(rf"{mode}: mean test accuracy 0\.9\d+ over 2 worker\(s\) and 2 "
                     r"server\(s\) \(127\.0\.0\.1:6172, 127\.0\.0\.1:6173\)", output), output


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


@pytest.mark.parametrize("ranks,servers,mode,idiom", [
    (4, 2, "sync", "minimize"), (4, 2, "async", "minimize"), (4, 2, "geo", "minimize"),
    (3, 1, "sync", "minimize"), (4, 2, "sync", "dygraph"), (4, 2, "geo", "dygraph")])
def test_sparse_rows_pulled_and_pushed_are_exactly_the_touched_ones(ranks, servers, mode,
                                                                     idiom):
    """A 1000 x 8 Embedding(sparse=True): every step each worker pulls exactly the distinct ids
    of its batch (GEO: those not cached since its last push) and pushes exactly those (GEO:
    every row touched since its last push); synchronous training equals one process with a
    dense Embedding started from the servers' rows. Workers train with ``opt.minimize(model,
    loss_fn, x, y)`` or with ``loss.backward(); opt.step(); opt.clear_grad()``."""
    code, output, _ = run_job(ranks, servers, "sparse", "--mode", mode, "--idiom", idiom)
    assert code == 0, output
    assert_workers_ok(output, f"sparse {mode} {idiom}", ranks - servers)


def test_sync_worker_that_raises_ends_the_job_naming_it():
    """Worker 1 raises at its third step; with or without the abort-on-error hook the job
    ends (well inside the test's timeout) with an error naming worker 1's rank."""
    for abort in ("1", "0"):
        code, output, _ = run_job(4, 2, "leave", "--mode", "sync",
                                  env={"FLEETMPI_ABORT_ON_ERROR": abort})
        assert code != 0, output
        assert "worker 1 fails on purpose" in output
        if abort == "0":
            assert re.search(r"server \d stopped: worker 1 \(rank 1\) left the job without "
                             r"stop_worker after 2 step\(s\)", output), output
            assert "WorkerLostError" in output and "ServerError" in output


def test_sync_worker_that_stops_pushing_is_named_after_the_timeout():
    code, output, _ = run_job(4, 2, "stall", "--mode", "sync",
                                    env={"FLEETMPI_ABORT_ON_ERROR": "0",
                                         "FLEETMPI_PS_TIMEOUT": "1"})
    assert code != 0, output
    assert re.search(r"worker\(s\) \[1\] \(rank\(s\) \[1\]\) pushed nothing for step 2 "
                     r"within 1 s \(FLEETMPI_PS_TIMEOUT\)", output), output


@pytest.mark.parametrize("mode", ["async", "geo"])
def test_async_and_geo_servers_stop_when_only_a_silent_worker_is_left(mode):
    """Worker 1 hangs (sleeps three timeouts) after 2 steps; worker 0 trains on and stops;
    then the servers wait one timeout for the silent worker, stop naming it, and the job
    ends instead of hanging."""
    code, output, _ = run_job(4, 2, "stall", "--mode", mode,
                              env={"FLEETMPI_ABORT_ON_ERROR": "0", "FLEETMPI_PS_TIMEOUT": "2"})
    assert code != 0, output
    assert re.search(r"worker\(s\) \[1\] \(rank\(s\) \[1\]\) sent nothing for 2 s "
                     r"\(FLEETMPI_PS_TIMEOUT\) and no other worker is training", output), output
    assert f"ok leave {mode} worker 0" in output, output


@pytest.mark.parametrize("mode", ["async", "geo"])
def test_async_and_geo_servers_go_on_without_a_worker_that_left(mode):
    code, output, _ = run_job(4, 2, "leave", "--mode", mode)
    assert code == 0, output
    assert "training goes on with the other workers" in output
    assert_workers_ok(output, f"leave {mode}", 1)
    for report in reports(output).values():
        assert report["lost_workers"] == [1]
        assert report["pushes"][0] > report["pushes"][1]


@pytest.mark.parametrize("mode,fleetmpirun", [("async", False), ("geo", False),
                                               ("async", True)])
def test_an_async_or_geo_worker_that_raises_ends_alone_and_the_others_train_on(mode,
                                                                              fleetmpirun):
    """Worker 1 raises at its third step: its traceback names its rank, the servers hear
    why and train on with worker 0, which finishes all its steps; the job's status is
    non-zero at the end, because a worker failed (under fleetmpirun, which names the rank
    that left)."""
    code, output, _ = run_job(4, 2, "raise", "--mode", mode, fleetmpirun=fleetmpirun)
    assert code != 0, output
    assert re.search(r"rank 1/4 on node \S+ failed:", output), output
    assert "worker 1 fails on purpose" in output
    assert re.search(r"worker 1 \(rank 1\) left the job without stop_worker after 2 "
                     r"step\(s\): it raised ValueError: worker 1 fails on purpose", output), output
    assert "training goes on with the other workers" in output
    assert_workers_ok(output, f"leave {mode}", 1)
    for report in reports(output).values():
        assert report["lost_workers"] == [1]
        assert report["pushes"][0] > report["pushes"][1]
    if fleetmpirun:
        assert "1 (pid" in output and "left after an uncaught exception while the others " \
            "went on" in output, output


def test_an_async_worker_that_sigint_ends_is_reported_as_interrupted_not_as_raising():
    """Worker 1 hangs until a SIGINT ends it (as ``mpiexec.gforker`` ends a hung rank while
    it ends the job): ``fleetmpirun`` names it as interrupted, not as a rank that left after
    an exception of its own, and worker 0 trains to the end."""
    code, output, _ = run_job(4, 2, "interrupt", "--mode", "async", fleetmpirun=True)
    assert code != 0, output
    assert_workers_ok(output, "leave async", 1)
    assert re.search(r"did not run their script to its end: 1 \(pid \d+ on [^)]+\), "
                     r"interrupted by SIGINT \(Ctrl-C, or the MPI launcher ending the job's "
                     r"ranks\)$", output, re.M), output
    assert "left after an uncaught exception" not in output, output


def test_servers_save_shards_on_request_and_at_shutdown_and_a_new_job_resumes(tmp_path):
    """Job one: steps 0-2, worker 0 asks for a save after step 1, the servers save at
    shutdown. Job two loads the shards (blocks, Adam moments, step counts) and runs steps
    3-5; its parameters equal six uninterrupted steps on one process."""
    from fleetmpi.strategies.ps import shards

    out = str(tmp_path / "shards")
    code, output, _ = run_job(4, 2, "restart", "--out", out)
    assert code == 0, output
    assert sorted(os.listdir(out)) == ["on-request", "server-0-of-2.npz", "server-1-of-2.npz"]
    for server in (0, 1):
        _, meta = shards.load_shard(os.path.join(out, "on-request"), server, 2)
        assert meta["version"] == 2 and meta["step_count"] == 2
        _, meta = shards.load_shard(out, server, 2)
        assert meta["version"] == 3
    code, output, _ = run_job(4, 2, "restart", "--out", out, "--load", out)
    assert code == 0, output
    assert_workers_ok(output, "restart", 2)
    assert all(r["updates"] == 6 for r in reports(output).values())

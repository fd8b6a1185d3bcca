"""The stages of a GPU check, each bounded by its share of the budget; each returns its record
(``name``, ``status``: passed, failed or timed out, ``seconds``, ``timeout_s``, test counts and
the first lines of each failure where it ran tests, ``reason`` where it failed otherwise).
A stage that fails leaves the next one to run."""
import json
import os
import shutil
import sys
import time

from . import junit, mpi_launch, plan
from .install import install_offline
from .process import Finished, run_bounded

# mpi_pytest.py's own job limit ends the ranks this many seconds before the stage's deadline,
# so that it still prints every rank's log.
JOB_MARGIN_S = 15
# train_throughput.py's own start, table and JSON, kept out of the time its jobs share.
RUN_MARGIN_S = 5
# pytest's exit code where no test of a file was selected (its tests are all ``mpi`` ones).
NO_TESTS_SELECTED = 5


class Context:
    """What the stages share: folders, the mode, the install's prefix and site-packages folder
    once they are made, and the variables of the MPI launcher once one is chosen (every
    stage runs MPI, the single-process tests too)."""

    def __init__(self, repo, out, scratch, dry_run):
        self.repo, self.out, self.scratch, self.dry_run = repo, out, scratch, dry_run
        self.logs = os.path.join(out, "logs")
        # no earlier run's file is read as this one's
        for folder in ("junit", "throughput", "nonfinite_cost"):
            shutil.rmtree(os.path.join(out, folder), ignore_errors=True)
            os.makedirs(os.path.join(out, folder))
        os.makedirs(self.logs, exist_ok=True)
        self.prefix = self.site = None
        self.mpi = {"chosen": None, "tries": []}
        self.mpi_variables = {}

    def env(self, **extra):
        """The stages' environment: the installed copy first on ``PYTHONPATH``, the plan's
        ``FLEETMPI_DEVICE``, the MPI launcher's variables, then ``extra``."""
        env = dict(os.environ, FLEETMPI_DEVICE=plan.fleetmpi_device(self.dry_run),
                   **self.mpi_variables)
        if self.site:
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (self.site, os.environ.get("PYTHONPATH")) if p)
        env.update(extra)
        return env

    def choose_mpi(self, timeout_s):
        variables, self.mpi = mpi_launch.choose_launcher(self.env(), self.prefix,
                                                         self.scratch, timeout_s, self.logs)
        self.mpi_variables = variables or {}

    def run(self, name, cmd, env, timeout_s):
        return run_bounded(cmd, env, self.scratch, timeout_s, os.path.join(self.logs,
                                                                           name + ".log"))


def _tests_record(name, done, junit_paths, timeout_s, **extra):
    """A test stage's record from its finished command and its JUnit XML files."""
    counts = junit.summarize(junit_paths)
    record = dict(name=name, seconds=round(done.seconds, 1), timeout_s=round(timeout_s),
                  **counts, **extra)
    if done.timed_out:
        record.update(status="timed out", reason=f"stopped at its limit of {timeout_s:.0f} s",
                      tail=done.tail(12))
    elif counts["failed"] or done.returncode != 0:
        record["status"] = "failed"
        if not counts["failed"]:
            record.update(reason=f"exited {done.returncode} with no failed test",
                          tail=done.tail(12))
    else:
        record["status"] = "passed"
    return record


def run_install(ctx, timeout_s, args):
    """The carried wheels of ``args.wheels`` and fleetmpi (``install.py``)."""
    try:
        record = install_offline(args.wheels, ctx.repo, ctx.scratch, timeout_s, ctx.logs)
    except (OSError, RuntimeError) as exc:
        record = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}", "seconds": 0.0}
    # what did install serves the later stages, even after a failure
    ctx.prefix, ctx.site = record.get("prefix"), record.get("site")
    return dict(record, name="install", timeout_s=round(timeout_s))


def run_gpu_tests(ctx, timeout_s, args):
    """pytest on the plan's single-process test files (or ``args.tests``; the dry run of the
    plan's files runs a sample of each, ``_sample``), each file in a process of its own, so that a CUDA error that poisons a context (an illegal address)
    costs only its own file; planned files that do not exist are listed as missing, and
    files the stage's time did not reach as not run."""
    planned = args.tests or [path for path, _ in plan.GPU_TEST_FILES]
    paths = [os.path.join(ctx.repo, path) for path in planned]
    present = [path for path in paths if os.path.exists(path)]
    missing = [name for name, path in zip(planned, paths) if not os.path.exists(path)]
    if not present:
        return {"name": "gpu_tests", "status": "failed", "seconds": 0.0, "missing": missing,
                "timeout_s": round(timeout_s), "reason": "none of the test files exists"}
    sample, env = _sample(ctx, args)
    start, runs, xmls = time.perf_counter(), [], []
    for path in present:
        left = timeout_s - _since(start)
        if left < 1:
            break
        name = "gpu_tests-" + os.path.splitext(os.path.basename(path))[0]
        xmls.append(os.path.join(ctx.out, "junit", name + ".xml"))
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "not mpi",
               f"--timeout={plan.TEST_TIMEOUT_S}", f"--junitxml={xmls[-1]}", *sample, path]
        runs.append(ctx.run(name, cmd, env, left))
    return _tests_record("gpu_tests", _together(runs, _since(start)), xmls, timeout_s,
                         missing=missing, not_run=[os.path.relpath(p, ctx.repo)
                                                   for p in present[len(runs):]],
                         sample_per_file=plan.DRY_RUN_SAMPLE_PER_FILE if sample else None)


def _sample(ctx, args):
    """``(pytest arguments, environment)`` of the gpu_tests stage: in the dry run of the plan's
    files, a sample of each (``gpu_run/sample.py``, importable from ``benchmarks``)."""
    if not ctx.dry_run or args.tests:
        return [], ctx.env()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = ctx.env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), here) if p)
    return ["-p", "gpu_run.sample", "--sample-per-file", str(plan.DRY_RUN_SAMPLE_PER_FILE)], env


def _together(runs, seconds):
    """One ``Finished`` for the per-file runs of the test stage: the first failing run's code
    and log (the last run's where none failed; pytest's 5, no test selected, is no failure),
    timed out where any was."""
    failing = [run for run in runs if run.returncode not in (0, NO_TESTS_SELECTED)]
    shown = failing[0] if failing else runs[-1]
    return Finished(shown.returncode if failing else 0, any(run.timed_out for run in runs),
                    seconds, shown.log)


def _since(start):
    return time.perf_counter() - start


def run_multi_rank(ctx, timeout_s, args):
    """The plan's data-parallel selection at ``plan.MULTI_RANK_RANKS`` ranks on one device over
    the MPI transport, through ``tests/mpi_pytest.py``."""
    if ctx.mpi["chosen"] is None:
        return {"name": "multi_rank", "status": "failed", "seconds": 0.0,
                "timeout_s": round(timeout_s),
                "reason": "no MPI launcher started 2 ranks that see each other: " + "; ".join(
                    f"{t['name']}: {t.get('why')}" for t in ctx.mpi["tries"])}
    junit_dir = os.path.join(ctx.out, "junit", "multi_rank")
    ranks = plan.MULTI_RANK_RANKS
    cmd = [sys.executable, os.path.join(ctx.repo, "tests", "mpi_pytest.py"), "-n", str(ranks),
           "--job-timeout", str(max(int(timeout_s) - JOB_MARGIN_S, 30)), "--junit-dir",
           junit_dir, "--", "-k", plan.MULTI_RANK_SELECTION]
    done = ctx.run("multi_rank", cmd, ctx.env(FLEETMPI_TRANSPORT="mpi"), timeout_s)
    paths = [os.path.join(junit_dir, f"rank-{rank}.xml") for rank in range(ranks)]
    return _tests_record("multi_rank", done, paths, timeout_s)


def _throughput_run(ctx, model, precisions, steps, timeout_s):
    """``(rows, failure or None)`` of ``benchmarks/train_throughput.py`` on one model, its
    jobs sharing ``timeout_s`` less ``RUN_MARGIN_S`` (its own start and table)."""
    path = os.path.join(ctx.out, "throughput", f"{model}.json")
    jobs_s = max(timeout_s - min(RUN_MARGIN_S, timeout_s / 4), 1.0)
    cmd = [sys.executable, os.path.join(ctx.repo, "benchmarks", "train_throughput.py"),
           "--device", plan.fleetmpi_device(ctx.dry_run), "--ranks", "1", "--models", model,
           "--precisions", *precisions, "--steps", str(steps), "--budget-s", f"{jobs_s:.0f}",
           "--no-tape", "--no-breakdown", "--json", path]
    done = ctx.run(f"throughput-{model}", cmd, ctx.env(), timeout_s)
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            rows = json.load(f)
    if done.returncode == 0 and not done.timed_out and rows:
        return rows, None
    return rows, _command_failure(f"train_throughput.py --models {model}", done)


def _command_failure(what, done):
    """The failure record of the benchmark command ``what`` that timed out or exited non-zero
    (``done``), with the last lines of its log."""
    ended = "timed out" if done.timed_out else f"exited {done.returncode}"
    return {"test": f"{what} ({ended})", "lines": done.tail(6)}


def _benchmark_record(name, start, timeout_s, failures, **found):
    """The record of the benchmark stage ``name`` begun at ``start``, with what it ``found``."""
    return dict({"name": name, "status": "failed" if failures else "passed",
                 "seconds": round(_since(start), 1), "timeout_s": round(timeout_s)},
                **found, failures=failures)


def run_throughput(ctx, timeout_s, args):
    """``benchmarks/train_throughput.py`` at one rank, one run per model of the plan, each
    with its weight's share of what is left."""
    start = time.perf_counter()
    config = plan.THROUGHPUT[plan.fleetmpi_device(ctx.dry_run)]
    runs = config["runs"]
    rows, failures = [], []
    for index, (model, precisions, weight) in enumerate(runs):
        share = (timeout_s - _since(start)) * weight / sum(w for _, _, w in runs[index:])
        found, failure = _throughput_run(ctx, model, precisions, config["steps"], share)
        rows += found
        failures += [failure] if failure else []
    return _benchmark_record("throughput", start, timeout_s, failures, rows=rows)


def run_nonfinite_cost(ctx, timeout_s, args):
    """``benchmarks/nonfinite_cost.py`` at one rank, one run per model of the plan, each with
    an equal share of what is left: its step with the default non-finite check against its
    step without, and the check's own time (issue 34's bound: at most 2%)."""
    start = time.perf_counter()
    runs = plan.NONFINITE_COST[plan.fleetmpi_device(ctx.dry_run)]
    costs, failures = [], []
    for index, (model, steps) in enumerate(runs):
        share = (timeout_s - _since(start)) / (len(runs) - index)
        path = os.path.join(ctx.out, "nonfinite_cost", f"{model}.json")
        cmd = [sys.executable, os.path.join(ctx.repo, "benchmarks", "nonfinite_cost.py"),
               model, str(steps), "--json", path]
        done = ctx.run(f"nonfinite_cost-{model}", cmd, ctx.env(), share)
        if done.returncode == 0 and not done.timed_out and os.path.exists(path):
            with open(path) as f:
                costs.append(json.load(f))
            continue
        failures.append(_command_failure(f"nonfinite_cost.py {model}", done))
    return _benchmark_record("nonfinite_cost", start, timeout_s, failures, costs=costs)


# Each stage of ``plan.STAGES``: ``run(context, timeout_s, command-line arguments)``.
RUNNERS = {"install": run_install, "gpu_tests": run_gpu_tests, "multi_rank": run_multi_rank,
           "throughput": run_throughput, "nonfinite_cost": run_nonfinite_cost}

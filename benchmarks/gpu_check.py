"""One prepared command that proves the GPU path on a lent GPU machine, and its dry run on the
CPU, which CI runs so that the command never rots between GPU runs.

    python3 benchmarks/gpu_check.py --out DIR [--wheels .whl] [--dry-run] [--budget-s 450]
                                    [--commit SHA] [--stages NAME ...] [--tests FILE ...]

From the repository root. Stages, in order, each within its share of ``--budget-s`` (a stage
that fails or runs out of time is recorded, and the next one runs):

1. install: the wheels carried in ``--wheels`` and fleetmpi itself, offline, into a temporary
   target first on ``PYTHONPATH`` (``gpu_run/install.py``); then the versions are recorded;
2. gpu_tests: pytest with ``FLEETMPI_DEVICE=gpu`` on the test files of ``gpu_run/plan.py``;
3. multi_rank: data parallel at 2 ranks on the one GPU over the MPI transport against one
   process, through ``tests/mpi_pytest.py``, with the MPI launcher that works here
   (``gpu_run/mpi_launch.py``);
4. throughput: ``benchmarks/train_throughput.py --device gpu --ranks 1``, fleetmpi next to
   PyTorch on the same GPU;
5. nonfinite_cost: ``benchmarks/nonfinite_cost.py`` at one rank, the step with the default
   non-finite check against the step without it.

Writes ``gpu_check.json``, ``summary.md``, the JUnit XML files and every command's log into
``--out``, prints the summary, and exits 1 when a stage did not pass. ``--dry-run`` runs the
same plan on the CPU (a sample of each test file, a couple of benchmark steps, PyTorch
optional). ``--stages`` runs only
the stages named (without install, the fleetmpi already importable is tested); ``--tests``
replaces the plan's files of the gpu_tests stage. docs/gpu.md says how to carry the wheels.
"""
import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time

from gpu_run import plan, report, stages
from gpu_run.process import Budget

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE_VERSIONS = os.path.join(REPO, "benchmarks", "gpu_run", "probe_versions.py")


def commit(given):
    """``(commit, whether tracked files differ from it)``: ``given``, else git's HEAD;
    "unknown" where the tree is a copy without its git history."""
    if given:
        return given, None
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "--show-toplevel", "HEAD"],
                              capture_output=True, text=True, timeout=30)
        changed = subprocess.run(["git", "-C", REPO, "status", "--porcelain",
                                  "--untracked-files=no"], capture_output=True, text=True,
                                 timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown", None
    lines = head.stdout.split()
    # a copy placed inside another repository would otherwise report that one's HEAD
    if head.returncode != 0 or os.path.realpath(lines[0]) != os.path.realpath(REPO):
        return "unknown", None
    return lines[1], bool(changed.stdout.strip())


def record_versions(ctx, timeout_s):
    done = ctx.run("versions", [sys.executable, PROBE_VERSIONS], ctx.env(), timeout_s)
    found = done.result()
    if found is None:
        return {"probe": f"failed: {' | '.join(done.tail(5))}"}
    return found


def device_name(found, dry_run):
    if dry_run:
        return f"CPU (dry run): {found.get('cpu', 'unknown')}"
    return found.get("device", "unknown")


def setup(ctx, budget):
    """Choose the MPI launcher, then record the versions the stages will see."""
    setup_s = budget.take("setup")
    ctx.choose_mpi(setup_s / 2)
    return record_versions(ctx, setup_s / 2)


def run_stages(args, ctx, budget, save):
    """Install (where chosen), the setup, then every other chosen stage in order, calling
    ``save(versions, records)`` after each; returns ``(versions, stage records)``."""
    records, found = [], None
    for name in plan.STAGES:
        if name not in args.stages:
            continue
        if name != "install" and found is None:
            found = setup(ctx, budget)
        timeout_s = budget.take(name)
        print(f"gpu_check: {name} (at most {timeout_s:.0f} s)", flush=True)
        records.append(stages.RUNNERS[name](ctx, timeout_s, args))
        print(f"gpu_check: {name} {records[-1]['status']}", flush=True)
        save(found or {}, records)
    return found or setup(ctx, budget), records


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the results")
    parser.add_argument("--wheels", default=os.path.join(REPO, ".whl"),
                        help="folder of the carried wheels (default: .whl)")
    parser.add_argument("--dry-run", action="store_true",
                        help="the same plan on the CPU (FLEETMPI_DEVICE=cpu)")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="seconds for the whole run, shared by the stages")
    parser.add_argument("--commit", help="the commit of this tree, where it has no git history")
    parser.add_argument("--stages", nargs="+", choices=plan.STAGES, default=list(plan.STAGES))
    parser.add_argument("--tests", nargs="+", metavar="FILE",
                        help="test files for the gpu_tests stage instead of the plan's "
                             "(relative to the repository root)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    weights = {part: weight for part, weight in plan.BUDGET_WEIGHTS.items()
               if part in args.stages or part == "setup"}
    budget = Budget(args.budget_s, weights)
    head, changed = commit(args.commit)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": head, "uncommitted_changes": changed, "dry_run": args.dry_run,
            "budget_s": args.budget_s}

    def save(found, records):
        """Write the results so far (what a run cut short from outside still leaves)."""
        return report.write(out, report.check_record(
            dict(meta, device=device_name(found, args.dry_run), mpi=ctx.mpi,
                 seconds=round(time.perf_counter() - budget.start, 1)), found, records))

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        ctx = stages.Context(REPO, out, scratch, args.dry_run)
        found, records = run_stages(args, ctx, budget, save)
    print(save(found, records))
    return 0 if all(r["status"] == "passed" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())

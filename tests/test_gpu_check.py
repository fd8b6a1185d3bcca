"""benchmarks/gpu_check.py, the command run on a lent GPU machine, in its dry run on the CPU:
every stage runs and lands in gpu_check.json and summary.md, and a failing test is reported
with its first lines."""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND = os.path.join(ROOT, "benchmarks", "gpu_check.py")
VERSION_KEYS = ("python", "numpy", "mpi4py", "mpi_library", "cupy", "cuda_runtime", "driver",
                "nccl", "cudnn", "cudnn_frontend", "cublaslt", "nvmath", "torch", "fleetmpi")


def load_part(name):
    spec = importlib.util.spec_from_file_location(
        f"gpu_run_{name}", os.path.join(ROOT, "benchmarks", "gpu_run", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_wheel(folder, name, tag):
    """A wheel of one empty module ``name``, tagged ``tag`` (``py3-none-any``); its file
    name."""
    info = f"{name}-0.1.dist-info"
    files = {f"{name}.py": "",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
             f"{info}/WHEEL": f"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: {tag}\n"}
    files[f"{info}/RECORD"] = "".join(f"{member},,\n" for member in [*files, f"{info}/RECORD"])
    wheel = f"{name}-0.1-{tag}.whl"
    with zipfile.ZipFile(os.path.join(folder, wheel), "w") as archive:
        for member, text in files.items():
            archive.writestr(member, text)
    return wheel


def installed():
    """What this Python's environment holds, as pip lists it."""
    return subprocess.run([sys.executable, "-m", "pip", "list", "--format=freeze",
                           "--disable-pip-version-check"], capture_output=True, text=True,
                          check=True).stdout


def gpu_check(out, *args):
    done = subprocess.run([sys.executable, COMMAND, "--dry-run", "--out", str(out), *args],
                          capture_output=True, text=True, cwd=ROOT)
    with open(os.path.join(out, "gpu_check.json")) as f:
        result = json.load(f)
    with open(os.path.join(out, "summary.md")) as f:
        summary = f.read()
    return done, result, summary


def test_dry_run_runs_every_stage_and_records_it(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    ours = write_wheel(str(wheels), "gpu_check_carried", "py3-none-any")
    foreign = write_wheel(str(wheels), "gpu_check_foreign", "cp27-cp27mu-manylinux1_x86_64")
    before = installed()
    done, result, summary = gpu_check(tmp_path / "out", "--wheels", str(wheels))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert installed() == before  # the install went to its own prefix, and took nothing away
    plan = load_part("plan")
    stages = {stage["name"]: stage for stage in result["stages"]}
    assert list(stages) == list(plan.STAGES)
    assert all(stage["status"] == "passed" for stage in stages.values())
    for key in ("device", "date", "commit", "versions", "tests", "throughput", "mpi"):
        assert key in result, key
    assert result["dry_run"] and result["device"].startswith("CPU (dry run)")
    assert all(isinstance(result["versions"][key], str) for key in VERSION_KEYS)
    assert "/prefix/" in result["versions"]["fleetmpi"]  # the installed copy ran, not the tree
    install = stages["install"]
    assert ours in install["installed"] and "fleetmpi (this tree)" in install["installed"]
    assert foreign in [w["wheel"] for w in install["not_installed"]]

    tests = result["tests"]
    assert all(isinstance(tests[key], int) for key in ("passed", "failed", "skipped"))
    assert tests["failed"] == 0 and tests["passed"] > 0
    assert tests["passed"] == stages["gpu_tests"]["passed"] + stages["multi_rank"]["passed"]
    assert stages["multi_rank"]["passed"] >= 2
    missing = [path for path, _ in plan.GPU_TEST_FILES
               if not os.path.exists(os.path.join(ROOT, path))]
    assert stages["gpu_tests"]["missing"] == missing
    # a sample of each file: the whole list is the GPU run's
    sample = plan.DRY_RUN_SAMPLE_PER_FILE
    assert stages["gpu_tests"]["sample_per_file"] == sample
    ran = sum(stages["gpu_tests"][key] for key in ("passed", "failed", "skipped"))
    assert len(plan.GPU_TEST_FILES) - len(missing) <= ran <= sample * len(plan.GPU_TEST_FILES)
    assert f"(a sample of {sample} of each file of the gpu_tests stage)" in summary

    rows = result["throughput"]
    assert [(row["model"], row["precision"]) for row in rows] == [
        (model, precision) for model, precisions, _ in plan.THROUGHPUT["cpu"]["runs"]
        for precision in precisions]
    for row in rows:
        assert row["graphs"] is False
        assert set(row) >= {"model", "batch", "precision", "graphs", "fleetmpi", "pytorch",
                            "ratio", "unit", "mfu_fleetmpi", "mfu_pytorch",
                            "peak_bytes_fleetmpi", "peak_bytes_pytorch", "kernels_per_step",
                            "host_ms_per_step"}
        # measured, or the reason it was not (bfloat16 amp where fleetmpi lacks it)
        assert (row["fleetmpi"] or 0) > 0 or row["fleetmpi_reason"]
        assert row["kernels_per_step"] is None and row["mfu_fleetmpi"] is None  # on the CPU
    assert summary.startswith(f"# GPU check: {result['device']}")
    assert f"commit {result['commit']}" in summary
    for name in plan.STAGES:
        assert f"| {name} | passed |" in summary
    for path in missing:
        assert path in summary
    assert "| mlp | 128 | fp32 | no |" in summary
    costs = stages["nonfinite_cost"]["costs"]
    assert [(c["model"], c["steps"]) for c in costs] == list(plan.NONFINITE_COST["cpu"])
    for cost in costs:
        assert cost["device"] == "cpu" and cost["ranks"] == 1
        assert cost["median_step_s_without"] > 0 and cost["median_step_s_with"] > 0
        assert cost["median_read_s"] > 0
        assert f"| {cost['model']} | {cost['steps']} | " in summary
    assert summary in done.stdout


def test_a_failing_test_is_reported_with_its_first_lines(tmp_path):
    tests = tmp_path / "test_planted.py"
    tests.write_text("import pytest\n\n"
                     "def test_passes():\n    assert True\n\n"
                     "def test_fails():\n    assert 41 == 42, 'planted failure'\n\n"
                     "def test_skips():\n    pytest.skip('not here')\n")
    out = tmp_path / "out"
    done, result, summary = gpu_check(out, "--stages", "gpu_tests", "--tests", str(tests))
    assert done.returncode == 1
    assert result["tests"] == {"passed": 1, "failed": 1, "skipped": 1}
    [stage] = result["stages"]
    assert stage["status"] == "failed"
    [failure] = stage["failures"]
    assert failure["test"].endswith("::test_fails")
    assert any("planted failure" in line for line in failure["lines"])
    assert "FAILED " + failure["test"] in summary and "planted failure" in summary


def test_a_test_failed_on_one_rank_counts_once_as_failed(tmp_path):
    junit = load_part("junit")
    case = '<testcase classname="tests.test_x" name="{}">{}</testcase>'
    bad = '<failure message="AssertionError: rank 1 differs">E   assert 1 == 0</failure>'
    for rank, body in enumerate(("", bad)):
        (tmp_path / f"rank-{rank}.xml").write_text(
            "<testsuites><testsuite>" + case.format("test_a", body)
            + case.format("test_b", "<skipped/>") + "</testsuite></testsuites>")
    paths = [str(tmp_path / f"rank-{rank}.xml") for rank in range(3)]  # rank 2 never wrote
    found = junit.summarize(paths)
    assert (found["passed"], found["failed"], found["skipped"]) == (0, 1, 1)
    assert found["failures"] == [{"test": "tests.test_x::test_a (rank 1)", "lines": [
        "AssertionError: rank 1 differs", "E   assert 1 == 0"]}]


def test_a_stage_out_of_time_keeps_what_ran_and_the_next_stage_runs(tmp_path):
    tests = tmp_path / "test_slow.py"
    tests.write_text("import time\n\n"
                     "def test_quick():\n    assert True\n\n"
                     "def test_slow():\n    time.sleep(600)\n")
    done, result, summary = gpu_check(tmp_path / "out", "--stages", "gpu_tests", "throughput",
                                      "--tests", str(tests), "--budget-s", "30")
    assert done.returncode == 1
    gpu_tests, throughput = result["stages"]
    assert gpu_tests["status"] == "timed out"
    assert (gpu_tests["passed"], gpu_tests["failed"]) == (1, 0)  # pytest's XML survived
    assert throughput["name"] == "throughput" and throughput["seconds"] > 0
    assert "| gpu_tests | timed out |" in summary


def test_a_command_past_its_time_gets_sigint_even_where_the_run_ignores_it(tmp_path):
    """A run started in the background of a script inherits SIGINT ignored; the command it
    starts still gets SIGINT at its default, so that pytest can write its XML before the kill
    (without that, the out-of-time stage above lost its XML in such a run)."""
    process = load_part("process")
    program = ("import time\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n"
               "    print('interrupted', flush=True)\n")
    log = str(tmp_path / "command.log")
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        done = process.run_bounded([sys.executable, "-c", program], dict(os.environ),
                                   str(tmp_path), 4, log)
    finally:
        signal.signal(signal.SIGINT, before)
    assert done.timed_out and done.returncode == 0
    assert "interrupted" in done.tail()


def test_the_sample_spreads_over_each_file_and_keeps_short_files_whole():
    sample = load_part("sample")
    assert sample.spread(3, 10) == [0, 4, 9] and sample.spread(3, 2) == [0, 1]
    assert sample.spread(1, 5) == [0] and sample.spread(3, 3) == [0, 1, 2]


def test_the_launcher_probe_reads_ranks_whose_lines_mpiexec_joined():
    """MPICH's gforker forwarded one rank's line and the other's before either newline (the
    dry run in CI): both ranks still count; a world of one each, or a wrong sum, does not."""
    probe = load_part("probe_mpi")
    joined = "I am process 0 of 2: sum 1I am process 1 of 2: sum 1\n\n"
    assert probe.saw_each_other(0, joined)
    assert probe.saw_each_other(0, "I am process 1 of 2: sum 1\nI am process 0 of 2: sum 1\n")
    assert not probe.saw_each_other(0, "I am process 0 of 1: sum 0\nI am process 0 of 1: sum 0\n")
    assert not probe.saw_each_other(0, "I am process 0 of 2: sum 2\nI am process 1 of 2: sum 2\n")
    assert not probe.saw_each_other(1, joined)

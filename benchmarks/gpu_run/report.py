"""The GPU check's results: ``gpu_check.json`` (the record to commit under
``benchmarks/results/gpu/``) and ``summary.md`` (what a person reads, printed at the end)."""
import json
import os
import re

# The versions the summary names, in its order, with their labels.
SHOWN_VERSIONS = (("driver", "driver"), ("cuda_runtime", "CUDA runtime"), ("cupy", "CuPy"),
                  ("nccl", "NCCL"), ("cudnn", "cuDNN"), ("cudnn_frontend", "cuDNN frontend"),
                  ("cublaslt", "cuBLASLt"), ("nvmath", "nvmath-python"), ("torch", "PyTorch"), ("mpi_library", "MPI"), ("python", "Python"),
                  ("numpy", "NumPy"), ("fleetmpi", "fleetmpi from"))
TEST_STAGES = ("gpu_tests", "multi_rank")
SHOWN_FAILURES = 15


def results_name(date, device, dry_run):
    """The file name to commit the JSON as: ``2026-11-27-h100.json``."""
    if dry_run:
        short = "cpu-dry-run"
    else:
        model = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", device)
        short = (model.group(1) if model else device).lower()
    return f"{date[:10]}-{re.sub(r'[^a-z0-9]+', '-', short.lower()).strip('-')}.json"


def check_record(meta, versions, stages):
    """The JSON object: ``meta`` (device, date, commit, mode, budget), ``versions``, the test
    counts over the test stages, every stage's record and the throughput rows."""
    totals = {key: sum(s.get(key) or 0 for s in stages if s["name"] in TEST_STAGES)
              for key in ("passed", "failed", "skipped")}
    rows = [row for s in stages for row in s.get("rows", [])]
    return dict(meta, versions=versions, tests=totals, stages=stages, throughput=rows,
                results_name=results_name(meta["date"], meta["device"], meta["dry_run"]))


def _cell(text, chars=160):
    """``text`` on one line, cut at ``chars`` characters, for a table cell."""
    return " ".join(str(text).split())[:chars]


def _rate_cell(value):
    if value is None:
        return "-"
    return f"{value:,.2f}" if abs(value) < 10 else f"{value:,.0f}"


def _install_lines(stages):
    """What the install stage put in place and what it left out."""
    lines = []
    for s in stages:
        if s["name"] == "install":
            lines.append(f"| installed | {', '.join(s.get('installed', [])) or '-'} |")
            lines += [f"| not installed | {w['wheel']}: {w['why']} |"
                      for w in s.get("not_installed", [])]
    return lines


def _launcher_line(choice):
    """The MPI launcher the stages used, or that none started."""
    chosen = [t for t in choice["tries"] if t["ok"]]
    said = "none started 2 ranks that see each other"
    if chosen:
        variables = " ".join(f"{k}={v}" for k, v in chosen[0]["variables"].items())
        said = f"{chosen[0]['name']}: {chosen[0]['library']}, {variables} {chosen[0]['command']}"
    return f"| MPI launcher | {_cell(said, 300)} |"


def _stage_lines(stages):
    lines = ["| stage | status | passed | failed | skipped | seconds (limit) |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for s in stages:
        counts = [str(s[key]) if s.get(key) is not None else "-"
                  for key in ("passed", "failed", "skipped")]
        lines.append(f"| {s['name']} | {s['status']} | {' | '.join(counts)} | "
                     f"{s.get('seconds', 0):.0f} ({s.get('timeout_s', '-')}) |")
    return lines


def _problem_lines(stages):
    """Each stage's reason, missing files and failures with their first lines."""
    lines = []
    for s in stages:
        said = []
        if s.get("reason"):
            said += [f"- {s['reason']}"] + [f"      {line}" for line in s.get("tail", [])]
        if s.get("missing"):
            said.append("- missing test files (not run): " + ", ".join(s["missing"]))
        if s.get("not_run"):
            said.append("- test files the stage's time did not reach: "
                        + ", ".join(s["not_run"]))
        for failure in s.get("failures", [])[:SHOWN_FAILURES]:
            said += [f"- FAILED {failure['test']}"] + [f"      {line}"
                                                       for line in failure["lines"]]
        hidden = len(s.get("failures", [])) - SHOWN_FAILURES
        if hidden > 0:
            said.append(f"- ... {hidden} more failures in gpu_check.json")
        if said:
            lines += ["", f"### {s['name']}", ""] + said
    return ["", "## Problems"] + lines if lines else []


def _share_cell(value):
    return f"{100 * value:.1f}%" if value is not None else "-"


def _mib_cell(value):
    return f"{value / 2 ** 20:,.0f}" if value is not None else "-"


def _per_step_lines(rows):
    """MFU, peak memory, kernels and host time of each row (``train_throughput.py``)."""
    lines = ["", "| model | precision | MFU fleetmpi | MFU PyTorch | peak MiB fleetmpi | "
             "peak MiB PyTorch | kernels/step | host ms/step fleetmpi |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        host = row.get("host_ms_per_step")
        kernels = row.get("kernels_per_step")
        lines.append(f"| {row['model']} | {row['precision']} | "
                     f"{_share_cell(row.get('mfu_fleetmpi'))} | "
                     f"{_share_cell(row.get('mfu_pytorch'))} | "
                     f"{_mib_cell(row.get('peak_bytes_fleetmpi'))} | "
                     f"{_mib_cell(row.get('peak_bytes_pytorch'))} | "
                     f"{kernels if kernels is not None else '-'} | "
                     f"{f'{host:,.1f}' if host is not None else '-'} |")
    return lines


def _reason_lines(rows):
    """Why each missing figure is missing."""
    said = [f"- {row['model']} {row['precision']}, {what}: {_cell(row[key], 300)}"
            for row in rows
            for key, what in (("fleetmpi_reason", "fleetmpi"), ("pytorch_reason", "PyTorch"),
                              ("kernels_reason", "kernels"))
            if row.get(key)]
    return ["", "Not measured:", ""] + said if said else []


def _throughput_lines(rows, versions):
    lines = ["", "## Throughput (benchmarks/train_throughput.py, 1 rank)", "",
             "| model | batch | precision | graphs | fleetmpi | PyTorch | ratio | unit |",
             "| --- | ---: | --- | --- | ---: | ---: | ---: | --- |"]
    for row in rows:
        ratio = f"{row['ratio']:.2f}x" if row.get("ratio") else "-"
        lines.append(f"| {row['model']} | {row['batch']} | {row['precision']} | "
                     f"{'yes' if row['graphs'] else 'no'} | {_rate_cell(row['fleetmpi'])} | "
                     f"{_rate_cell(row['pytorch'])} | {ratio} | {row['unit']} |")
    lines += _per_step_lines(rows) if rows else []
    lines += _reason_lines(rows)
    if rows and all(row["pytorch"] is None for row in rows):
        lines += ["", f"PyTorch: {versions.get('torch')}, so its column is empty."]
    return lines


def _nonfinite_cost_lines(stages):
    """The default non-finite check's cost per model (``nonfinite_cost.py``)."""
    costs = [cost for s in stages if s["name"] == "nonfinite_cost" for cost in s["costs"]]
    lines = ["", "## The non-finite check's cost (benchmarks/nonfinite_cost.py, 1 rank)", "",
             "| model | steps | median step without | with | cost | the check alone |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {c['model']} | {c['steps']} | {c['median_step_s_without'] * 1e3:.3f} ms | "
              f"{c['median_step_s_with'] * 1e3:.3f} ms | {c['cost_percent']:+.2f}% | "
              f"{c['median_read_s'] * 1e3:.3f} ms |" for c in costs]
    return lines


def summary_markdown(result):
    """``summary.md`` of a ``check_record``."""
    mode = ("dry run on the CPU (FLEETMPI_DEVICE=cpu)" if result["dry_run"]
            else "FLEETMPI_DEVICE=gpu")
    versions = result["versions"]
    changed = " (with uncommitted changes)" if result["uncommitted_changes"] else ""
    lines = [f"# GPU check: {result['device']}", "",
             f"{result['date']}, commit {result['commit']}{changed}, {mode}, "
             f"{result['seconds']:.0f} s of a {result['budget_s']:.0f} s budget", "",
             "| | version |", "| --- | --- |"]
    lines += [f"| {label} | {_cell(versions.get(key, '-'))} |" for key, label in SHOWN_VERSIONS]
    lines += _install_lines(result["stages"]) + [_launcher_line(result["mpi"])]
    tests = result["tests"]
    sampled = [s["sample_per_file"] for s in result["stages"] if s.get("sample_per_file")]
    lines += ["", f"Tests: {tests['passed']} passed, {tests['failed']} failed, "
                  f"{tests['skipped']} skipped" + (f" (a sample of {sampled[0]} of each file "
                                                   "of the gpu_tests stage)" if sampled else "")
              + ".", ""]
    lines += _stage_lines(result["stages"])
    lines += _problem_lines(result["stages"])
    if any(s["name"] == "throughput" for s in result["stages"]):
        lines += _throughput_lines(result["throughput"], versions)
    if any(s["name"] == "nonfinite_cost" for s in result["stages"]):
        lines += _nonfinite_cost_lines(result["stages"])
    if not result["dry_run"]:
        lines += ["", f"Commit gpu_check.json as benchmarks/results/gpu/"
                      f"{result['results_name']}"]
    return "\n".join(lines) + "\n"


def write(out, result):
    """Write ``gpu_check.json`` and ``summary.md`` into ``out``; returns the summary."""
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = summary_markdown(result)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    return text

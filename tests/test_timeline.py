"""The timeline: every rank's forward, backward, update and gradient buckets' communication
in one Chrome-trace JSON file on one time axis; nothing recorded while it is off; the part files
of a job that died merge into a valid file."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.core import knobs, timeline
from fleetmpi.launch.mpi_command import local_command

from comm_support import ok
from strategy_support import make_strategy, train
from job_limits import HANG_SECONDS

STEPS = 3
HERE = os.path.dirname(os.path.abspath(__file__))
REQUIRED = {"X": {"name", "cat", "ph", "pid", "tid", "ts", "dur", "args"},
            "M": {"name", "ph", "pid", "args"}}


def structure_problems(trace, size):
    """What is wrong with ``trace`` as a Chrome trace of ``size`` ranks (empty: nothing)."""
    problems = []
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["no traceEvents list"]
    last_start = {}
    for i, event in enumerate(trace["traceEvents"]):
        phase = event.get("ph")
        if phase not in REQUIRED:
            problems.append(f"event {i} has phase {phase!r}")
            continue
        missing = REQUIRED[phase] - set(event)
        if missing:
            problems.append(f"event {i} lacks {sorted(missing)}")
            continue
        if not 0 <= event["pid"] < size:
            problems.append(f"event {i} has pid {event['pid']}")
        if phase == "X":
            if event["dur"] < 0:
                problems.append(f"event {i} has duration {event['dur']}")
            lane = (event["pid"], event["tid"])
            if event["ts"] < last_start.get(lane, -np.inf):
                problems.append(f"event {i} starts before the one before it in lane {lane}")
            last_start[lane] = event["ts"]
    return problems


def complete_events(trace, rank, name=None):
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == rank
            and (name is None or e["name"] == name)]


def shared_trace(path):
    """Rank 0's file, parsed on every rank (its bytes broadcast)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    raw = open(path, "rb").read() if world.Get_rank() == 0 else b""
    size = np.array([len(raw)], dtype=np.int64)
    world.Bcast(size, root=0)
    data = np.frombuffer(raw, dtype=np.uint8).copy() if raw else np.empty(size[0], np.uint8)
    world.Bcast(data, root=0)
    return json.loads(data.tobytes().decode())


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("overlap", ["0", "1"], ids=["blocking", "overlapped"])
def test_every_rank_step_and_bucket_on_one_time_axis(tmp_path, overlap, monkeypatch):
    """``overlapped``: the buckets' events come from the communicator's thread."""
    from mpi4py import MPI

    monkeypatch.setenv(knobs.OVERLAP_ALLREDUCE.name, overlap)
    fleet.init()
    size, rank = fleet.worker_num(), fleet.worker_index()
    path = str(tmp_path / "timeline.json")
    timeline.start(path)
    try:
        _, opt, _ = train(make_strategy(fuse_grad_size_in_TFLOPS=1), steps=STEPS)
        written = timeline.flush()
    finally:
        timeline.stop()
    ok(written == path, f"flush returned {written!r}")
    ok(not os.path.exists(timeline.part_path(path, rank)), "the part file was left behind")
    trace = shared_trace(path)
    problems = structure_problems(trace, size)
    ok(not problems, "; ".join(problems[:5]))

    nodes = MPI.COMM_WORLD.allgather(fleet.node_index())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["name"] == "process_name"}
    ok(names == {r: f"rank {r} (node {nodes[r]})" for r in range(size)}, str(names))

    buckets = opt.strategies["gradient_allreduce"].buckets
    ok(len(buckets) == 3, f"{len(buckets)} buckets; the test wants one per layer")
    expected = [(s, b.index, (b.stop - b.start) * 8, opt.communicator.allreduce_algorithm(
        (b.stop - b.start) * 8)) for s in range(STEPS) for b in buckets]
    for r in range(size):
        for stage in ("forward", "backward", "update"):
            steps = [e["args"]["step"] for e in complete_events(trace, r, stage)]
            ok(steps == list(range(STEPS)), f"rank {r} {stage} events of steps {steps}")
        updates = complete_events(trace, r, "update")
        bucket_events = [e for e in complete_events(trace, r) if e["name"].startswith("bucket ")]
        found = []
        for event in bucket_events:
            step = sum(u["ts"] <= event["ts"] for u in updates)
            found.append((step, event["args"]["bucket"], event["args"]["bytes"],
                          event["args"]["algorithm"]))
        ok(sorted(found) == sorted(expected), f"rank {r} buckets {found}, expected {expected}")
        for event in bucket_events:
            inner = [e for e in complete_events(trace, r, "allreduce_many")
                     if event["ts"] <= e["ts"] and e["ts"] + e["dur"] <= event["ts"] + event["dur"]]
            ok(len(inner) == 1 and inner[0]["args"]["bytes"] == event["args"]["bytes"]
               and inner[0]["cat"] == "comm", f"rank {r} {event} holds {inner}")

    # An allreduce ends on no rank before it has started on every rank, so on one time axis
    # the intervals of a bucket's reduction overlap across the ranks.
    for s, index, _, _ in expected:
        spans = []
        for r in range(size):
            updates = complete_events(trace, r, "update")
            spans += [(e["ts"], e["ts"] + e["dur"]) for e in complete_events(trace, r)
                      if e["name"] == f"bucket {index}"
                      and sum(u["ts"] <= e["ts"] for u in updates) == s]
        ok(len(spans) == size and max(a for a, _ in spans) <= min(b for _, b in spans) + 1e-3,
           f"step {s} bucket {index} intervals {spans} do not overlap")


@pytest.mark.mpi(min_size=2)
def test_clock_offset_within_half_the_round_trip():
    from mpi4py import MPI

    # Every rank here shares one clock, so the true offset is 0 and the measured one may be off
    # by at most half the round trip it was measured from.
    offset, round_trip = timeline.clock_offset(MPI.COMM_WORLD, same_host=False)
    if MPI.COMM_WORLD.Get_rank() == 0:
        ok((offset, round_trip) == (0, 0), str((offset, round_trip)))
    else:
        ok(round_trip > 0 and abs(offset) <= round_trip // 2 + 1, str((offset, round_trip)))


def test_span_is_a_no_op_while_off():
    timeline.stop()
    assert not timeline.active()
    assert timeline.span("forward", step=1) is timeline.NO_SPAN
    with timeline.span("allreduce", "comm") as event:
        assert not event


def test_start_refuses_a_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        timeline.start(str(tmp_path / "missing" / "t.json"))
    assert not timeline.active()


SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {here!r})
    import fleetmpi as fleet
    from fleetmpi import timeline
    from strategy_support import make_strategy, train
    if os.environ.get("SPILL_EVERY_EVENT"):
        timeline.SPILL_SECONDS = 0
    train(make_strategy(fuse_grad_size_in_TFLOPS=1), steps={steps})
    print("active " + str(timeline.active()), flush=True)
    if os.environ.get("DIE"):
        os._exit(3)
""")


def run_job(tmp_path, n, env):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.format(here=HERE, steps=STEPS))
    environ = {k: v for k, v in os.environ.items() if k != knobs.TIMELINE.name}
    environ.update(env, FLEETMPI_DEVICE="cpu")
    return subprocess.run(local_command(n, [sys.executable, str(script)]), cwd=tmp_path,
                          env=environ, capture_output=True, text=True, timeout=HANG_SECONDS)


def test_job_with_the_variable_writes_one_file_at_exit(tmp_path):
    path = tmp_path / "out" / "t.json"
    path.parent.mkdir()
    done = run_job(tmp_path, 2, {knobs.TIMELINE.name: str(path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("active True") == 2
    assert sorted(os.listdir(path.parent)) == ["t.json"]
    trace = json.loads(path.read_text())
    assert not structure_problems(trace, 2)
    for r in range(2):
        assert [e["args"]["step"] for e in complete_events(trace, r, "backward")] == \
            list(range(STEPS))
        assert len([e for e in complete_events(trace, r) if e["name"].startswith("bucket ")]) \
            == 3 * STEPS


def test_job_without_the_variable_records_nothing(tmp_path):
    done = run_job(tmp_path, 2, {})
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("active False") == 2
    assert sorted(os.listdir(tmp_path)) == ["job.py"]


def test_part_files_of_a_job_that_died_merge(tmp_path):
    path = tmp_path / "t.json"
    done = run_job(tmp_path, 2, {knobs.TIMELINE.name: str(path), "SPILL_EVERY_EVENT": "1",
                                 "DIE": "1"})
    assert done.returncode != 0
    assert not path.exists()
    parts = sorted(os.listdir(tmp_path))
    assert parts == ["job.py", "t.json.rank0.part", "t.json.rank1.part"]
    assert timeline.merge(str(path)) == str(path)
    trace = json.loads(path.read_text())
    assert not structure_problems(trace, 2)
    for r in range(2):
        assert [e["args"]["step"] for e in complete_events(trace, r, "update")] == \
            list(range(STEPS))


def write_part(path, rank, host, wall_ns, mono_ns, records):
    with open(timeline.part_path(path, rank), "w") as f:
        f.write(json.dumps({"rank": rank, "node": None, "host": host, "wall_ns": wall_ns,
                            "mono_ns": mono_ns}) + "\n")
        f.write(json.dumps(records) + "\n")
        f.write('[["cut short by a crash",0,')


def test_merge_aligns_other_machines_by_wall_clock(tmp_path):
    path = str(tmp_path / "t.json")
    wall = 1_700_000_000_000_000_000
    write_part(path, 0, "a", wall, 10_000_000, [["forward", 0, 10_001_000, 2_000, {}]])
    # rank 1 shares rank 0's machine, so its clock is rank 0's, whatever its wall clock says
    write_part(path, 1, "a", wall + 777, 10_000_000, [["forward", 0, 10_002_000, 1_000, {}]])
    # rank 2's machine: its monotonic clock reads 5 s more than rank 0's at the same wall time
    write_part(path, 2, "b", wall, 5_010_000_000,
               [["forward", 0, 5_010_003_000, 500, {}], ["allreduce", 1, 5_010_004_000, 0, {}]])
    trace = json.loads(open(timeline.merge(path)).read())
    assert not structure_problems(trace, 3)
    events = sorted((e["pid"], e["tid"], e["ts"], e["dur"]) for e in trace["traceEvents"]
                    if e["ph"] == "X")
    assert events == [(0, 0, 1.0, 2.0), (1, 0, 2.0, 1.0), (2, 0, 3.0, 0.5), (2, 1, 4.0, 0.0)]
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["name"] == "process_name"}
    assert names == {0: "rank 0 (node 0)", 1: "rank 1 (node 0)", 2: "rank 2 (node 1)"}


def _merge_command(path):
    return subprocess.run([sys.executable, "-m", "fleetmpi.core.timeline", "merge", str(path)],
                          capture_output=True, text=True, timeout=HANG_SECONDS)


def test_merge_of_a_finished_or_damaged_timeline_says_why_in_one_line(tmp_path):
    finished = tmp_path / "trace.json"
    finished.write_text("[]")
    done = _merge_command(finished)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"python -m fleetmpi.core.timeline merge: no part files {finished}.rank*.part to merge "
        "(the job finished: its timeline was written whole, with nothing left to merge)")
    damaged = tmp_path / "other.json.rank0.part"
    damaged.write_text("not a header\n")
    done = _merge_command(tmp_path / "other.json")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"{damaged} is not a timeline part file" in done.stderr

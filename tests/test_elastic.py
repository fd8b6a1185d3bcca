"""Elastic restart (``fleetmpirun --elastic``, ``fleetmpi.training.elastic.State``) and the removal
of the shared-memory segments an aborted job leaves.

The jobs run ``tests/elastic_job.py`` under ``fleetmpirun``; each is bounded by
``HANG_SECONDS``, so a regression fails instead of hanging.
"""
import mmap
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from fleetmpi.training import elastic
from fleetmpi.core import knobs
from fleetmpi import nn
from fleetmpi.launch import fleetmpirun, restart, shm, slurm

from job_limits import HANG_SECONDS

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "elastic_job.py")
STEPS, COMMIT_EVERY, DIE_RANK, DIE_STEP = 10, 2, 2, 5


def launcher():
    return [os.path.join(os.path.dirname(sys.executable), "fleetmpirun")]


def run(argv, cwd=HERE):
    env = dict(os.environ, FLEETMPI_DEVICE="cpu")
    return subprocess.run(launcher() + argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=HANG_SECONDS)


def outputs(prefix, size):
    """Every rank's ``OUT.<rank>.npz`` of a job of ``size`` ranks, as dicts."""
    found = []
    for rank in range(size):
        with np.load(f"{prefix}.{rank}.npz") as stored:
            found.append({key: stored[key] for key in stored.files})
    return found


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The parameters of every rank of an uninterrupted 3-rank run."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    result = run(["--np", "3", JOB, str(folder / "ckpt"), str(folder / "out"), str(STEPS),
                  str(COMMIT_EVERY)])
    assert result.returncode == 0, result.stderr[-3000:]
    return outputs(folder / "out", 3)


def worker_logs(folder):
    """The end of every rank's log under ``folder``, for a failure's message."""
    return "".join(f"\n--- {name}:\n{(folder / name).read_text()[-2000:]}"
                   for name in sorted(os.listdir(folder))) if folder.is_dir() else ""


def parameters(output):
    return {key: value for key, value in output.items() if key not in ("size", "attempt")}


def test_a_run_that_lost_a_rank_resumes_at_two_and_ends_as_an_uninterrupted_one(
        tmp_path, uninterrupted):
    np_file = tmp_path / "np"
    np_file.write_text("2\n")  # the lost rank's slot is gone after the failure
    result = run(["--elastic", "--np", "3", "--min_np", "2", "--max_restarts", "2",
                  "--np_file", str(np_file), JOB, str(tmp_path / "ckpt"),
                  str(tmp_path / "out"), str(STEPS), str(COMMIT_EVERY), str(DIE_RANK),
                  str(DIE_STEP)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(rf"^FAULT \S+ rank {DIE_RANK} before step {DIE_STEP}$", result.stdout,
                     re.MULTILINE), result.stdout[-2000:]
    assert re.search(r"^RESUMED \S+ at step 4 on 2 rank\(s\)$", result.stdout, re.MULTILINE)
    restart_line = re.search(r"fleetmpirun: elastic: attempt 0 with 3 rank\(s\) failed: (.*); "
                             r"restart 1 of at most 2 with 2 rank\(s\)", result.stderr)
    assert restart_line, result.stderr[-3000:]
    assert "exit status 9" in restart_line.group(1)
    assert "ended first: rank" in restart_line.group(1)
    # Rank 0 records step 5 as reached once its update of step 4 is done; the launcher may
    # end it first, the moment rank 2 dies after the same step: then step 4 was reached.
    lost = re.search(r"(\d+) step\(s\) lost \(reached (\d+), last commit 4\)",
                     restart_line.group(1))
    assert lost and lost.group(2) in ("4", "5"), restart_line.group(1)
    assert int(lost.group(1)) == int(lost.group(2)) - 4, restart_line.group(1)
    assert "fleetmpirun: elastic: 1 restart(s); the last attempt ran 2 rank(s) and ended " \
           "with status 0" in result.stderr
    assert f"fleetmpirun: elastic: {lost.group(1)} step(s) lost in all" in result.stderr
    resumed = outputs(tmp_path / "out", 2)
    assert not os.path.exists(f"{tmp_path / 'out'}.2.npz")
    reference = parameters(uninterrupted[0])
    for rank, output in enumerate(resumed):
        assert int(output["size"]) == 2 and int(output["attempt"]) == 1, rank
        for name, value in parameters(output).items():
            np.testing.assert_allclose(value, reference[name], rtol=1e-12, atol=1e-12,
                                       err_msg=f"{name} on rank {rank}")
    for rank, output in enumerate(uninterrupted):
        for name, value in parameters(output).items():
            np.testing.assert_array_equal(value, reference[name], err_msg=f"rank {rank}")


def test_exhausted_restarts_end_the_job_non_zero_with_the_cause(tmp_path):
    logs = tmp_path / "log"
    result = run(["--elastic", "--np", "2", "--max_restarts", "1", "--log_dir", str(logs), JOB,
                  str(tmp_path / "ckpt"), str(tmp_path / "out"), str(STEPS), str(COMMIT_EVERY),
                  "1", "3", "99"])
    assert result.returncode == 9, result.stderr[-3000:] + worker_logs(logs)
    assert sorted(os.listdir(logs)) == ["workerlog.0", "workerlog.1"]  # no records left behind
    assert "FAULT" in (logs / "workerlog.1").read_text()
    assert "restart 1 of at most 1 with 2 rank(s)" in result.stderr
    assert re.search(r"gave up: attempt 1 with 2 rank\(s\) failed: exit status 9.*no restart "
                     r"left \(--max_restarts 1\)", result.stderr), result.stderr[-3000:]
    # each attempt committed step 2 and died before step 3: step 3 reached, one step lost,
    # unless the launcher ended rank 0 before it recorded step 3
    lost = dict((attempt, (int(n), reached)) for attempt, n, reached in re.findall(
        r"attempt (\d+) with 2 rank\(s\) failed: [^\n]*?(\d+) step\(s\) lost "
        r"\(reached (\d+), last commit 2\)", result.stderr))
    assert sorted(lost) == ["0", "1"] and all(n == int(reached) - 2 and reached in ("2", "3")
                                              for n, reached in lost.values()), result.stderr
    assert (f"fleetmpirun: elastic: {sum(n for n, _ in lost.values())} step(s) lost in all"
            in result.stderr)


def test_a_restart_below_min_np_is_not_made_and_named(tmp_path):
    np_file = tmp_path / "np"
    np_file.write_text("2")
    result = run(["--elastic", "--np", "3", "--min_np", "3", "--np_file", str(np_file), JOB,
                  str(tmp_path / "ckpt"), str(tmp_path / "out"), str(STEPS),
                  str(COMMIT_EVERY), "2", "3"])
    assert result.returncode == 9, result.stderr[-3000:]
    assert "cannot restart: only 2 rank(s) are available, below --min_np 3" in result.stderr
    assert "restart 1" not in result.stderr


def test_a_success_needs_no_restart(tmp_path):
    result = run(["--elastic", "--np", "2", JOB, str(tmp_path / "ckpt"), str(tmp_path / "out"),
                  "4", "2"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fleetmpirun: elastic: 0 restart(s); the last attempt ran 2 rank(s) and ended " \
           "with status 0" in result.stderr
    assert "failed" not in result.stderr
    for rank, output in enumerate(outputs(tmp_path / "out", 2)):
        assert int(output["size"]) == 2 and int(output["attempt"]) == 0, rank


def segments_of(stdout):
    line = re.search(r"^SEGMENTS(.*)$", stdout, re.MULTILINE)
    assert line, stdout[-2000:]
    return line.group(1).split()


def test_an_aborted_job_leaves_no_shared_memory_segment(tmp_path):
    """Under plain mpiexec, a job whose rank is killed leaves its MPICH segment in /dev/shm;
    under fleetmpirun nothing of it is left."""
    if not os.path.isdir(shm.SHM_DIR):
        pytest.skip(f"no {shm.SHM_DIR} on this system")
    job = [JOB, str(tmp_path / "ckpt"), str(tmp_path / "out"), str(STEPS), str(COMMIT_EVERY),
           "1", "3"]
    mpiexec = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", "2",
               sys.executable]
    plain = subprocess.run(mpiexec + job, cwd=HERE, capture_output=True, text=True,
                           timeout=HANG_SECONDS, env=dict(os.environ, FLEETMPI_DEVICE="cpu"))
    assert plain.returncode != 0
    left = segments_of(plain.stdout)
    assert left and all(os.path.exists(os.path.join(shm.SHM_DIR, name)) for name in left)
    for name in left:
        os.unlink(os.path.join(shm.SHM_DIR, name))
    result = run(["--np", "2"] + job)
    assert result.returncode == 9, result.stderr[-3000:]
    mapped = segments_of(result.stdout)
    assert mapped and not any(os.path.exists(os.path.join(shm.SHM_DIR, name))
                              for name in mapped), mapped
    assert f"removed what the job left in {shm.SHM_DIR}: {', '.join(mapped)}" in result.stderr


# --- units ------------------------------------------------------------------------------------

def test_only_this_jobs_mpich_segments_of_this_user_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    for name in ("mpich_shm_ab12_0", "mpich_shm_cd34_0", "mpich_shm_ef56_0", "other_0"):
        (tmp_path / name).write_bytes(b"x")
    os.symlink(tmp_path / "other_0", tmp_path / "mpich_shm_0badc0de_0")
    removed = shm.remove_left_segments(
        {"mpich_shm_ab12_0", "mpich_shm_cd34_0", "other_0", "mpich_shm_0badc0de_0",
         "mpich_shm_gone_0"}, before={"mpich_shm_cd34_0"})
    assert removed == ["mpich_shm_ab12_0"]
    assert sorted(os.listdir(tmp_path)) == ["mpich_shm_0badc0de_0", "mpich_shm_cd34_0",
                                            "mpich_shm_ef56_0", "other_0"]


def test_the_segments_a_process_maps_are_read_from_its_maps():
    if not os.path.isdir(shm.SHM_DIR):
        pytest.skip(f"no {shm.SHM_DIR} on this system")
    name = f"mpich_shm_{os.urandom(4).hex()}_0"
    path = os.path.join(shm.SHM_DIR, name)
    with open(path, "w+b") as f:
        f.truncate(4096)
        mapped = mmap.mmap(f.fileno(), 4096)
    try:
        assert name in shm.mapped_segments(os.getpid())
        os.unlink(path)  # still mapped, now "(deleted)": not a file left in /dev/shm
        assert name not in shm.mapped_segments(os.getpid())
    finally:
        mapped.close()
        if os.path.exists(path):
            os.unlink(path)
    assert shm.mapped_segments(2 ** 22 + 7) == set()  # no such process


@pytest.mark.parametrize("text", ["", "two", "0", "-1", "2.5"])
def test_a_bad_np_file_is_named_with_what_it_holds(tmp_path, text):
    path = tmp_path / "np"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"--np_file '{re.escape(str(path))}' holds "
                                         rf"{re.escape(repr(text))}; .*whole number >= 1"):
        restart.read_np_file(str(path))
    with pytest.raises(ValueError, match="cannot be read"):
        restart.read_np_file(str(tmp_path / "missing"))


def fake_attempts(codes, ranks_on_host=None):
    """A ``run_attempt`` whose attempts end with ``codes`` in turn; records its calls."""
    calls = []

    def attempt(restart_count, np, exclude):
        calls.append((restart_count, np, tuple(exclude)))
        return restart.Attempt(restart_count, np, code=codes[len(calls) - 1],
                               progress=(4, 5), excluded=tuple(exclude),
                               ranks_on_host=dict(ranks_on_host or {}))
    return attempt, calls


def test_restarts_keep_the_count_and_stop_at_max_restarts(capsys):
    attempt, calls = fake_attempts([1, 1, 1])
    attempts, reason = restart.run(4, attempt, max_restarts=2, min_np=1)
    assert calls == [(0, 4, ()), (1, 4, ()), (2, 4, ())]
    assert "no restart left (--max_restarts 2)" in reason
    assert capsys.readouterr().err.count("restart ") == 2
    assert "3 step(s) lost in all" in restart.summary(attempts)


def test_under_slurm_failed_nodes_and_their_ranks_are_left_out(capsys):
    attempt, calls = fake_attempts([9, 0], ranks_on_host={"n1": 2, "n2": 2})
    attempts, reason = restart.run(4, attempt, max_restarts=3, min_np=2,
                                   failed_nodes=lambda: ["n2"])
    assert reason is None and calls == [(0, 4, ()), (1, 2, ("n2",))]
    assert "with 2 rank(s), leaving out node(s) n2" in capsys.readouterr().err


def test_an_interrupted_attempt_is_not_restarted():
    def attempt(restart_count, np, exclude):
        return restart.Attempt(restart_count, np, code=130, interrupted=True)
    attempts, reason = restart.run(2, attempt, max_restarts=3, min_np=1)
    assert len(attempts) == 1 and reason is None


def test_srun_leaves_out_the_excluded_nodes():
    args = fleetmpirun.parser().parse_args(["--slurm", "--gpus", "0,1", "train.py"])
    environ = {"SLURM_JOB_ID": "5", "SLURM_JOB_NUM_NODES": "3"}
    program = fleetmpirun.rank_program(args)
    cmd = slurm.srun_launch_command(args, program, "mpich", environ=environ, srun="/usr/bin/srun",
                               plugins=["pmi2"], exclude=("n3",))
    assert cmd[:len(cmd) - len(program)] == [
        "/usr/bin/srun", "--mpi=pmi2", "--kill-on-bad-exit=1", "--exclude=n3", "-n", "4",
        "--ntasks-per-node", "2"]


def test_sinfo_states_that_cannot_run_a_rank():
    text = "n1 idle\nn2 down*\nn3 alloc*\nn4 drain\nn5 mix\nn6 drng\nn7 alloc\nn7 alloc\n"
    assert slurm.parse_node_states(text) == ["n2", "n3", "n4", "n6"]


@pytest.mark.parametrize("argv, message", [
    (["--np_file", "f", "x.py"], "--np_file only apply with --elastic"),
    (["--max_restarts", "2", "x.py"], "--max_restarts only apply with --elastic"),
    (["--elastic", "--max_restarts", "-1", "x.py"], "--max_restarts must be at least 0, got -1"),
    (["--elastic", "--min_np", "0", "x.py"], "--min_np must be at least 1, got 0"),
    (["--elastic", "--server_num", "1", "--worker_num", "1", "x.py"], "parameter-server mode"),
    (["--elastic", "--gpus", "0,1", "--np_file", "f", "x.py"], "one rank per listed GPU"),
    (["--elastic", "--slurm", "x.py"], "needs --log_dir"),
])
def test_elastic_options_that_cannot_work_are_refused(tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    args = fleetmpirun.parser().parse_args(argv)
    with pytest.raises(ValueError, match=re.escape(message)):
        fleetmpirun.check_inputs(args)


def test_min_np_above_the_first_count_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    with pytest.raises(SystemExit):
        fleetmpirun.main(["--elastic", "--np", "2", "--min_np", "3", "x.py"])
    assert "--min_np 3 is more than the 2 rank(s) the job starts with" in capsys.readouterr().err


def test_state_restores_nothing_then_commits_every_k_steps(tmp_path, monkeypatch):
    progress = tmp_path / "progress"
    monkeypatch.setenv(knobs.ELASTIC_PROGRESS.name, str(progress))
    monkeypatch.setenv(knobs.RESTART_COUNT.name, "2")
    model = nn.Linear(3, 2)
    state = elastic.State(str(tmp_path / "ckpt"), model, commit_every=3)
    assert state.restore() == 0 and state.restart_count == 2
    assert elastic.read_progress(str(progress)) == (0, 0)
    for step in range(1, 6):
        state.commit(step)
    assert elastic.read_progress(str(progress)) == (3, 5)
    saved = {k: v.copy() for k, v in model.state_dict().items()}
    other = nn.Linear(3, 2)
    assert elastic.State(str(tmp_path / "ckpt"), other, commit_every=3).restore() == 3
    for name, value in other.state_dict().items():
        np.testing.assert_array_equal(value, saved[name])


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_state_refuses_a_bad_commit_interval(tmp_path, value):
    with pytest.raises(ValueError, match="commit_every must be a whole number of steps >= 1"):
        elastic.State(str(tmp_path), nn.Linear(2, 2), commit_every=value)


def test_restart_count_is_validated(monkeypatch):
    monkeypatch.setenv(knobs.RESTART_COUNT.name, "x")
    with pytest.raises(ValueError, match="FLEETMPI_RESTART_COUNT='x'"):
        elastic.restart_count()


def test_strategy_elastic_is_reported_as_not_applied_outside_fleetmpirun_elastic(monkeypatch):
    from fleetmpi import DistributedStrategy
    from fleetmpi.strategies import applied

    strategy = DistributedStrategy()
    assert strategy.elastic is False
    strategy.elastic = True
    monkeypatch.delenv(knobs.RESTART_COUNT.name, raising=False)
    assert "not started by fleetmpirun --elastic" in applied.not_applied(strategy, None,
                                                                         False)["elastic"]
    monkeypatch.setenv(knobs.RESTART_COUNT.name, "0")
    assert "elastic" not in applied.not_applied(strategy, None, False)

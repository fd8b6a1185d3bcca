"""Slurm: the srun command of ``fleetmpirun --slurm``, and a real single-node Slurm that runs the
example batch script, ``fleetmpirun --slurm`` inside a batch job, and a job whose rank fails.

The cluster tests need Slurm's daemons (Debian's slurm-wlm, which .ci/run installs) and root;
elsewhere they are skipped with the reason. They check that srun's ranks form one MPI world of
2 (not two worlds of 1, which is what ranks without a PMI server would make).
"""
import os
import re
import shutil
import sys
import tempfile

import pytest

from fleetmpi.launch import fleetmpirun, slurm
from job_limits import HANG_SECONDS
from slurm_cluster import SlurmCluster, unavailable_reason

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRUN = "/usr/bin/srun"
# srun --mpi=list of Slurm 22.05 and of an older Slurm.
LIST_22 = ("MPI plugin types are...\n\tpmix\n\tnone\n\tcray_shasta\n\tpmi2\n"
           "specific pmix plugin versions available: pmix_v4\n")
LIST_OLD = "srun: MPI types are...\nsrun: none\nsrun: pmi2\nsrun: pmix_v3\n"


def command(argv, environ, flavour="mpich", plugins=("none", "pmi2", "pmix")):
    """The srun command of ``fleetmpirun --slurm argv``, as the srun part before the rank
    program and that program (``fleetmpirun.rank_program``, checked in full)."""
    args = fleetmpirun.parser().parse_args(["--slurm"] + argv)
    program = fleetmpirun.rank_program(args)
    cmd = slurm.srun_launch_command(args, program, flavour, environ=environ, srun=SRUN,
                               plugins=list(plugins))
    assert cmd[len(cmd) - len(program):] == program
    return cmd[:len(cmd) - len(program)], program


def allocation(**variables):
    return {"SLURM_JOB_ID": "17", **{name: str(value) for name, value in variables.items()}}


# --- the srun command -------------------------------------------------------------------------

def test_mpich_ranks_use_pmi2_and_the_allocation_tasks():
    cmd, program = command(["train.py", "--epochs", "2"], allocation(SLURM_NTASKS=4))
    assert cmd == [SRUN, "--mpi=pmi2", "--kill-on-bad-exit=1", "-n", "4"]
    assert program[-4:] == ["--", "train.py", "--epochs", "2"]


def test_np_overrides_the_allocation_tasks():
    cmd, _ = command(["--np", "2", "train.py"], allocation(SLURM_NTASKS=4))
    assert cmd[3:] == ["-n", "2"]


def test_without_np_or_tasks_srun_chooses_the_count():
    cmd, _ = command(["train.py"], allocation(SLURM_JOB_NUM_NODES=3))
    assert cmd == [SRUN, "--mpi=pmi2", "--kill-on-bad-exit=1"]


@pytest.mark.parametrize("plugins", [("none", "pmi2", "pmix"), ("none", "pmix_v3")])
def test_open_mpi_ranks_use_pmix(plugins):
    cmd, _ = command(["train.py"], allocation(SLURM_NTASKS=2), flavour="openmpi",
                     plugins=plugins)
    assert cmd == [SRUN, "--mpi=pmix", "--kill-on-bad-exit=1", "-n", "2"]


def test_a_missing_plugin_is_named_with_what_srun_offers():
    with pytest.raises(ValueError, match=r"pmix plugin.*offers only none, pmi2.*--mpi_args"):
        command(["train.py"], allocation(), flavour="openmpi", plugins=("none", "pmi2"))
    with pytest.raises(ValueError, match=r"pmi2 plugin.*offers only none"):
        command(["train.py"], allocation(), plugins=("none",))


def test_an_mpi_plugin_in_mpi_args_replaces_the_chosen_one():
    cmd, _ = command(["--mpi_args=--mpi=pmix_v4 --cpu-bind=cores", "train.py"],
                     allocation(SLURM_NTASKS=2), plugins=())
    assert cmd == [SRUN, "--kill-on-bad-exit=1", "-n", "2", "--mpi=pmix_v4", "--cpu-bind=cores"]


def test_gpus_place_one_rank_per_gpu_on_each_node():
    cmd, program = command(["--gpus", "0,1", "--log_dir", "logs", "train.py"],
                           allocation(SLURM_JOB_NUM_NODES=2, SLURM_NTASKS=8))
    assert cmd == [SRUN, "--mpi=pmi2", "--kill-on-bad-exit=1", "-n", "4",
                   "--ntasks-per-node", "2"]
    assert "0,1" in program and os.path.abspath("logs") in program


def test_parameter_server_roles_set_the_task_count():
    cmd, _ = command(["--server_num", "1", "--worker_num", "2", "train.py"], allocation())
    assert cmd == [SRUN, "--mpi=pmi2", "--kill-on-bad-exit=1", "-n", "3"]


@pytest.mark.parametrize("argv, message", [
    (["--np", "3", "--gpus", "0,1"], r"--np 3 does not match 2 GPU\(s\).*2 node\(s\).*4 ranks"),
    (["--np", "0"], r"--np must be at least 1, got 0"),
    (["--ips", "a,b"], r"--ips and --hostfile are not allowed"),
    (["--server_num", "1"], r"--server_num and --worker_num both at least 1, got 1 and 0"),
])
def test_conflicting_options_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        command(argv + ["train.py"], allocation(SLURM_JOB_NUM_NODES=2))


def test_outside_an_allocation_slurm_is_an_error(monkeypatch, capsys, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(SystemExit) as done:
        fleetmpirun.main(["--slurm", "--dry-run", str(script)])
    assert done.value.code == 2
    assert "SLURM_JOB_ID is not set" in capsys.readouterr().err


def test_dry_run_prints_the_srun_command(monkeypatch, capsys, tmp_path):
    fake_srun = tmp_path / "srun"
    fake_srun.write_text("#!/bin/sh\nprintf 'MPI plugin types are...\\n\\tnone\\n\\tpmi2\\n'\n")
    fake_srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "3")
    script = tmp_path / "train.py"
    script.write_text("")
    assert fleetmpirun.main(["--slurm", "--dry-run", str(script), "--lr", "0.1"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[:5] == [str(fake_srun), "--mpi=pmi2", "--kill-on-bad-exit=1", "-n", "3"]
    assert printed[-4:] == ["--", str(script), "--lr", "0.1"]


def test_srun_missing_or_failing_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="needs Slurm's srun, and there is none on PATH"):
        slurm.find_srun()
    broken = tmp_path / "srun"
    broken.write_text("#!/bin/sh\necho 'srun: fatal: Could not establish a configuration "
                      "source' >&2\nexit 1\n")
    broken.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"--mpi=list failed with exit code 1: .*srun: fatal"):
        slurm.available_plugins(slurm.find_srun())


@pytest.mark.parametrize("text, names", [
    (LIST_22, ["pmix", "none", "cray_shasta", "pmi2"]),
    (LIST_OLD, ["none", "pmi2", "pmix_v3"]),
])
def test_plugin_list_of_srun(text, names):
    assert slurm.parse_plugin_list(text) == names


# --- a real single-node Slurm -------------------------------------------------------------------

PROBE = '''\
"""Each rank prints its place in the MPI world; rank FAIL (argv[1]) raises while the others
wait in a barrier for it."""
import os
import sys

from mpi4py import MPI

import fleetmpi as fleet

fleet.init(is_collective=True)
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
total = world.allreduce(rank + 1)
print(f"probe rank {rank} of {size} sum {total} trainer {os.environ['PADDLE_TRAINER_ID']} "
      f"procid {os.environ['SLURM_PROCID']}", flush=True)
if len(sys.argv) > 1 and rank == int(sys.argv[1]):
    raise RuntimeError(f"probe failure on rank {rank}")
world.Barrier()
'''


@pytest.fixture(scope="module")
def cluster():
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no Slurm cluster can run here: {reason}")
    directory = tempfile.mkdtemp(prefix="fleetmpi-slurm-")
    try:
        running = SlurmCluster(directory)
        try:
            yield running
        finally:
            running.stop()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def job_environment():
    """This environment with this Python's directory first on PATH, so that the job's
    ``python`` and ``fleetmpirun`` are the ones under test."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def run_job(cluster, name, sbatch_args):
    """Submit a job, wait for its end; its ``scontrol show job`` fields and its output."""
    output = cluster.path(f"{name}.out")
    job_id = cluster.submit([f"--output={output}", f"--chdir={REPO}"] + sbatch_args,
                            env=job_environment())
    fields = cluster.wait(job_id, HANG_SECONDS)
    with open(output) as f:
        return fields, f.read()


def test_example_batch_script_trains_one_world_of_two_ranks(cluster):
    fields, output = run_job(cluster, "example", [
        os.path.join(REPO, "examples", "slurm", "train.sbatch"), "--min-accuracy", "0.5"])
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), output
    # Only world rank 0 reports; two worlds of one rank each would report twice, "on 1 rank(s)".
    reports = re.findall(r"test accuracy ([0-9.]+) on \d+ images after [0-9.]+ s "
                         r"on (\d+) rank\(s\)", output)
    assert len(reports) == 1, output
    accuracy, ranks = reports[0]
    assert ranks == "2" and float(accuracy) >= 0.5, output


def write_probe(cluster):
    path = cluster.path("probe.py")
    with open(path, "w") as f:
        f.write(PROBE)
    return path


def test_fleetmpirun_slurm_starts_the_ranks_with_srun(cluster):
    probe = write_probe(cluster)
    log_dir = cluster.path("probe-logs")
    fields, output = run_job(cluster, "fleetmpirun", [
        "--ntasks=2", "--wrap",
        f"{sys.executable} -m fleetmpi.launch --slurm --log_dir {log_dir} {probe}"])
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), output
    for rank in (0, 1):
        with open(os.path.join(log_dir, f"workerlog.{rank}")) as f:
            assert f"probe rank {rank} of 2 sum 3 trainer {rank} procid {rank}" in f.read()
    # rank 0's output is echoed to the job's output, rank 1's is only in its log
    assert "probe rank 0 of 2 sum 3" in output and "probe rank 1" not in output, output


def test_a_failing_rank_fails_the_job_without_hanging(cluster):
    probe = write_probe(cluster)
    fields, output = run_job(cluster, "failing", [
        "--ntasks=2", "--wrap", f"{sys.executable} -m fleetmpi.launch --slurm {probe} 1"])
    assert fields["JobState"] == "FAILED", output
    assert fields["ExitCode"] != "0:0", output
    assert "RuntimeError: probe failure on rank 1" in output, output

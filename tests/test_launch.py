"""fleetmpirun: the mpiexec commands for Open MPI and MPICH (pure functions, argument by
argument), refusals of bad input, the rank wrapper's placement, roles and script running, and a
few real jobs (2, 3 and 4 ranks) with per-rank logs, GPU variables, roles and exit codes."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap

import pytest

from fleetmpi.launch import fleetmpirun, mpi_command, rank_main

from job_limits import HANG_SECONDS, run_to_end

PY = sys.executable
WRAPPER = [PY, os.path.abspath(rank_main.__file__)]


def parse(*argv):
    return fleetmpirun.parser().parse_args(list(argv))


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hello')\n")
    return str(path)


# ---------------------------------------------------------------- commands, argument by argument

def test_mpich_command_with_hosts_ranks_per_host_and_launcher_arguments():
    cmd = mpi_command.mpiexec_command(
        "mpich", "mpiexec", 4, ["python", "x.py"], hosts=["h1", "h2"], ranks_per_host=2,
        extra_args=["-bind-to", "core"], environ={"PATH": "/bin"}, as_root=True)
    assert cmd == ["mpiexec", "-n", "4", "-hosts", "h1,h2", "-ppn", "2", "-genvall",
                   "-bind-to", "core", "python", "x.py"]


def test_open_mpi_command_with_hosts_forwards_the_chosen_variables():
    environ = {"PATH": "/bin", "HOME": "/root", "FLEETMPI_STALL_TIMEOUT": "60",
               "CUDA_HOME": "/cuda", "PADDLE_X": "1", "PYTHONPATH": "/p", "TERM": "xterm"}
    cmd = mpi_command.mpiexec_command(
        "openmpi", "mpirun", 4, ["python", "x.py"], hosts=["h1", "h2"], ranks_per_host=2,
        extra_args=["--bind-to", "core"], environ=environ, as_root=False)
    assert cmd == ["mpirun", "-n", "4", "--oversubscribe", "--host", "h1:2,h2:2",
                   "--map-by", "ppr:2:node", "-x", "CUDA_HOME", "-x", "FLEETMPI_STALL_TIMEOUT",
                   "-x", "PADDLE_X", "-x", "PATH", "-x", "PYTHONPATH", "--bind-to", "core",
                   "python", "x.py"]


def test_open_mpi_as_root_and_without_ranks_per_host():
    cmd = mpi_command.mpiexec_command("openmpi", "mpirun", 2, ["p"], hosts=["a", "b"],
                                    environ={}, as_root=True)
    assert cmd == ["mpirun", "-n", "2", "--oversubscribe", "--allow-run-as-root",
                   "--host", "a,b", "p"]


def test_hostfile_spelling_of_each_launcher():
    mpich = mpi_command.mpiexec_command("mpich", "mpiexec", 8, ["p"], hostfile="hosts",
                                      ranks_per_host=4, environ={}, as_root=False)
    assert mpich == ["mpiexec", "-n", "8", "-f", "hosts", "-ppn", "4", "-genvall", "p"]
    ompi = mpi_command.mpiexec_command("openmpi", "mpirun", 8, ["p"], hostfile="hosts",
                                     ranks_per_host=4, environ={}, as_root=False)
    assert ompi == ["mpirun", "-n", "8", "--oversubscribe", "--hostfile", "hosts",
                    "--map-by", "ppr:4:node", "p"]


def test_job_variables_are_named_on_the_command_line_of_each_launcher():
    job_env = {"FLEETMPI_TIMELINE": "/shared/t.json"}
    mpich = mpi_command.mpiexec_command("mpich", "mpiexec", 2, ["p"], environ={},
                                      as_root=False, job_env=job_env)
    assert mpich == ["mpiexec", "-n", "2", "-genvall", "-genv", "FLEETMPI_TIMELINE",
                     "/shared/t.json", "p"]
    # an older value in the launcher's own environment is not forwarded beside the job's
    ompi = mpi_command.mpiexec_command("openmpi", "mpirun", 2, ["p"], as_root=False,
                                     environ={"FLEETMPI_TIMELINE": "/old.json", "PATH": "/b"},
                                     job_env=job_env)
    assert ompi == ["mpirun", "-n", "2", "--oversubscribe", "-x", "PATH",
                    "-x", "FLEETMPI_TIMELINE=/shared/t.json", "p"]


@pytest.mark.parametrize("kwargs, message", [
    ({"flavour": "lam"}, "'lam' is not supported"),
    ({"hosts": ["a"], "hostfile": "f"}, "not both"),
    ({"np": 0}, "at least 1, got 0"),
])
def test_mpiexec_command_refuses_bad_requests(kwargs, message):
    call = {"flavour": "mpich", "mpiexec": "mpiexec", "np": 2, "program": ["p"]}
    call.update(kwargs)
    with pytest.raises(ValueError, match=message):
        mpi_command.mpiexec_command(**call)


@pytest.mark.parametrize("flavour, expected", [
    ("mpich", ["mpiexec", "-n", "4", "-hosts", "h1,h2", "-ppn", "2", "-genvall"]),
    ("openmpi", ["mpiexec", "-n", "4", "--oversubscribe", "--host", "h1:2,h2:2",
                 "--map-by", "ppr:2:node", "-x", "PATH"]),
])
def test_ips_and_gpus_give_one_rank_per_gpu_on_each_host(script, flavour, expected):
    args = parse("--ips", "h1, h2", "--gpus", "0,1", script, "--lr", "0.1")
    cmd = fleetmpirun.mpiexec_launch_command(args, flavour, "mpiexec", environ={"PATH": "/b"},
                                     as_root=False)
    assert cmd == expected + WRAPPER + ["--gpus", "0,1", "--", script, "--lr", "0.1"]


@pytest.mark.parametrize("flavour, expected", [
    ("mpich", ["-f", "HOSTFILE", "-ppn", "2", "-genvall"]),
    # Open MPI does not read host:N files: the hosts go on the command line
    ("openmpi", ["--oversubscribe", "--host", "h1:2,h2:2,h3:2", "--map-by", "ppr:2:node"]),
])
def test_hostfile_and_gpus_count_the_hosts_of_the_file(tmp_path, script, flavour, expected):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# three machines\nh1:8\n\nh2:8   # the second\nh3\n")
    args = parse("--hostfile", str(hostfile), "--gpus", "0,1", "--log_dir", "logs", script)
    cmd = fleetmpirun.mpiexec_launch_command(args, flavour, "mpiexec", environ={}, as_root=False)
    expected = [str(hostfile) if word == "HOSTFILE" else word for word in expected]
    assert cmd == (["mpiexec", "-n", "6"] + expected + WRAPPER
                   + ["--gpus", "0,1", "--log_dir", os.path.abspath("logs"), "--", script])


@pytest.mark.parametrize("flavour, expected", [
    # MPICH does not read slots= files: the hosts and their counts go on the command line
    ("mpich", ["-hosts", "a:4,b,c:2", "-genvall"]),
    ("openmpi", ["--oversubscribe", "--hostfile", "HOSTFILE"]),
])
def test_hostfile_without_gpus_gives_one_rank_per_slot(tmp_path, script, flavour, expected):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=4 max_slots=8\nb\nc slots=2\n")
    cmd = fleetmpirun.mpiexec_launch_command(parse("--hostfile", str(hostfile), script), flavour,
                                     "mpiexec", environ={}, as_root=False)
    expected = [str(hostfile) if word == "HOSTFILE" else word for word in expected]
    assert cmd == ["mpiexec", "-n", "7"] + expected + WRAPPER + ["--", script]


def test_read_hostfile_reads_either_launchers_format(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a:4\n  # comment only\nnode-b # no count\nnode-c:1\n")
    assert fleetmpirun.read_hostfile(str(hostfile)) == (
        [("node-a", 4), ("node-b", None), ("node-c", 1)], "mpich")
    hostfile.write_text("node-a slots=4\nnode-b\n")
    assert fleetmpirun.read_hostfile(str(hostfile)) == (
        [("node-a", 4), ("node-b", None)], "openmpi")
    hostfile.write_text("node-a\nnode-b\n")
    assert fleetmpirun.read_hostfile(str(hostfile)) == (
        [("node-a", None), ("node-b", None)], None)


@pytest.mark.parametrize("text, message", [
    ("# nothing\n\n", "names no host"),
    ("a:4\nb slots=2\n", "mixes MPICH's host:N and Open MPI's host slots=N"),
    ("a:x\n", "line 1: 'a:x' has slot count 'x'"),
    ("a\nb slots=0\n", "line 2: 'b slots=0' has slot count '0'"),
])
def test_bad_hostfile_is_refused_naming_the_line(tmp_path, script, text, message):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(text)
    with pytest.raises(ValueError, match=message):
        fleetmpirun.rank_layout(parse("--hostfile", str(hostfile), script))


def test_rank_program_passes_roles_logs_and_script_arguments(script):
    args = parse("--server_num", "2", "--worker_num", "3", "--log_dir", "out", "--gpus",
                 " 4, 5", script, "--np", "9", "--", "x")
    assert fleetmpirun.rank_program(args) == WRAPPER + [
        "--gpus", "4,5", "--log_dir", os.path.abspath("out"), "--server_num", "2",
        "--worker_num", "3", "--", script, "--np", "9", "--", "x"]


def test_mpi_args_are_split_like_a_shell_and_may_be_repeated(script):
    args = parse("--np", "2", "--mpi_args", "-bind-to core", "--mpi_args=-verbose",
                 "--mpi_args", "-genv X 'a b'", script)
    cmd = fleetmpirun.mpiexec_launch_command(args, "mpich", "mpiexec", environ={}, as_root=False)
    # -bind-to is hydra's: on one host too, hydra starts the job (with the transport on
    # shared memory); gforker takes none of it
    assert cmd[:14] == ["mpiexec", "-n", "2", "-genvall", "-genv", "FI_PROVIDER", "shm",
                        "-genv", "UCX_TLS", "self,sm", "-bind-to", "core", "-verbose",
                        "-genv"]
    assert cmd[14:16] == ["X", "a b"]
    assert cmd[16:] == WRAPPER + ["--", script]


def test_timeline_is_an_absolute_path_in_the_job_environment(tmp_path, script, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = parse("--np", "2", "--timeline", "trace.json", script)
    assert fleetmpirun.job_environment(args) == {
        "FLEETMPI_TIMELINE": str(tmp_path / "trace.json")}
    cmd = fleetmpirun.mpiexec_launch_command(args, "openmpi", "mpirun", environ={}, as_root=False)
    assert f"FLEETMPI_TIMELINE={tmp_path / 'trace.json'}" in cmd
    assert fleetmpirun.job_environment(parse(script)) == {}


@pytest.mark.parametrize("argv, np, ranks_per_host", [
    ([], 1, None),
    (["--np", "3"], 3, None),
    (["--ips", "a,b,c"], 3, None),
    (["--ips", "a,b", "--np", "5"], 5, None),
    (["--gpus", "0,1,2"], 3, None),
    (["--ips", "a,b", "--gpus", "2,3", "--np", "4"], 4, 2),
    (["--server_num", "1", "--worker_num", "2"], 3, None),
    (["--server_num", "1", "--worker_num", "3", "--gpus", "0,1,2,3"], 4, None),
])
def test_rank_count_and_placement(script, argv, np, ranks_per_host):
    planned_np, _, planned_per_host = fleetmpirun.rank_layout(parse(*argv, script))
    assert (planned_np, planned_per_host) == (np, ranks_per_host)


# ---------------------------------------------------------------- refusals of bad input

@pytest.mark.parametrize("argv, message", [
    (["--np", "0"], "--np must be at least 1, got 0"),
    (["--np", "-2"], "--np must be at least 1, got -2"),
    (["--np", "3", "--gpus", "0,1"],
     "--np 3 does not match 2 GPU\\(s\\) in --gpus on each of 1 host\\(s\\), which make 2"),
    (["--ips", "a,b", "--gpus", "0", "--np", "3"], "1 GPU\\(s\\) in --gpus on each of 2 host"),
    (["--np", "2", "--server_num", "1", "--worker_num", "2"],
     "--np 2 does not match --server_num 1 \\+ --worker_num 2, which make 3"),
    (["--server_num", "1"], "both at least 1, got 1 and 0"),
    (["--worker_num", "2"], "both at least 1, got 0 and 2"),
    (["--gpus", "0,1,2", "--server_num", "1", "--worker_num", "1"],
     "3 GPU\\(s\\) .* does not match --server_num 1 \\+ --worker_num 1, which make 2"),
])
def test_plan_refuses_counts_that_cannot_work(script, argv, message):
    with pytest.raises(ValueError, match=message):
        fleetmpirun.rank_layout(parse(*argv, script))


def test_hostfile_that_is_missing_is_refused(script):
    with pytest.raises(ValueError, match="--hostfile '/no/such/hosts' does not exist"):
        fleetmpirun.rank_layout(parse("--hostfile", "/no/such/hosts", script))


def test_check_inputs_names_the_bad_value(tmp_path, script):
    with pytest.raises(ValueError, match="training script '/no/train.py' does not exist"):
        fleetmpirun.check_inputs(parse("/no/train.py"))
    with pytest.raises(ValueError, match="training script .* does not exist"):
        fleetmpirun.check_inputs(parse(str(tmp_path)))
    with pytest.raises(ValueError, match="--gpus '0,1,0,2,1' lists GPU 0, 1 more than once"):
        fleetmpirun.check_inputs(parse("--gpus", "0,1,0,2,1", script))
    with pytest.raises(ValueError, match="--timeline '/no/dir/t.json' must name a file"):
        fleetmpirun.check_inputs(parse("--timeline", "/no/dir/t.json", script))
    with pytest.raises(ValueError, match="must name a file"):
        fleetmpirun.check_inputs(parse("--timeline", str(tmp_path), script))
    fleetmpirun.check_inputs(parse("--gpus", "0,1", "--timeline", str(tmp_path / "t"), script))


@pytest.mark.parametrize("argv, message", [
    (["/no/such/train.py"], "training script '/no/such/train.py' does not exist"),
    (["--hostfile", "/no/hosts", "SCRIPT"], "--hostfile '/no/hosts' does not exist"),
    (["--np", "0", "SCRIPT"], "--np must be at least 1, got 0"),
    (["--ips", "a", "--hostfile", "h", "SCRIPT"], "not allowed with argument"),
    (["--mpiexec", "/no/mpiexec", "SCRIPT"], "/no/mpiexec"),
])
def test_main_refuses_bad_input_with_usage_error(script, capsys, argv, message):
    argv = [script if word == "SCRIPT" else word for word in argv]
    with pytest.raises(SystemExit) as done:
        fleetmpirun.main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "fleetmpirun: error:" in err
    assert message.replace("\\", "") in err


def _fake_mpiexec(tmp_path, version_text):
    path = tmp_path / "mpiexec"
    path.write_text(f"#!/bin/sh\necho {shlex.quote(version_text)}\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("version_text, flavour", [
    ("mpirun (Open MPI) 5.0.3", "openmpi"),
    ("HYDRA build details:\n    Version: 4.2.0", "mpich"),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10", "mpich"),
])
def test_dry_run_prints_the_command_of_the_detected_launcher(tmp_path, script, capsys,
                                                             version_text, flavour):
    mpiexec = _fake_mpiexec(tmp_path, version_text)
    assert mpi_command.detect_flavour(mpiexec) == flavour
    argv = ["--mpiexec", mpiexec, "--dry-run", "--ips", "h1,h2", "--gpus", "0,1", script]
    assert fleetmpirun.main(argv) == 0
    printed = capsys.readouterr().out.strip()
    assert shlex.split(printed) == fleetmpirun.mpiexec_launch_command(parse(*argv), flavour,
                                                                      mpiexec)
    placement = ["-hosts", "h1,h2", "-ppn", "2"] if flavour == "mpich" else ["--host", "h1:2,h2:2"]
    assert printed.startswith(shlex.join([mpiexec, "-n", "4"]))
    assert shlex.join(placement) in printed


def test_an_unknown_mpi_is_refused_naming_what_it_said(tmp_path):
    mpiexec = _fake_mpiexec(tmp_path, "some other launcher 1.0")
    with pytest.raises(RuntimeError, match="neither Open MPI nor MPICH.*some other launcher"):
        mpi_command.detect_flavour(mpiexec)


# ---------------------------------------------------------------- the rank wrapper

@pytest.mark.parametrize("environ, expected", [
    ({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1"}, (3, 4, 1)),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1", "PMIX_RANK": "5"}, (5, 8, 1)),
    ({"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2"}, (6, 8, 2)),
    # mpiexec inside an sbatch script: the batch step's SLURM_* must not mix in
    ({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "3",
      "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}, (3, 4, 3)),
    # srun with PMI-2 sets PMI_RANK without hydra's local rank: srun's three are used
    ({"PMI_RANK": "6", "SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2"},
     (6, 8, 2)),
])
def test_place_takes_one_launchers_variables_together(environ, expected):
    assert rank_main.place(environ) == expected


def test_place_reads_os_environ_where_launchers_set_none_of_their_variables(monkeypatch):
    """os.environ refuses to look up a name of None (a launcher without its size variable)."""
    for name in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                 "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (("SLURM_PROCID", "6"), ("SLURM_NTASKS", "8"), ("SLURM_LOCALID", "2")):
        monkeypatch.setenv(name, value)
    assert rank_main.place(os.environ) == (6, 8, 2)
    assert rank_main.place(os.environ, single_host=True) == (6, 8, 2)


def test_collective_roles_and_one_gpu_per_local_rank():
    env, log = rank_main.role_variables(5, 8, 1, gpus=["4", "6"])
    assert env == {"CUDA_VISIBLE_DEVICES": "6", "FLAGS_selected_gpus": "6",
                   "TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "5",
                   "PADDLE_TRAINERS_NUM": "8", "PADDLE_RANK_IN_NODE": "1"}
    assert log == "workerlog.5"
    with pytest.raises(ValueError, match="local rank 2 has no GPU: --gpus lists 2 \\(4,6\\)"):
        rank_main.role_variables(2, 3, 2, gpus=["4", "6"])


def test_parameter_server_roles():
    worker, worker_log = rank_main.role_variables(1, 5, 1, server_num=2, worker_num=3)
    assert worker == {"PADDLE_TRAINERS_NUM": "3", "PADDLE_PSERVERS_NUM": "2",
                      "TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "1",
                      "PADDLE_RANK_IN_NODE": "1"}
    assert worker_log == "workerlog.1"
    server, server_log = rank_main.role_variables(4, 5, 4, server_num=2, worker_num=3)
    assert server == {"PADDLE_TRAINERS_NUM": "3", "PADDLE_PSERVERS_NUM": "2",
                      "TRAINING_ROLE": "PSERVER", "PADDLE_PSERVER_ID": "1",
                      "PADDLE_RANK_IN_NODE": "4"}
    assert server_log == "serverlog.1"
    with pytest.raises(ValueError, match="the job has 4 ranks but --server_num 2 and "
                                         "--worker_num 3 need 5"):
        rank_main.role_variables(0, 4, 0, server_num=2, worker_num=3)


def test_wrapper_arguments_stop_at_the_double_dash():
    args = rank_main.parse_args(["--gpus", "0,1", "--log_dir", "d", "--", "t.py", "--gpus",
                                 "x", "--"])
    assert (args.gpus, args.log_dir, args.script) == ("0,1", "d", "t.py")
    assert args.script_args == ["--gpus", "x", "--"]
    with pytest.raises(SystemExit, match="usage"):
        rank_main.parse_args(["t.py"])
    with pytest.raises(SystemExit, match="no script"):
        rank_main.parse_args(["--gpus", "0", "--"])


@pytest.mark.parametrize("body, code, stderr", [
    ("pass", 0, ""),
    ("import sys; sys.exit(3)", 3, ""),
    ("import sys; sys.exit()", 0, ""),
    ("import sys; sys.exit('stopped: bad data')", 1, "stopped: bad data\n"),
])
def test_run_script_returns_the_scripts_exit_code(tmp_path, monkeypatch, capsys, body, code,
                                                  stderr):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    path = tmp_path / "s.py"
    path.write_text(body + "\n")
    assert rank_main.run_script(str(path), ["a"]) == code
    assert capsys.readouterr().err == stderr


def test_run_script_sets_argv_and_hands_an_uncaught_exception_to_the_excepthook(
        tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *info: seen.append(info))
    path = tmp_path / "s.py"
    path.write_text("import sys\nARGV = list(sys.argv)\ndef f():\n    raise KeyError(ARGV)\nf()\n")
    assert rank_main.run_script(str(path), ["--x", "1"]) == 1
    (exc_type, value, tb), = seen
    assert exc_type is KeyError and value.args == ([str(path), "--x", "1"],)
    # the traceback starts at the script: no frames of the wrapper or of runpy
    assert tb.tb_frame.f_code.co_filename == str(path)
    assert tb.tb_next.tb_frame.f_code.co_name == "f"


def test_failure_excerpt_is_the_last_traceback_with_the_rank_line():
    text = ("step 1\nTraceback (most recent call last):\n  old\nOldError\nstep 2\n"
            "[fleetmpi] rank 1/2 on node 0 failed:\nTraceback (most recent call last):\n"
            '  File "t.py", line 3\nValueError: bad\n')
    assert fleetmpirun.failure_excerpt(text) == (
        "[fleetmpi] rank 1/2 on node 0 failed:\nTraceback (most recent call last):\n"
        '  File "t.py", line 3\nValueError: bad')
    assert fleetmpirun.failure_excerpt("all good\n") is None
    long = "Traceback (most recent call last):\n" + "".join(f"  line {i}\n" for i in range(100))
    excerpt = fleetmpirun.failure_excerpt(long).splitlines()
    assert len(excerpt) == fleetmpirun.REPORTED_LINES and excerpt[-1] == "  line 99"


def test_failed_rank_logs_are_this_jobs_logs_with_a_traceback_in_rank_order(tmp_path):
    failed = "Traceback (most recent call last):\nValueError: {}\n"
    for name, text in [("workerlog.0", "fine\n"), ("workerlog.10", failed.format(10)),
                       ("workerlog.2", failed.format(2)), ("serverlog.0", failed.format("s")),
                       ("workerlog.3", failed.format("old")), ("notes.txt", failed.format(0))]:
        (tmp_path / name).write_text(text)
    os.utime(tmp_path / "workerlog.3", (1000.0, 1000.0))
    found = fleetmpirun.failed_rank_logs(str(tmp_path), since=2000.0)
    assert [os.path.basename(path) for path, _ in found] == [
        "workerlog.2", "workerlog.10", "serverlog.0"]
    assert found[1][1] == "Traceback (most recent call last):\nValueError: 10"
    assert fleetmpirun.failed_rank_logs(str(tmp_path / "missing"), since=0.0) == []


# ---------------------------------------------------------------- real jobs

JOB_SCRIPT = textwrap.dedent("""\
    import argparse, json, os, sys

    WRAPPER_IMPORTED_FLEETMPI = "fleetmpi" in sys.modules
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=0)
    parser.add_argument("--exit", default="")
    parser.add_argument("--abort", action="store_true")
    args = parser.parse_args()
    rank = int(os.environ.get("PMI_RANK") or os.environ["OMPI_COMM_WORLD_RANK"])
    keys = ("CUDA_VISIBLE_DEVICES", "FLAGS_selected_gpus", "TRAINING_ROLE",
            "PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM", "PADDLE_PSERVER_ID",
            "PADDLE_PSERVERS_NUM", "FLEETMPI_TIMELINE")
    print("ENV " + json.dumps({"rank": rank, "argv": sys.argv[1:],
                               "fleetmpi_imported": WRAPPER_IMPORTED_FLEETMPI,
                               "path0": sys.path[0],
                               **{key: os.environ.get(key) for key in keys}}))
    print(f"stderr of rank {rank}", file=sys.stderr)
    if rank == 0:
        for i in range(args.lines):
            print(f"line {i} of rank 0")
    if args.abort:
        from mpi4py import MPI
        if rank == 0:
            print("LAST WORDS", file=sys.stderr, flush=True)
            MPI.COMM_WORLD.Abort(7)
        MPI.COMM_WORLD.Barrier()
    if args.exit:
        failing, code = map(int, args.exit.split(":"))
        sys.exit(code if rank == failing else 0)
    """)


@pytest.fixture
def job_script(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(JOB_SCRIPT)
    return str(path)


def launch(launcher, argv, cwd):
    """Run a launcher command to its end (the whole process group is killed past
    ``HANG_SECONDS``, so no rank outlives a failed test); ``(code, stdout, stderr)``."""
    environ = {name: value for name, value in os.environ.items()
               if not name.startswith(("PMI_", "OMPI_", "PMIX_", "SLURM_", "FLEETMPI_"))}
    return run_to_end(launcher + argv, cwd=cwd, env=environ)


def console_script():
    path = os.path.join(os.path.dirname(PY), "fleetmpirun")
    if not os.path.exists(path):
        pytest.fail(f"the fleetmpirun console script is not installed beside {PY}")
    return [path]


def logged_env(text):
    """The ENV record a job script printed into ``text``."""
    records = [json.loads(line[4:]) for line in text.splitlines() if line.startswith("ENV ")]
    assert len(records) == 1, text
    return records[0]


def test_two_ranks_with_gpus_and_log_dir(tmp_path, job_script):
    code, out, err = launch(console_script(), [
        "--gpus", "3,5", "--log_dir", "log", job_script, "--lines", "3000"], tmp_path)
    assert code == 0, out + err
    logs = sorted(os.listdir(tmp_path / "log"))
    assert logs == ["workerlog.0", "workerlog.1"]
    for rank, gpu in enumerate(["3", "5"]):
        text = (tmp_path / "log" / f"workerlog.{rank}").read_text()
        assert logged_env(text) == {
            "rank": rank, "argv": ["--lines", "3000"], "fleetmpi_imported": False,
            "path0": str(tmp_path), "CUDA_VISIBLE_DEVICES": gpu,
            "FLAGS_selected_gpus": gpu, "TRAINING_ROLE": "TRAINER",
            "PADDLE_TRAINER_ID": str(rank), "PADDLE_TRAINERS_NUM": "2",
            "PADDLE_PSERVER_ID": None, "PADDLE_PSERVERS_NUM": None, "FLEETMPI_TIMELINE": None}
        assert f"stderr of rank {rank}\n" in text
    # rank 0's log and the terminal's standard output (stderr merged into it, in the order
    # written, as in the log) both have all of rank 0's output; rank 1's is only in its log
    log0 = (tmp_path / "log" / "workerlog.0").read_text()
    assert out == log0
    assert [f"line {i} of rank 0" for i in range(3000)] == [
        line for line in out.splitlines() if line.startswith("line ")]
    assert logged_env(out)["rank"] == 0
    assert "rank 1" not in out + err


def test_four_ranks_through_python_m_with_timeline_variable(tmp_path, job_script):
    code, out, err = launch([PY, "-m", "fleetmpi.launch"], [
        "--np", "4", "--log_dir", "log", "--timeline", "trace.json", job_script], tmp_path)
    assert code == 0, out + err
    assert sorted(os.listdir(tmp_path / "log")) == [f"workerlog.{r}" for r in range(4)]
    for rank in range(4):
        env = logged_env((tmp_path / "log" / f"workerlog.{rank}").read_text())
        assert (env["rank"], env["PADDLE_TRAINER_ID"], env["PADDLE_TRAINERS_NUM"]) == (
            rank, str(rank), "4")
        assert env["FLEETMPI_TIMELINE"] == str(tmp_path / "trace.json")
        assert env["CUDA_VISIBLE_DEVICES"] is None
    assert logged_env(out)["rank"] == 0


def test_parameter_server_roles_and_log_names(tmp_path, job_script):
    code, out, err = launch(console_script(), [
        "--server_num", "1", "--worker_num", "2", "--log_dir", "log", job_script], tmp_path)
    assert code == 0, out + err
    assert sorted(os.listdir(tmp_path / "log")) == ["serverlog.0", "workerlog.0", "workerlog.1"]
    roles = {name: logged_env((tmp_path / "log" / name).read_text())
             for name in ("workerlog.0", "workerlog.1", "serverlog.0")}
    for name, rank, role, trainer, server in [("workerlog.0", 0, "TRAINER", "0", None),
                                              ("workerlog.1", 1, "TRAINER", "1", None),
                                              ("serverlog.0", 2, "PSERVER", None, "0")]:
        env = roles[name]
        assert (env["rank"], env["TRAINING_ROLE"], env["PADDLE_TRAINER_ID"],
                env["PADDLE_PSERVER_ID"]) == (rank, role, trainer, server)
        assert (env["PADDLE_TRAINERS_NUM"], env["PADDLE_PSERVERS_NUM"]) == ("2", "1")


def test_a_rank_exit_code_becomes_the_jobs(tmp_path, job_script):
    code, out, err = launch(console_script(), ["--np", "2", job_script, "--exit", "1:3"],
                            tmp_path)
    assert code == 3, out + err
    assert "fleetmpirun: the job exited with code 3" in err


def test_rank_0s_log_keeps_everything_when_the_job_is_aborted(tmp_path, job_script):
    code, out, err = launch(console_script(), [
        "--np", "2", "--log_dir", "log", job_script, "--lines", "20000", "--abort"], tmp_path)
    assert code != 0, out + err
    lines = (tmp_path / "log" / "workerlog.0").read_text().splitlines()
    assert [line for line in lines if line.startswith("line ")] == [
        f"line {i} of rank 0" for i in range(20000)]
    assert "LAST WORDS" in lines[20000:]


# ---------------------------------------------------------------- network listeners

LISTENER_JOB = textwrap.dedent("""\
    import json, os, re, subprocess, sys
    import numpy as np
    import fleetmpi as fleet
    from mpi4py import MPI

    fleet.init(is_collective=True)
    world = MPI.COMM_WORLD
    total = np.empty(1 << 16)
    world.Allreduce(np.ones(1 << 16), total)        # the transport is up and in use
    fleet.barrier_worker()
    if world.rank == 0:
        # the job: every descendant of the test process (fleetmpirun, the MPI launcher and
        # its proxies, the ranks and their log copiers)
        parents, names = {}, {}
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    head, _, tail = f.read().rpartition(")")
                parents[int(entry)] = int(tail.split()[1])
                names[int(entry)] = head.partition("(")[2]
            except OSError:
                pass
        job, frontier = set(), [int(sys.argv[1])]
        while frontier:
            children = [pid for pid, parent in parents.items() if parent in frontier]
            job.update(children)
            frontier = children
        found = []
        ss = subprocess.run(["ss", "-ltnupH"], capture_output=True, text=True, timeout=30)
        for line in ss.stdout.splitlines():
            pids = {int(pid) for pid in re.findall(r"pid=(\\d+)", line)}
            if pids & job:
                fields = line.split()
                found.append({"netid": fields[0], "local": fields[4],
                              "processes": sorted(re.findall(r'\\("([^"]+)",pid=', line))})
        print("JOB " + json.dumps(sorted(names[pid] for pid in job if pid in names)))
        print("LISTENERS " + json.dumps(found))
    world.Barrier()
    """)


def on_loopback(address):
    """Whether ``ss``'s local ``address:port`` is a loopback address."""
    import ipaddress

    host = address.rpartition(":")[0].strip("[]").partition("%")[0]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", a name
        return False


def job_listeners(tmp_path, argv):
    """``(listeners, process names)`` of a 2-rank fleetmpirun job on this host, as its rank 0
    read them with ``ss`` while every rank was inside MPI."""
    if shutil.which("ss") is None:
        pytest.skip("ss (iproute2) is not installed: the job's listeners cannot be read")
    mpiexec = mpi_command.find_mpiexec()
    if mpi_command.detect_flavour(mpiexec) != mpi_command.MPICH \
            or mpi_command.find_gforker(mpiexec) is None:
        pytest.skip("the single-host network promise is MPICH's with mpiexec.gforker; this "
                    "MPI has no mpiexec.gforker beside its mpiexec")
    script = tmp_path / "listeners.py"
    script.write_text(LISTENER_JOB)
    code, out, err = launch(console_script(), argv + [str(script), str(os.getpid())], tmp_path)
    assert code == 0, out + err
    listeners = [json.loads(line[10:]) for line in out.splitlines()
                 if line.startswith("LISTENERS ")]
    names = [json.loads(line[4:]) for line in out.splitlines() if line.startswith("JOB ")]
    assert len(listeners) == len(names) == 1, out + err
    return listeners[0], names[0]


def test_a_single_host_job_listens_on_no_socket(tmp_path):
    """The promise of docs/launch.md ("Network"): on one host, with MPICH, no process of the
    job listens anywhere but on loopback, and with the defaults nowhere at all."""
    listeners, names = job_listeners(tmp_path, ["--np", "2", "--log_dir", "log"])
    assert "mpiexec.gforker" in names and "hydra_pmi_proxy" not in names, names
    assert [entry for entry in listeners if not on_loopback(entry["local"])] == [], listeners
    assert listeners == [], listeners


def test_hydra_only_mpi_args_bring_hydras_port_back_and_say_so(tmp_path, script):
    """``--mpi_args`` that only hydra takes start the job with hydra, which listens on every
    interface (its control port, shared by its proxy and the ranks); the ranks' transport
    stays on shared memory. The test's reading of ``ss`` sees it, so it would see a regression."""
    code, _, err = launch(console_script(), ["--dry-run", "--np", "2", "--mpi_args",
                                             "-bind-to none", script], tmp_path)
    assert "need hydra (mpiexec), whose control port listens on every interface" in err
    listeners, names = job_listeners(tmp_path, ["--np", "2", "--mpi_args", "-bind-to none"])
    assert "hydra_pmi_proxy" in names, names
    assert len(listeners) == 1 and not on_loopback(listeners[0]["local"]), listeners
    assert "mpiexec" in listeners[0]["processes"], listeners


@pytest.mark.parametrize("argv, gforker", [
    (["--np", "2"], True),
    (["--ips", "localhost", "--np", "2"], True),
    (["--np", "2", "--mpi_args", "-l -genvall", "--mpi_args", "-genv A 'b c'"], True),
    (["--ips", "h1,h2"], False),
    (["--ips", "localhost,h2", "--np", "2"], False),
    (["--np", "2", "--mpi_args", "-bind-to core"], False),
])
def test_gforker_on_one_host_and_hydra_for_several(tmp_path, script, capsys, argv, gforker):
    mpiexec = _fake_mpiexec(tmp_path, "HYDRA build details:\n    Version: 5.0.2")
    (tmp_path / "mpiexec.gforker").write_text("#!/bin/sh\nexit 255\n")
    (tmp_path / "mpiexec.gforker").chmod(0o755)
    assert fleetmpirun.main(["--mpiexec", mpiexec, "--dry-run"] + argv + [script]) == 0
    cmd = shlex.split(capsys.readouterr().out.strip())
    transport = ["-genv", "FI_PROVIDER", "shm", "-genv", "UCX_TLS", "self,sm"]
    if gforker:
        assert cmd[:3] == [str(tmp_path / "mpiexec.gforker"), "-n", "2"]
        assert cmd[3:9] == transport
        assert "-genvall" not in cmd and "-hosts" not in cmd
        assert cmd[cmd.index(WRAPPER[1]) + 1] == "--single_host"
    else:
        assert cmd[0] == mpiexec and "--single_host" not in cmd
        # several hosts: the transport needs the network; one host: shared memory
        assert (shlex.join(transport) in shlex.join(cmd)) == ("h2" not in argv[1]), cmd


def test_a_transport_the_user_chose_is_left_as_it_is(tmp_path, script):
    args = parse("--np", "2", script)
    cmd = fleetmpirun.mpiexec_launch_command(args, "mpich", str(_fake_mpiexec(tmp_path, "HYDRA")),
                                     environ={"UCX_TLS": "tcp"}, as_root=False)
    assert "UCX_TLS" not in cmd and cmd[cmd.index("FI_PROVIDER") + 1] == "shm"
    # Open MPI's command is not changed
    ompi = fleetmpirun.mpiexec_launch_command(args, "openmpi", "mpirun", environ={}, as_root=False)
    assert ompi == ["mpirun", "-n", "2", "--oversubscribe"] + WRAPPER + ["--", script]


def test_gforker_takes_only_its_own_options():
    assert mpi_command.gforker_arguments([]) == []
    assert mpi_command.gforker_arguments(["-genvall", "-l", "-genv", "A", "b", "-wdir", "/t"]) \
        == ["-l", "-genv", "A", "b", "-wdir", "/t"]
    for refused in (["-bind-to", "core"], ["-ppn", "2"], ["-genv", "A"], ["-verbose"],
                    ["-hosts", "a"], ["stray"]):
        assert mpi_command.gforker_arguments(refused) is None, refused
    with pytest.raises(ValueError, match="this host only"):
        mpi_command.mpiexec_command("mpich", "mpiexec.gforker", 2, ["p"], hosts=["a", "b"],
                                  process_manager=mpi_command.GFORKER)


def test_explicit_hydra_or_gforker_is_respected(tmp_path, script, capsys):
    hydra = tmp_path / "mpiexec.hydra"
    hydra.write_text("#!/bin/sh\necho 'HYDRA build details:'\n")
    hydra.chmod(0o755)
    gforker = tmp_path / "mpiexec.gforker"
    gforker.write_text("#!/bin/sh\nexit 255\n")
    gforker.chmod(0o755)
    assert fleetmpirun.main(["--mpiexec", str(hydra), "--dry-run", "--np", "2", script]) == 0
    assert shlex.split(capsys.readouterr().out)[0] == str(hydra)
    assert mpi_command.detect_flavour(str(gforker)) == mpi_command.MPICH
    assert fleetmpirun.main(["--mpiexec", str(gforker), "--dry-run", "--np", "2", script]) == 0
    assert shlex.split(capsys.readouterr().out)[0] == str(gforker)
    with pytest.raises(SystemExit):
        fleetmpirun.main(["--mpiexec", str(gforker), "--dry-run", "--ips", "h1,h2", script])
    assert "starts ranks on this host only" in capsys.readouterr().err


def test_under_gforker_the_local_rank_is_the_rank():
    environ = {"PMI_RANK": "3", "PMI_SIZE": "4", "PMI_FD": "8", "MPI_LOCALRANKID": "0"}
    assert rank_main.place(environ, single_host=True) == (3, 4, 3)
    assert rank_main.place(environ) == (3, 4, 0)


@pytest.mark.parametrize("argv, orig_argv, launcher", [
    (["/venv/bin/fleetmpirun", "--np", "2"], ["/venv/bin/python", "/venv/bin/fleetmpirun"], True),
    (["-m"], ["python", "-m", "fleetmpi.launch", "--np", "2"], True),
    (["-m"], ["python", "-mfleetmpi.launch"], True),
    (["-m"], ["python", "-m", "pytest", "fleetmpi.launch"], False),
    (["train.py"], ["python", "train.py"], False),
])
def test_the_launcher_process_does_not_initialize_mpi(argv, orig_argv, launcher):
    """fleetmpirun imports fleetmpi, whose import would make it an MPI process with listeners
    of its own; it is recognised and leaves MPI uninitialized."""
    import fleetmpi

    assert fleetmpi._started_as_launcher(argv, orig_argv) == launcher
    code = ("import sys; sys.argv[0] = {!r}; import fleetmpi; from mpi4py import MPI; "
            "print(MPI.Is_initialized())")
    for name, initialized in (("/venv/bin/fleetmpirun", "False"), ("train.py", "True")):
        probe = subprocess.run([PY, "-c", code.format(name)], text=True, capture_output=True,
                               timeout=HANG_SECONDS)
        assert probe.stdout.strip() == initialized, probe.stderr


ALONE_JOB = textwrap.dedent("""\
    import json, os, re, subprocess
    import numpy as np
    import fleetmpi as fleet
    from mpi4py import MPI

    fleet.init(is_collective=True)
    total = np.empty(1 << 16)
    MPI.COMM_WORLD.Allreduce(np.ones(1 << 16), total)     # the transport is up and in use
    ss = subprocess.run(["ss", "-ltnupH"], capture_output=True, text=True, timeout=30)
    mine = [line.split()[4] for line in ss.stdout.splitlines()
            if f"pid={os.getpid()}," in line]
    print("LISTENERS " + json.dumps(mine))
    print("INHERITED " + json.dumps([os.environ.get(n) for n in ("UCX_TLS", "FI_PROVIDER")]))
    """)


def test_a_process_started_alone_listens_on_no_socket(tmp_path):
    """``python train.py``, a world of one: MPI's transport is kept to shared memory while MPI
    starts (its defaults listen on the host's external address), and the variables are not
    left for the jobs the process starts."""
    if shutil.which("ss") is None:
        pytest.skip("ss (iproute2) is not installed: the process's listeners cannot be read")
    if mpi_command.detect_flavour(mpi_command.find_mpiexec()) != mpi_command.MPICH:
        pytest.skip("the promise is MPICH's, whose transports the variables name")
    launched = re.compile(r"(PMI|PMIX|OMPI|SLURM|MPI_LOCAL|UCX|FI)_")
    environ = {name: value for name, value in os.environ.items() if not launched.match(name)}
    done = subprocess.run([sys.executable, "-c", ALONE_JOB], capture_output=True, text=True,
                          env=environ, timeout=HANG_SECONDS, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    said = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert json.loads(said["LISTENERS"]) == [], done.stdout
    assert json.loads(said["INHERITED"]) == [None, None], done.stdout

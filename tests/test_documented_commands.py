"""Every command line the documentation gives (README.md, docs/*.md, the examples' docstrings,
the Slurm example) is parsed against its program, so that a renamed or removed option fails
here instead of on a reader's machine (tests/documented_commands.py finds them,
tests/dry_parse.py parses them without running them)."""
import json
import os
import subprocess
import sys

from documented_commands import argvs, documented_commands, program_calls

HERE = os.path.dirname(os.path.abspath(__file__))


def dry_parse(calls):
    """The verdicts of tests/dry_parse.py on ``calls``, in one process."""
    done = subprocess.run([sys.executable, os.path.join(HERE, "dry_parse.py")],
                          input=json.dumps(calls), capture_output=True, text=True,
                          cwd=os.path.dirname(HERE), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_every_documented_command_parses_against_its_program():
    commands = documented_commands()
    calls, owners = [], []
    for command in commands:
        for call in program_calls(command.argv):
            calls.append(dict(call, fragment=command.inline))
            owners.append(command)
    verdicts = dry_parse(calls)
    refused = [f"{owner}\n    {verdict['message']}" for owner, verdict in zip(owners, verdicts)
               if not verdict["ok"]]
    assert not refused, "documented commands their programs refuse:\n" + "\n".join(refused)
    assert len(calls) >= 100  # the extraction found the documents' commands


def test_the_documents_commands_are_found_where_a_reader_sees_them():
    found = {(c.source, " ".join(c.argv)) for c in documented_commands()}
    for expected in [
            ("README.md", "mpiexec -n 2 python examples/train_digits.py"),  # after pip ... &&
            ("README.md", "pip install -e .[test]"),
            ("README.md", "tests/run"),
            # an optional part kept, the metavar as a placeholder
            ("README.md", "mpiexec -n 2 python examples/train_gpt.py --amp --recompute "
                          "--gradient-merge K"),
            # alternatives, one command each
            ("README.md", "mpiexec -n 2 python benchmarks/nonfinite_cost.py gpt STEPS"),
            ("examples/train_gpt.py", "python examples/train_gpt.py --val-every"),  # prose
            ("examples/slurm/train.sbatch", "sbatch examples/slurm/train.sbatch --batch-size 64 "
                                            "--min-accuracy 0.9"),
            ("docs/hybrid.md", "python -m fleetmpi.plan --gpt 24,2048,16,50304,1024 "
                               "--global-batch 64 --ranks 16 --gpus-per-node 8 --inter ib100 "
                               "--layout dp=2,pp=2,mp=4 --memory-GB 32"),  # an indented block
    ]:
        assert expected in found, expected
    # an sbatch script stands for its srun line, "$@" for the arguments given
    [call] = program_calls(("sbatch", "examples/slurm/train.sbatch", "--min-accuracy", "0.5"))
    assert call["target"] == "examples/train_digits.py"
    assert call["args"][-2:] == ["--min-accuracy", "0.5"]


def test_the_notation_of_the_documents():
    assert argvs("[mpiexec -n 2] python b.py mlp|gpt STEPS [options]  # note") == [
        ("mpiexec", "-n", "2", "python", "b.py", "mlp", "STEPS"),
        ("mpiexec", "-n", "2", "python", "b.py", "gpt", "STEPS")]
    assert argvs("pip install -e '.[test]' && FLEETMPI_DEVICE=cpu tests/run") == [
        ("pip", "install", "-e", ".[test]"), ("tests/run",)]
    assert argvs("a.py --commit <commit of the tree>") == [
        ("a.py", "--commit", "<commit_of_the_tree>")]


def test_a_drifted_command_is_refused_with_the_programs_own_message():
    gpt = "examples/train_gpt.py"
    calls = [
        {"program": "script", "target": gpt, "args": ["--gradient_merge", "2"]},
        {"program": "script", "target": gpt, "args": ["--gradient-merge", "X"]},  # not K
        {"program": "script", "target": gpt, "args": ["--gradient-merge", "K"]},
        {"program": "script", "target": "examples/no_such.py", "args": []},
        {"program": "fleetmpirun", "target": "fleetmpirun", "args": ["--np", "2", "--bogus",
                                                                     "train.py"]},
        {"program": "fleetmpirun", "target": "fleetmpirun", "args": ["--np"]},
        {"program": "fleetmpirun", "target": "fleetmpirun", "args": ["--np"], "fragment": True},
        {"program": "fleetmpirun", "target": "fleetmpirun", "args": ["--flux"], "fragment": True},
        {"program": "pytest", "target": "pytest", "args": ["--no-such-option", "tests/"]},
        {"program": "extras", "extras": ["test", "no-such-extra"]},
    ]
    verdicts = dry_parse(calls)
    assert [v["ok"] for v in verdicts] == [False, False, True, False, False, False, True, False,
                                           False, False]
    assert "unrecognized arguments: --gradient_merge" in verdicts[0]["message"]
    assert "invalid int value: 'X'" in verdicts[1]["message"]
    assert "no such file" in verdicts[3]["message"]
    assert "--bogus" in verdicts[4]["message"]
    assert "no-such-extra" in verdicts[9]["message"]


def test_the_slurm_example_shows_the_same_job_without_slurm():
    """A reader without Slurm finds, in the sbatch script's comments, a fleetmpirun or
    mpiexec line that runs what its srun line runs."""
    commands = [c for c in documented_commands() if c.source == "examples/slurm/train.sbatch"]
    [srun] = [c for c in commands if c.argv[0] == "srun"]
    ran = program_calls(srun.argv)
    without = [c for c in commands if c.argv[0] in ("fleetmpirun", "mpiexec")]
    assert without, "no fleetmpirun or mpiexec line in examples/slurm/train.sbatch"
    for command in without:
        assert ran[0] in program_calls(command.argv), str(command)

"""docs/paddle_compat.md, "Dygraph hybrid parallel": each Paddle script (tensor parallel, and
pipeline parallel through PipelineLayer and train_batch) and its fleetmpi version differ only
in their imports, and the fleetmpi one trains on 2 ranks (at mp2, and at pp2: both ranks print
the same losses, which fall)."""
import ast
import os
import re
import sys

import pytest

from job_limits import run_to_end

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def section_scripts():
    with open(os.path.join(ROOT, "docs", "paddle_compat.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Dygraph hybrid parallel", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    # whole scripts only (they import paddle or fleetmpi), not the fragments between them
    return [b for b in blocks if re.search(r"^import (paddle|fleetmpi)", b, re.M)]


def without_imports(source):
    tree = ast.parse(source)
    tree.body = [node for node in tree.body if not isinstance(node, (ast.Import, ast.ImportFrom))]
    return ast.dump(tree)


@pytest.mark.parametrize("pair", [0, 1], ids=["tensor parallel", "pipeline"])
def test_the_two_scripts_differ_only_in_their_imports(pair):
    paddle, ours = section_scripts()[2 * pair:2 * pair + 2]
    assert "import paddle" in paddle and "import fleetmpi" in ours
    assert without_imports(paddle) == without_imports(ours)


@pytest.mark.parametrize("pair", [0, 1], ids=["mp2", "pp2"])
def test_the_fleetmpi_script_trains_on_two_ranks(tmp_path, pair):
    script = tmp_path / "train.py"
    script.write_text(section_scripts()[2 * pair + 1])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "TRAINING_"))}
    code, out, err = run_to_end([sys.executable, "-m", "fleetmpi.launch", "--np", "2",
                                 str(script)], env=env)
    output = out + err
    assert code == 0, output
    losses = {}
    for rank, step, loss in re.findall(r"rank (\d) step (\d) loss ([0-9.]+)", output):
        losses.setdefault(int(rank), []).append(float(loss))
    assert sorted(losses) == [0, 1] and losses[0] == losses[1], output
    assert len(losses[0]) == 3 and losses[0][-1] < losses[0][0], output

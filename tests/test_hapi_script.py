"""docs/paddle_compat.md, "paddle.Model (hapi)": the Paddle script and its fleetmpi version
differ only in their imports, and the fleetmpi one trains at 2 ranks with EarlyStopping and
ModelCheckpoint, both ranks report the same evaluation, and the .pdparams it saved loads."""
import os
import re
import sys

import numpy as np

import fleetmpi

from job_limits import run_to_end
from test_paddle_hybrid_script import ROOT, without_imports


def section_scripts():
    with open(os.path.join(ROOT, "docs", "paddle_compat.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## paddle.Model (hapi)", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_two_scripts_differ_only_in_their_imports():
    paddle, ours = section_scripts()
    assert "import paddle\n" in paddle and "import fleetmpi as paddle\n" in ours
    assert without_imports(paddle) == without_imports(ours)


def test_the_fleetmpi_script_fits_on_two_ranks_and_its_checkpoint_loads(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(section_scripts()[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "TRAINING_"))}
    env["FLEETMPI_PROGRESS"] = "lines"
    code, out, err = run_to_end([sys.executable, "-m", "fleetmpi.launch", "--np", "2",
                                 str(script)], env=env, cwd=tmp_path)
    output = out + err
    assert code == 0, output
    # numbers, not \S+: mpiexec may join two ranks' lines (one's text, the other's, both newlines)
    evals = dict(re.findall(r"rank (\d) eval (loss [\d.]+ acc [\d.]+)", output))
    assert sorted(evals) == ["0", "1"] and evals["0"] == evals["1"], output
    assert float(evals["0"].split()[-1]) > 0.9, output
    assert re.findall(r"rank \d loaded (\d+) arrays", output) == ["4", "4"], output
    assert "Epoch 1/6" in output and "save checkpoint at" in output, output
    saved = sorted(os.listdir(tmp_path / "checkpoints"))
    assert {"0.pdparams", "final.pdparams", "final.pdopt", "best_model.pdparams"} <= set(saved)
    state = fleetmpi.load(str(tmp_path / "checkpoints" / "final.pdparams"), return_numpy=True)
    assert sorted(state) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert state["0.weight"].shape == (16, 32) and np.isfinite(state["0.weight"]).all()

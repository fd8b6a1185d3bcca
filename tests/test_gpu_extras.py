"""The ``gpu`` extras resolve to today's GPU stack: ``pip install --dry-run`` of each, from the
package registry, names CuPy 14, cuDNN 9 with NVIDIA's cuDNN frontend, NCCL, and nvmath-python
1 (cuBLASLt) with the CUDA major's cuda-bindings, for CUDA 12 (``gpu``) and CUDA 13
(``gpu-cuda13``)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# extra -> {distribution: major version}; None: any version
STACKS = {
    "gpu": {"cupy-cuda12x": 14, "nvidia-cudnn-cu12": 9, "nvidia-nccl-cu12": 2,
            "nvidia-cudnn-frontend": None, "nvmath-python": 1, "cuda-bindings": 12},
    "gpu-cuda13": {"cupy-cuda13x": 14, "nvidia-cudnn-cu13": 9, "nvidia-nccl-cu13": 2,
                   "nvidia-cudnn-frontend": None, "nvmath-python": 1, "cuda-bindings": 13},
}


@pytest.mark.parametrize("extra", sorted(STACKS))
def test_the_gpu_extra_resolves_to_cupy_14_cudnn_9_and_the_frontend(tmp_path, extra):
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
         "--report", str(report), f".[{extra}]"], cwd=ROOT, capture_output=True, text=True,
        timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    installs = {item["metadata"]["name"].lower(): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    for name, major in STACKS[extra].items():
        assert name in installs, (name, sorted(installs))
        if major is not None:
            assert int(installs[name].split(".")[0]) == major, (name, installs[name])

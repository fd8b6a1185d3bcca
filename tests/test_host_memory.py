"""Freed host memory is kept for the next arrays (fewer page faults per training step), and
FLEETMPI_KEEP_HOST_MEMORY=0 restores glibc's defaults."""
import json
import os
import subprocess
import sys

import pytest

from fleetmpi.core import host_memory

from job_limits import HANG_SECONDS

# Allocates, touches and frees 8 MiB arrays in turn, counting the minor page faults of the
# last ten rounds after fleetmpi chose its backend (NumPy).
FAULTS_SCRIPT = """
import json, resource
import numpy as np
from fleetmpi import backend, host_memory
backend.array_module()
def rounds(n):
    for _ in range(n):
        a = np.ones(2 << 20, dtype=np.float32)
        b = a * 2
        del a, b
rounds(3)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds(10)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"faults": faults, "kept": host_memory.keep_freed_memory()}))
"""


def run_faults(keep):
    env = dict(os.environ, FLEETMPI_DEVICE="cpu", FLEETMPI_KEEP_HOST_MEMORY=keep)
    out = subprocess.run([sys.executable, "-c", FAULTS_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=HANG_SECONDS, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(host_memory._glibc() is None, reason="mallopt is glibc's")
def test_kept_memory_is_reused_without_page_faults():
    kept, default = run_faults("1"), run_faults("0")
    assert kept["kept"] is True and default["kept"] is False
    pages = 2 * (8 << 20) // 4096  # two fresh 8 MiB arrays per round
    assert default["faults"] > 2 * pages, default
    assert kept["faults"] < pages // 4, kept


class FakeLibc:
    def __init__(self, result=1):
        self.calls, self.result = [], result

    def mallopt(self, parameter, value):
        self.calls.append((parameter, value))
        return self.result


def test_keep_sets_the_thresholds_once(monkeypatch):
    monkeypatch.setattr(host_memory, "_kept", None)
    libc = FakeLibc()
    assert host_memory.keep_freed_memory(libc, environ={}) is True
    assert libc.calls == [(host_memory.M_MMAP_THRESHOLD, 32 << 20),
                          (host_memory.M_TRIM_THRESHOLD, 1 << 30)]
    assert host_memory.keep_freed_memory(FakeLibc(), environ={}) is True
    monkeypatch.setattr(host_memory, "_kept", None)
    refused = FakeLibc(result=0)
    assert host_memory.keep_freed_memory(refused, environ={}) is False


def test_the_variable_turns_it_off_and_rejects_other_values(monkeypatch):
    monkeypatch.setattr(host_memory, "_kept", None)
    libc = FakeLibc()
    assert host_memory.keep_freed_memory(libc, environ={"FLEETMPI_KEEP_HOST_MEMORY": "0"}) \
        is False
    assert libc.calls == []
    with pytest.raises(ValueError, match="FLEETMPI_KEEP_HOST_MEMORY='yes' must be 0 or 1"):
        host_memory.wanted({"FLEETMPI_KEEP_HOST_MEMORY": "yes"})

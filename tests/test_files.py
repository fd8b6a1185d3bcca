"""Files fleetmpi writes at names others can predict are never written through a symbolic link
planted there: the timeline's part file, its trace, parameter-server shards and fleetmpirun's
rank logs."""
import os
import subprocess
import sys

import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.core import files, timeline
from fleetmpi.strategies.ps import shards

from job_limits import HANG_SECONDS

VICTIM_TEXT = "precious\n"


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim.txt"
    path.write_text(VICTIM_TEXT)
    return path


def test_open_for_writing_refuses_a_symbolic_link_and_truncates_a_file(tmp_path, victim):
    link = tmp_path / "out.txt"
    link.symlink_to(victim)
    with pytest.raises(OSError, match=r"cannot write .*out.txt.*symbolic link"):
        files.open_for_writing(str(link))
    assert victim.read_text() == VICTIM_TEXT
    plain = tmp_path / "plain.txt"
    plain.write_text("old contents that are longer")
    with files.open_for_writing(str(plain)) as f:
        f.write("new")
    assert plain.read_text() == "new"


def test_temporary_beside_is_new_and_exclusive(tmp_path):
    target = tmp_path / "result.npz"
    first, first_name = files.temporary_beside(str(target), binary=True)
    second, second_name = files.temporary_beside(str(target), binary=True)
    with first, second:
        assert first_name != second_name
    for name in (first_name, second_name):
        assert os.path.dirname(name) == str(tmp_path)
        assert os.path.basename(name).startswith(".result.npz.") and name.endswith(".part")


def test_a_timeline_part_file_is_not_written_through_a_link(tmp_path, victim):
    fleet.init(is_collective=True)
    path = str(tmp_path / "trace.json")
    os.symlink(victim, timeline.part_path(path, fleet.worker_index()))
    timeline.start(path)
    try:
        with pytest.raises(OSError, match="symbolic link"):
            with timeline.span("forward"):
                pass
            timeline.flush()
    finally:
        timeline.stop()
    assert victim.read_text() == VICTIM_TEXT


def test_a_shard_replaces_a_link_at_its_name_instead_of_writing_through_it(tmp_path, victim):
    path = shards.shard_path(str(tmp_path), 0, 1)
    os.symlink(victim, path)
    os.symlink(victim, f"{path}.{os.getpid()}.partial")        # the old predictable temporary
    shards.save_shard(str(tmp_path), 0, 1, {"w": np.arange(3.0)}, {"step": 1})
    assert victim.read_text() == VICTIM_TEXT
    assert not os.path.islink(path)
    arrays, meta = shards.load_shard(str(tmp_path), 0, 1)
    np.testing.assert_array_equal(arrays["w"], np.arange(3.0))
    assert meta == {"step": 1}


def test_fleetmpirun_refuses_a_rank_log_that_is_a_link(tmp_path, victim):
    script = tmp_path / "job.py"
    script.write_text("print('trained')\n")
    (tmp_path / "log").mkdir()
    os.symlink(victim, tmp_path / "log" / "workerlog.0")
    environ = {name: value for name, value in os.environ.items()
               if not name.startswith(("PMI_", "OMPI_", "PMIX_", "SLURM_", "FLEETMPI_"))}
    result = subprocess.run([sys.executable, "-m", "fleetmpi.launch", "--np", "1", "--log_dir",
                             "log", str(script)], cwd=tmp_path, env=environ,
                            capture_output=True, text=True, timeout=HANG_SECONDS)
    assert result.returncode != 0, result.stdout + result.stderr
    assert "workerlog.0" in result.stdout + result.stderr
    assert "symbolic link" in result.stdout + result.stderr
    assert victim.read_text() == VICTIM_TEXT

"""Two jobs saving into one checkpoint folder: the first to save holds it, the second is
refused on every rank naming the first, and the folder's checkpoint is never lost."""
import json
import os
import subprocess
import sys
import time

import numpy as np

from fleetmpi.launch.mpi_command import local_command
from fleetmpi.training import checkpoint
from job_limits import HANG_SECONDS

FOLDERS = 30

# One single-process job: save twice into each folder of ``root`` in the order its seed
# shuffles, going on past refusals; print one JSON line per folder. The model's parameters are
# all the job's number, so a loaded checkpoint tells whose it is.
CONTENDER = """
import json, sys, time
import numpy as np
import fleetmpi as fleet
from fleetmpi import nn, optimizer
from fleetmpi.training import checkpoint
root, job, folders = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fleet.init(is_collective=True)
model = nn.Linear(3, 2)
for p in model.parameters():
    p.set_value(np.full(p.shape, job, dtype=np.float32))
opt = optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
start = float(sys.argv[4])
while time.time() < start:
    time.sleep(0.005)
for folder in np.random.default_rng(job).permutation(folders):
    outcome = []
    for step in (1, 2):
        try:
            checkpoint.save(f"{root}/{folder}", model, opt, step)
            outcome.append("saved")
        except RuntimeError as error:
            outcome.append(str(error))
    print(json.dumps({"folder": int(folder), "outcome": outcome}), flush=True)
"""


def _loaded_job(directory):
    """The job number whose parameters the folder's checkpoint holds."""
    with np.load(os.path.join(directory, checkpoint.read_manifest(directory)["files"][0]["file"]),
                 allow_pickle=False) as stored:
        values = {float(v) for k in stored.files if k.startswith("model/")
                  for v in np.unique(stored[k])}
    assert len(values) == 1, values
    return int(values.pop())


def test_two_jobs_saving_thirty_folders_at_once_never_lose_a_checkpoint(tmp_path):
    start = time.time() + 3.0      # both jobs past their imports, then racing
    jobs = [subprocess.Popen([sys.executable, "-c", CONTENDER, str(tmp_path), str(job),
                              str(FOLDERS), f"{start:.3f}"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for job in (1, 2)]
    said = [job.communicate(timeout=HANG_SECONDS) for job in jobs]
    for job, (out, err) in zip(jobs, said):
        assert job.returncode == 0, err
    outcomes = [{row["folder"]: row["outcome"] for row in map(json.loads, out.splitlines())}
                for out, _ in said]
    for folder in range(FOLDERS):
        first, second = outcomes[0][folder], outcomes[1][folder]
        winners = [job for job, outcome in ((1, first), (2, second))
                   if outcome == ["saved", "saved"]]
        assert len(winners) == 1, (folder, first, second)
        loser = (second if winners == [1] else first)
        pid = jobs[winners[0] - 1].pid
        for refusal in loser:
            assert "another job saves into this folder" in refusal, refusal
            assert f"rank 0 is process {pid} on " in refusal, refusal
        assert _loaded_job(str(tmp_path / str(folder))) == winners[0], folder


# A job of two ranks: save into the folder, then (the holder) wait for the other job to have
# tried, then save again; exit 0 when both saves passed, 3 when a save was refused (each rank
# writing why into tried-<rank>).
HOLDER_OR_SECOND = """
import os, sys, time
import numpy as np
import fleetmpi as fleet
from fleetmpi import nn, optimizer
from fleetmpi.training import checkpoint
folder, role = sys.argv[1], sys.argv[2]
fleet.init(is_collective=True)
model = fleet.distributed_model(nn.Linear(3, 2))
opt = fleet.distributed_optimizer(optimizer.SGD(learning_rate=0.1,
                                                parameters=model.parameters()))
try:
    checkpoint.save(folder, model, opt, 1)
except RuntimeError as error:
    with open(os.path.join(folder, f"tried-{fleet.worker_index()}"), "w") as f:
        f.write(str(error))
    sys.exit(3)
if role == "holder":
    deadline = time.time() + 200
    while not all(os.path.exists(os.path.join(folder, f"tried-{r}")) for r in (0, 1)):
        assert time.time() < deadline, "the second job never tried"
        time.sleep(0.05)
    checkpoint.save(folder, model, opt, 2)
"""


def test_a_second_job_of_two_ranks_is_refused_on_every_rank_naming_the_first(tmp_path):
    folder = str(tmp_path / "ckpt")
    os.makedirs(folder)
    holder = subprocess.Popen(local_command(2, [sys.executable, "-c", HOLDER_OR_SECOND, folder,
                                                "holder"]),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + HANG_SECONDS
    while not os.path.exists(os.path.join(folder, checkpoint.MANIFEST)):
        assert holder.poll() is None and time.time() < deadline, holder.communicate()[0]
        time.sleep(0.05)
    second = subprocess.run(local_command(2, [sys.executable, "-c", HOLDER_OR_SECOND, folder,
                                              "second"]),
                            capture_output=True, text=True, timeout=HANG_SECONDS)
    out = holder.communicate(timeout=HANG_SECONDS)[0]
    assert holder.returncode == 0, out
    assert second.returncode != 0, second.stdout + second.stderr
    for rank in (0, 1):
        said = open(os.path.join(folder, f"tried-{rank}")).read()
        assert "another job saves into this folder (2 rank(s), rank 0 is process" in said, said
    assert checkpoint.read_manifest(folder)["step"] == 2

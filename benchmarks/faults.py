"""How fast a job ends after a fault, for each fault-injection scenario, under ``mpiexec`` and
under ``fleetmpirun``.

    python benchmarks/faults.py [--ranks 2] [--repeats 3] [--only TEXT]

Each scenario runs ``tests/failure_jobs.py``, ``tests/stall_jobs.py`` or
``tests/wait_jobs.py`` (the jobs the fault-injection tests start): the
job prints ``FAULT <time>`` at the moment of the fault, and the time from there to the
launcher's exit is the measure (median of ``--repeats`` runs), next to the exit status and
whether the job's output names the failing rank. Stalls run with ``FLEETMPI_STALL_TIMEOUT=2``,
so their time includes those 2 s, except the uneven-data rows, which run at the default stall
time (600 s). A job that has not ended after 60 s counts as hung.

    python benchmarks/faults.py --elastic [--repeats 5]

measures instead the time from a rank's SIGKILL to training resumed under ``fleetmpirun
--elastic`` (``tests/elastic_job.py``: 3 ranks, rank 2 killed, resumed at 2).
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from fleetmpi.launch.mpi_command import local_command

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "failure_jobs.py")
ELASTIC_JOB = os.path.join(os.path.dirname(JOB), "elastic_job.py")
STALL_JOB = os.path.join(os.path.dirname(JOB), "stall_jobs.py")
WAIT_JOB = os.path.join(os.path.dirname(JOB), "wait_jobs.py")
NOT_SENT = "rank 1 has not made the matching send"
REPEAT_NAMED = "rank 1: allgather of float32 (4,), call #3"
HANG_SECONDS = 60
SCENARIOS = [
    # (name, job arguments (after the job file, failure_jobs.py unless named first), extra
    # environment, and per launcher: the text that names the failing rank, or why none can)
    ("rank 1 raises while rank 0 waits in an allreduce", ["raise"], {},
     {"mpiexec": "rank 1/", "fleetmpirun": "rank 1/"}),
    ("rank 1 raises in a thread", ["raise-thread"], {},
     {"mpiexec": "rank 1/", "fleetmpirun": "rank 1/"}),
    ("rank 1 is killed (SIGKILL)", ["kill9"], {},
     {"mpiexec": "no: MPICH names one process id", "fleetmpirun": "did not run their script"}),
    ("rank 1 leaves with os._exit(0)", ["exit0"], {},
     {"mpiexec": "no: reported as success", "fleetmpirun": "did not run their script"}),
    ("rank 1 skips an allreduce (stall)", ["stall", "1", "allreduce", "skip"],
     {"FLEETMPI_STALL_TIMEOUT": "2"},
     {"mpiexec": "rank(s) 1 have not arrived", "fleetmpirun": "rank(s) 1 have not arrived"}),
    ("rank 1 never reaches barrier_worker (stall)", ["stall", "1", "barrier_worker", "skip"],
     {"FLEETMPI_STALL_TIMEOUT": "2"},
     {"mpiexec": "rank(s) 1 have not arrived", "fleetmpirun": "rank(s) 1 have not arrived"}),
    ("rank 1 hangs after 999 repeated allreduces (stall)",
     [STALL_JOB, "repeat", "allreduce", "1000"], {"FLEETMPI_STALL_TIMEOUT": "2"},
     {"mpiexec": "rank(s) 1 have not arrived", "fleetmpirun": "rank(s) 1 have not arrived"}),
    ("rank 1 hangs before training step 5 (stall)", [STALL_JOB, "train", "minimize", "5"],
     {"FLEETMPI_STALL_TIMEOUT": "2"},
     {"mpiexec": "rank(s) 1 have not arrived", "fleetmpirun": "rank(s) 1 have not arrived"}),
    ("uneven data: rank 0 ends its script after 3 steps, rank 1 has 5",
     [STALL_JOB, "uneven", "minimize", "3,5"], {},
     {"mpiexec": "rank 0 finished its script", "fleetmpirun": "rank 0 finished its script"}),
    ("uneven data: rank 0 leaves its loop for barrier_worker", [STALL_JOB, "leave", "barrier"],
     {}, {"mpiexec": "rank 0 waits in barrier_worker",
          "fleetmpirun": "rank 0 waits in barrier_worker"}),
    ("a NaN in rank 1's batch at step 3 (non-finite check)", ["nan"], {},
     {"mpiexec": "rank 1 (loss and local gradient)",
      "fleetmpirun": "rank 1 (loss and local gradient)"}),
    ("rank 1's checkpoint file damaged, every rank loads", ["damaged-checkpoint"], {},
     {"mpiexec": "because not every rank could load its part; rank 1:",
      "fleetmpirun": "because not every rank could load its part; rank 1:"}),
    ("rank 1 never sends what rank 0 waits for in recv (stall)", [WAIT_JOB, "recv", "sleep"],
     {"FLEETMPI_STALL_TIMEOUT": "2"}, {"mpiexec": NOT_SENT, "fleetmpirun": NOT_SENT}),
    ("rank 1 ends its script while rank 0 waits in recv", [WAIT_JOB, "recv", "finish"],
     {"FLEETMPI_STALL_TIMEOUT": "2"}, {"mpiexec": NOT_SENT, "fleetmpirun": NOT_SENT}),
    ("pipeline stage 1 raises in train_batch, caught, then ends its script",
     [WAIT_JOB, "pipeline", "finish"], {"FLEETMPI_STALL_TIMEOUT": "2"},
     {"mpiexec": NOT_SENT, "fleetmpirun": NOT_SENT}),
    ("pipeline stage 1 raises in train_batch, caught, then sleeps (stall)",
     [WAIT_JOB, "pipeline", "sleep"], {"FLEETMPI_STALL_TIMEOUT": "2"},
     {"mpiexec": NOT_SENT, "fleetmpirun": NOT_SENT}),
    ("rank 1 hangs outside any call, rank 0 ends its script (exit path, stall)",
     [WAIT_JOB, "exit", "broadcast"], {"FLEETMPI_STALL_TIMEOUT": "2"},
     {"mpiexec": "for rank(s) 1 to finish", "fleetmpirun": "for rank(s) 1 to finish"}),
    ("rank 1's third repeated allgather has another dtype", [STALL_JOB, "diverge", "allgather"],
     {"FLEETMPI_STALL_TIMEOUT": "2"}, {"mpiexec": REPEAT_NAMED, "fleetmpirun": REPEAT_NAMED}),
    ("rank 1's third repeated broadcast has another shape, root 0 ends its script",
     [STALL_JOB, "diverge", "shape"], {"FLEETMPI_STALL_TIMEOUT": "2"},
     {"mpiexec": "rank 0 made a different call", "fleetmpirun": "rank 0 made a different call"}),
    ("rank 1 skips the second of 3 repeated broadcasts (call counts at exit)",
     [STALL_JOB, "diverge", "skip"], {"FLEETMPI_STALL_TIMEOUT": "2"},
     {"mpiexec": "(rank 1: 2)", "fleetmpirun": "(rank 1: 2)"}),
    ("amp skips every step: rank 1's batches all hold a NaN", ["amp-nan"], {},
     {"mpiexec": "amp: step 7: the gradients held an inf or NaN",
      "fleetmpirun": "amp: step 7: the gradients held an inf or NaN"}),
]


def fleetmpirun(ranks):
    script = os.path.join(os.path.dirname(sys.executable), "fleetmpirun")
    launcher = [script] if os.path.exists(script) else [sys.executable, "-m", "fleetmpi.launch"]
    return launcher + ["--np", str(ranks)]


def run(command, env):
    """``(status, seconds from the fault to the exit, output)``; status None: hung."""
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=HANG_SECONDS)
    except subprocess.TimeoutExpired as hung:
        return None, None, (hung.stdout or "") + (hung.stderr or "")
    ended = time.time()
    output = done.stdout + done.stderr
    faults = [float(line.split()[1]) for line in output.splitlines() if line.startswith("FAULT ")]
    return done.returncode, (ended - faults[0]) if faults else None, output


def elastic_restart(repeats):
    """Seconds from a rank's SIGKILL to training resumed at one rank fewer under
    ``fleetmpirun --elastic`` (3 ranks, then 2), median of ``repeats`` runs."""
    times = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as folder:
            np_file = os.path.join(folder, "np")
            with open(np_file, "w") as f:
                f.write("2")
            command = [fleetmpirun(3)[0], "--elastic", "--np", "3", "--np_file", np_file,
                       ELASTIC_JOB, os.path.join(folder, "ckpt"), os.path.join(folder, "out"),
                       "10", "2", "2", "5"]
            done = subprocess.run(command, env=dict(os.environ, FLEETMPI_DEVICE="cpu"),
                                  capture_output=True, text=True, timeout=HANG_SECONDS)
            marks = {line.split()[0]: float(line.split()[1])
                     for line in done.stdout.splitlines()
                     if line.startswith(("FAULT ", "RESUMED "))}
            if done.returncode == 0 and len(marks) == 2:
                times.append(marks["RESUMED"] - marks["FAULT"])
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="",
                        help="run only the scenarios whose name contains this text")
    parser.add_argument("--elastic", action="store_true",
                        help="measure only the time from a killed rank to training resumed "
                             "under fleetmpirun --elastic")
    args = parser.parse_args()
    if args.elastic:
        times = elastic_restart(args.repeats)
        print(f"fleetmpirun --elastic, 3 ranks, rank 2 killed, resumed at 2: fault to resumed "
              f"training {statistics.median(times):.2f} s (median of {len(times)} of "
              f"{args.repeats} runs that resumed; all: "
              f"{', '.join(f'{t:.2f}' for t in times)})")
        return
    print(f"{args.ranks} ranks, median of {args.repeats} runs; seconds from the fault to the "
          "launcher's exit")
    print("| scenario | launcher | exit status | fault to exit (s) | failing rank named |")
    print("| --- | --- | ---: | ---: | --- |")
    for name, job, extra, named in SCENARIOS:
        if args.only not in name:
            continue
        env = {k: v for k, v in os.environ.items() if k != "FLEETMPI_STALL_TIMEOUT"}
        env.update(FLEETMPI_DEVICE="cpu", **extra)
        for launcher, prefix in (("mpiexec", local_command(args.ranks) + [sys.executable]),
                                 ("fleetmpirun", fleetmpirun(args.ranks))):
            command = prefix + (job if job[0].endswith(".py") else [JOB] + job)
            results = []
            for _ in range(args.repeats):
                with tempfile.TemporaryDirectory(prefix="faults-") as folder:
                    results.append(run(command, dict(env, FAILURE_JOB_DIR=folder)))
            statuses = sorted({"hung" if s is None else str(s) for s, _, _ in results})
            times = [t for _, t, _ in results if t is not None]
            seconds = f"{statistics.median(times):.2f}" if times else "-"
            text = named[launcher]
            if text.startswith("no: "):
                said = text
            else:
                said = "yes" if all(text in out for _, _, out in results) else "no"
            print(f"| {name} | {launcher} | {', '.join(statuses)} | {seconds} | {said} |")


if __name__ == "__main__":
    main()

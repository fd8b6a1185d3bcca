"""A real multi-host launch on the test hosts: MPICH's hydra, and ``fleetmpirun --ips``, start
ranks on h1 and h2 through the namespace launcher in ssh's place; every rank runs on the host
it was placed on (its hostname and network namespace), ``fleet.init`` finds 2 nodes of 2
ranks, and no process is left on either host when the job ends."""
import os
import sys

from fleetmpi.launch.mpi_command import find_mpiexec

from cluster_runs import JOB, check_placement, rank_reports, run_on


def test_mpiexec_starts_ranks_on_both_hosts(cluster, tmp_path):
    run_on(cluster, "h1", [find_mpiexec(), *cluster.hydra_arguments(), "-hosts", "h1,h2",
                           "-n", "4", sys.executable, JOB, "place", str(tmp_path)])
    check_placement(cluster, rank_reports(tmp_path, 4), per_host=2)


def test_fleetmpirun_starts_ranks_on_both_hosts(cluster, tmp_path):
    fleetmpirun = os.path.join(os.path.dirname(sys.executable), "fleetmpirun")
    reports, logs = tmp_path / "reports", tmp_path / "logs"
    reports.mkdir()
    run_on(cluster, "h1", [fleetmpirun, "--ips", "h1,h2", "--np", "4",
                           "--mpi_args", " ".join(cluster.hydra_arguments()),
                           "--log_dir", str(logs), JOB, "place", str(reports)])
    check_placement(cluster, rank_reports(reports, 4), per_host=2)

"""Collectives across the test hosts at 2 hosts x 2 ranks: the link carries the traffic
between hosts and not the traffic within one, and the hierarchical allreduce and data-parallel
training equal one process on every rank."""
import sys

from fleetmpi.launch.mpi_command import find_mpiexec

from cluster_runs import JOB, check_two_nodes_of_two, rank_reports, run_on

# Far below the 8 MB an allreduce moves, far above the few messages of a barrier.
LINK_NOISE = 1 << 20


def run_job(cluster, folder, mode):
    run_on(cluster, "h1", [find_mpiexec(), *cluster.hydra_arguments(), "-hosts", "h1,h2",
                           "-n", "4", "-ppn", "2", sys.executable, JOB, mode, str(folder)])
    reports = rank_reports(folder, 4)
    check_two_nodes_of_two(cluster, reports)
    return reports


def test_the_link_carries_traffic_between_hosts_only(cluster, tmp_path):
    for rank, report in run_job(cluster, tmp_path, "traffic").items():
        assert report["local"] < LINK_NOISE, (rank, report)
        assert report["cross"] >= report["nbytes"], (rank, report)


def test_hierarchical_allreduce_and_data_parallel_equal_one_process(cluster, tmp_path):
    for rank, report in run_job(cluster, tmp_path, "train").items():
        assert report["checked"] == ["hierarchical_sums", "data_parallel"], (rank, report)

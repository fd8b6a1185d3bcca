"""Collectives across the test hosts at 2 hosts x 2 and 2 hosts x 3 ranks: the link carries the
traffic between hosts and not the traffic within one, and the hierarchical allreduce and
data-parallel training equal one process on every rank."""
import sys

import pytest

from fleetmpi.launch.mpi_command import find_mpiexec

from cluster_runs import JOB, check_placement, rank_reports, run_on

# Far below the 8 MB an allreduce moves, far above the few messages of a barrier.
LINK_NOISE = 1 << 20


def run_job(cluster, folder, mode, per_host):
    run_on(cluster, "h1", [find_mpiexec(), *cluster.hydra_arguments(), "-hosts", "h1,h2",
                           "-n", str(2 * per_host), "-ppn", str(per_host), sys.executable, JOB,
                           mode, str(folder)])
    reports = rank_reports(folder, 2 * per_host)
    check_placement(cluster, reports, per_host)
    return reports


def test_the_link_carries_traffic_between_hosts_only(cluster, tmp_path):
    for rank, report in run_job(cluster, tmp_path, "traffic", per_host=2).items():
        assert report["local"] < LINK_NOISE, (rank, report)
        assert report["cross"] >= report["nbytes"], (rank, report)


@pytest.mark.parametrize("per_host", [2, 3])
def test_hierarchical_allreduce_and_data_parallel_equal_one_process(cluster, tmp_path,
                                                                   per_host):
    for rank, report in run_job(cluster, tmp_path, "train", per_host).items():
        assert report["checked"] == ["hierarchical_sums", "data_parallel"], (rank, report)

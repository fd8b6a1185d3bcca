"""Jobs on the test hosts (``hosts.Cluster``): run a command on a host to its end, and read
and check the reports the ranks of ``cluster_job.py`` write."""
import json
import os

from job_limits import run_to_end

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster_job.py")
# Variables of an enclosing launcher, or fleetmpi settings of the test run, that the job's
# ranks must not inherit (FLEETMPI_LOCAL_SIZE would stand in for the node detection tested).
FOREIGN_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "OMPI_", "SLURM_", "MPIR_", "UCX_", "FI_",
                    "FLEETMPI_")


def job_environment():
    environ = {name: value for name, value in os.environ.items()
               if not name.startswith(FOREIGN_PREFIXES)}
    return dict(environ, FLEETMPI_DEVICE="cpu", FLEETMPI_NUM_THREADS="1")


def run_on(cluster, host, argv):
    """Run ``argv`` on ``host`` to its end (killed with its process group past
    ``HANG_SECONDS``, ``job_limits.run_to_end``), checking that it exited 0."""
    code, out, err = run_to_end(cluster.command(host, argv), env=job_environment())
    assert code == 0, f"{argv} exited {code}:\n{out}\n{err}"


def rank_reports(folder, size):
    """The report of every rank (``cluster_job.py``) in ``folder``, by rank."""
    reports = {rank: json.loads((folder / f"rank.{rank}.json").read_text())
               for rank in range(size)}
    assert sorted(os.listdir(folder)) == sorted(f"rank.{rank}.json" for rank in range(size))
    return reports


def check_placement(cluster, reports, per_host):
    """Every rank on a host of the cluster (its hostname and network namespace), ``per_host``
    ranks on each of h1 and h2, fleet's topology the same, and nothing left on the hosts."""
    namespaces = {f"net:[{os.stat(os.path.join('/run/netns', host.namespace)).st_ino}]":
                  host.name for host in cluster.hosts}
    by_host = {}
    for rank, report in reports.items():
        assert report["size"] == 2 * per_host
        assert namespaces.get(report["net"]) == report["hostname"], (rank, report)
        by_host.setdefault(report["hostname"], []).append(rank)
    assert sorted(by_host) == ["h1", "h2"] and all(len(r) == per_host for r in by_host.values())
    first = sorted(by_host, key=lambda name: min(by_host[name]))
    for name, ranks in by_host.items():
        for local_rank, rank in enumerate(sorted(ranks)):
            assert reports[rank]["node_num"] == 2 and reports[rank]["local_size"] == per_host
            assert reports[rank]["node_index"] == first.index(name)
            assert reports[rank]["local_rank"] == local_rank
    assert cluster.processes() == []

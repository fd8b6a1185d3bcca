"""What a rank of a job across the test hosts runs; each rank writes its report, a JSON
object, to ``DIR/rank.<rank>.json`` (the ranks' output streams interleave).

    cluster_job.py place DIR   where the rank runs and what ``fleet.init`` made of it
    cluster_job.py traffic DIR that, with the bytes the host's link carried during an
                               allreduce within the host and during one between hosts
    cluster_job.py train DIR   that, after the hierarchical allreduce and data-parallel
                               training with and without it equal one process's results

A failed check raises, so the rank exits non-zero and writes no report.
"""
import json
import os
import socket
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: the multi-rank tests' helpers

import numpy as np  # noqa: E402

import fleetmpi as fleet  # noqa: E402


def place():
    """This rank's place: what a test compares with the hosts it was started on."""
    fleet.init(is_collective=True)
    return {"hostname": socket.gethostname(), "net": os.readlink("/proc/self/ns/net"),
            "node_num": fleet.node_num(), "node_index": fleet.node_index(),
            "local_size": fleet.local_size(), "local_rank": fleet.local_rank()}


def link_bytes():
    """Bytes received plus sent so far on this host's link (``/sys`` is the host's own under
    ``ip netns exec``)."""
    stats = "/sys/class/net/eth0/statistics/"
    return sum(int(open(stats + name).read()) for name in ("rx_bytes", "tx_bytes"))


def traffic(nbytes=8 << 20):
    """``place`` with ``link_bytes`` moved by an allreduce of ``nbytes`` over the ranks of this
    host (``local``) and over one rank of each host (``cross``), each checked; the world
    waits between the two, so the link counts one kind at a time."""
    from mpi4py import MPI

    report = place()
    topology = fleet.world.topology()
    for name, comm in (("local", topology.local), ("cross", topology.cross)):
        data = np.full(nbytes // 8, comm.Get_rank() + 1.0)
        topology.world.Barrier()
        before = link_bytes()
        comm.Allreduce(MPI.IN_PLACE, data)
        report[name] = link_bytes() - before
        topology.world.Barrier()
        size = comm.Get_size()
        np.testing.assert_array_equal(data, size * (size + 1) / 2, err_msg=name)
    return dict(report, nbytes=nbytes)


def hierarchical_sums():
    """The hierarchical allreduce of every dtype and op equals one process and MPI's own."""
    from comm_support import all_data, single_process, tolerance
    from fleetmpi.comm import Communicator

    comm = Communicator(fleet.world.topology(), chunk_bytes=128)
    try:
        for case, n in enumerate((1, 5, 1000)):
            for dtype in (np.float32, np.float64, np.int64):
                stack = all_data(comm.size, n, dtype, case)
                for op in ("sum", "mean", "max"):
                    got = comm.allreduce(stack[comm.rank], op=op, algorithm="hierarchical")
                    want = single_process(stack, op)
                    rtol, atol = tolerance(dtype, comm.size)
                    np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol,
                                               atol=atol, err_msg=f"{op} {dtype} n={n}")
    finally:
        comm.free()


def data_parallel(strategy_name, opt_name="momentum"):
    """Data-parallel training as ``test_data_parallel.test_n_ranks_match_one_process`` runs
    it, against its one-process reference."""
    from fleetmpi import nn
    from fleetmpi.core import backend
    from test_data_parallel import (GLOBAL_BATCH, OPTIMIZERS, STEPS, STRATEGIES, global_batch,
                                    make_model, reference_parameters)

    size, rank = fleet.worker_num(), fleet.worker_index()
    strategy = fleet.DistributedStrategy()
    for key, value in STRATEGIES[strategy_name].items():
        setattr(strategy, key, value)
    backend.manual_seed(0)
    model = fleet.distributed_model(make_model())
    opt = fleet.distributed_optimizer(OPTIMIZERS[opt_name](model.parameters()), strategy)
    share = GLOBAL_BATCH // size
    for step in range(STEPS):
        x, y = global_batch(step)
        opt.minimize(model, nn.CrossEntropyLoss(), x[rank * share:(rank + 1) * share],
                     y[rank * share:(rank + 1) * share])
    expected = reference_parameters(opt_name, {})
    for name, value in model.state_dict().items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-10, atol=1e-12,
                                   err_msg=f"{strategy_name}: {name} on rank {rank}")


def train():
    report = place()
    hierarchical_sums()
    for strategy_name in ("default", "hierarchical"):
        data_parallel(strategy_name)
    return dict(report, checked=["hierarchical_sums", "data_parallel"])


if __name__ == "__main__":
    mode, folder = sys.argv[1:]
    report = dict({"place": place, "traffic": traffic, "train": train}[mode](), rank=fleet.worker_index(),
                  size=fleet.worker_num())
    with open(os.path.join(folder, f"rank.{report['rank']}.json"), "w") as out:
        json.dump(report, out)

"""``fleet.util``: reductions and gathers for metrics, barriers, file shards and printing on
one rank; at one process and, marked ``mpi``, on every rank of a collective world."""
import numpy as np
import pytest
from mpi4py import MPI

import fleetmpi as fleet


def test_get_file_shard_gives_each_worker_consecutive_files(monkeypatch):
    fleet.init()
    files = [f"part-{i}" for i in range(7)]
    shards = []
    for index in range(3):
        monkeypatch.setattr(fleet.world, "worker_index", lambda index=index: index)
        monkeypatch.setattr(fleet.world, "worker_num", lambda: 3)
        shards.append(fleet.util.get_file_shard(files))
    assert shards == [files[0:3], files[3:5], files[5:7]]
    with pytest.raises(TypeError, match="files must be a list of file names, not str"):
        fleet.util.get_file_shard("part-0")


def test_util_refuses_bad_arguments():
    fleet.init()
    with pytest.raises(ValueError, match="mode='mean' is not allowed; allowed: 'sum', 'min', "
                                         "'max'"):
        fleet.util.all_reduce(1, mode="mean")
    with pytest.raises(ValueError, match="comm_world='trainers' is not allowed"):
        fleet.util.barrier(comm_world="trainers")
    with pytest.raises(ValueError, match="comm_world='server' takes the servers, and this "
                                         "process is a worker"):
        fleet.util.all_gather(1, comm_world="server")
    with pytest.raises(TypeError, match="takes numbers.*not str 'x'"):
        fleet.util.all_reduce("x")


@pytest.mark.mpi(min_size=2)
def test_util_reduces_gathers_and_shards_on_every_rank(capsys):
    fleet.init()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    values = np.array([rank + 1.0, -rank], dtype=np.float64)
    assert np.array_equal(fleet.util.all_reduce(values),
                          [size * (size + 1) / 2, -size * (size - 1) / 2])
    assert np.array_equal(fleet.util.all_reduce(values, mode="max"), [size, 0])
    assert np.array_equal(fleet.util.all_reduce(values, mode="min"), [1, -(size - 1)])
    total = fleet.util.all_reduce(rank, comm_world="all")
    assert total.shape == () and float(total) == size * (size - 1) // 2
    assert fleet.util.all_gather(rank * 10) == [10 * r for r in range(size)]
    gathered = fleet.util.all_gather(np.full(3, rank, dtype=np.int32))
    assert [g.tolist() for g in gathered] == [[r] * 3 for r in range(size)]
    fleet.util.barrier()
    files = [f"f{i}" for i in range(2 * size + 1)]
    mine = fleet.util.get_file_shard(files)
    everyone = comm.allgather(mine)
    assert sum(everyone, []) == files and len(everyone[0]) == 3
    capsys.readouterr()
    fleet.util.print_on_rank(f"hello from {rank}", size - 1)
    printed = capsys.readouterr().out
    assert printed == (f"hello from {rank}\n" if rank == size - 1 else "")

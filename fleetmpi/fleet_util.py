"""``fleet.util``: Paddle Fleet's helpers for metrics and file sharding, over the comm layer.

    fleet.util.all_reduce(correct, mode="sum")      # a NumPy array, the same on every rank
    fleet.util.all_gather(auc)                      # every rank's value, in rank order
    fleet.util.barrier()
    my_files = fleet.util.get_file_shard(files)     # this worker's consecutive share
    fleet.util.print_on_rank("epoch done", 0)

``comm_world`` is Paddle's: ``"worker"`` (the default: every rank of a collective job, the
workers of a parameter-server job), ``"server"`` (the servers) or ``"all"`` (every rank). The
values travel through a host-memory (MPI) ``fleetmpi.comm.Communicator`` of that group, so a
call some rank makes with another shape or dtype raises on every rank instead of hanging.
"""
import numbers

import numpy as np

from . import world

COMM_WORLDS = ("worker", "server", "all")
MODES = ("sum", "min", "max")


class UtilBase:
    """The object ``fleet.util`` is; one per process."""

    def __init__(self):
        self._communicators = {}

    def _communicator(self, comm_world):
        if comm_world not in COMM_WORLDS:
            raise ValueError(f"comm_world={comm_world!r} is not allowed; allowed: "
                             f"{', '.join(map(repr, COMM_WORLDS))}")
        roles = world.role_maker()
        if comm_world == "server" and not roles.is_server() or \
                comm_world == "worker" and not roles.is_worker():
            raise ValueError(f"comm_world={comm_world!r} takes the "
                             f"{comm_world}s, and this process is a "
                             f"{'server' if roles.is_server() else 'worker'}")
        if comm_world not in self._communicators:
            from .comm import Communicator, Topology

            if comm_world == "all" or roles.is_collective:
                mpi_comm = world.topology().world
            else:
                from .strategies.ps.runtime import role_communicator

                mpi_comm = role_communicator()
            self._communicators[comm_world] = Communicator(Topology(mpi_comm), transport="mpi")
        return self._communicators[comm_world]

    def all_reduce(self, input, mode="sum", comm_world="worker"):
        """The elementwise ``mode`` (``"sum"``, ``"min"``, ``"max"``) of ``input`` (a number,
        list or NumPy array) over the ranks of ``comm_world``, as a NumPy array of its shape."""
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not allowed; allowed: "
                             f"{', '.join(map(repr, MODES))}")
        x = _array(input, "all_reduce")
        return self._communicator(comm_world).allreduce(x.reshape(-1), op=mode).reshape(x.shape)

    def all_gather(self, input, comm_world="worker"):
        """Every rank's ``input`` in rank order, as a list: numbers for a number, NumPy arrays
        otherwise (all ranks give the same shape and dtype)."""
        x = _array(input, "all_gather")
        rows = self._communicator(comm_world).allgather(x, stack=True)
        return [row.item() for row in rows] if isinstance(input, numbers.Number) else list(rows)

    def barrier(self, comm_world="worker"):
        """Return once every rank of ``comm_world`` has called it."""
        self._communicator(comm_world).barrier()

    def get_file_shard(self, files):
        """This worker's share of ``files``: consecutive runs, the first ``len(files) %
        worker_num`` workers one file more, as Paddle splits them."""
        if not isinstance(files, list):
            raise TypeError(f"files must be a list of file names, not {type(files).__name__}")
        workers, index = world.worker_num(), world.worker_index()
        base, extra = divmod(len(files), workers)
        begin = index * base + min(index, extra)
        return files[begin:begin + base + (index < extra)]

    def print_on_rank(self, message, rank_id):
        """Print ``message`` on worker ``rank_id`` only."""
        if world.worker_index() == rank_id and world.role_maker().is_worker():
            print(message, flush=True)


def _array(value, call):
    array = np.asarray(value)
    if array.dtype == object or array.dtype.kind not in "biuf":
        raise TypeError(f"fleet.util.{call} takes numbers, lists of numbers or numeric NumPy "
                        f"arrays, not {type(value).__name__} {value!r}")
    if array.dtype.kind == "b":
        array = array.astype(np.int64)
    return np.asarray(array, order="C")   # keeps a 0-d array 0-d, as ascontiguousarray does not


# ``fleet.util``: the one instance, shared by the metrics' distributed ``accumulate``.
util = UtilBase()

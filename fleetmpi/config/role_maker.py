"""Roles and endpoints, as Paddle's role makers describe them.

A role maker says whether the job trains collectively (every rank a worker) or with
parameter servers, which role this process has, and the endpoints of the workers and the
servers. In fleetmpi an endpoint (``"ip:port"``) is a **label** that names one MPI rank: no
socket is ever opened on it, every message goes through MPI. Labels a job does not give are
made up by ``endpoint_labels``: rank ``r``'s label is ``127.0.0.1:<6170 + r>``.

The world's ranks are laid out as ``fleetmpirun --server_num S --worker_num W`` lays them out:
ranks ``0..W-1`` are workers (worker ``i`` is rank ``i``), ranks ``W..W+S-1`` are servers
(server ``j`` is rank ``W+j``). In collective mode worker ``i`` is rank ``i`` of ``N``.

* ``PaddleCloudRoleMaker(is_collective=True)`` (what ``fleet.init(is_collective=True)`` uses):
  the MPI world, or, where set, ``PADDLE_TRAINER_ENDPOINTS``, ``PADDLE_TRAINER_ID`` and
  ``PADDLE_CURRENT_ENDPOINT``, which must agree with it.
* ``PaddleCloudRoleMaker(is_collective=False)`` reads Paddle's parameter-server variables:
  ``TRAINING_ROLE`` (``TRAINER`` or ``PSERVER``), ``PADDLE_PSERVERS_IP_PORT_LIST``,
  ``PADDLE_TRAINERS_NUM`` (or the length of ``PADDLE_TRAINER_ENDPOINTS``), and
  ``PADDLE_TRAINER_ID`` on a trainer, ``POD_IP`` and ``PADDLE_PORT`` (its place in the server
  list) on a server. Without ``PADDLE_PSERVERS_IP_PORT_LIST`` it takes ``PADDLE_PSERVERS_NUM``
  and ``PADDLE_PSERVER_ID``.
* ``UserDefinedRoleMaker(current_id, role, worker_num, server_endpoints)`` takes them as
  arguments (``server_num`` instead of ``server_endpoints`` makes up the labels).

``bind`` checks the role against this process's MPI rank and the world size.
"""
import enum
import os

ENDPOINT_HOST = "127.0.0.1"
FIRST_PORT = 6170


class ModeError(RuntimeError, ValueError):
    """A call that this process's mode or role does not allow (``fleet.init_worker()`` in a
    collective job); a ValueError too, as Paddle raises."""


class Role(enum.IntEnum):
    """Paddle's ``fleet.Role``: ``WORKER`` trains, ``SERVER`` holds parameters."""

    WORKER = 1
    SERVER = 2


def endpoint_labels(count, first=0):
    """The made-up endpoint labels of ranks ``first .. first+count-1``."""
    return [f"{ENDPOINT_HOST}:{FIRST_PORT + first + i}" for i in range(count)]


def _count(name, value, least):
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, not {value!r}")
    return value


def _endpoints(name, value):
    """A list of ``"ip:port"`` strings from a list or a comma-separated string."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(e, str) for e in items):
        raise ValueError(f"{name} must be a list of 'ip:port' strings or one comma-separated "
                         f"string, not {value!r}")
    items = [e.strip() for e in items if e.strip()]
    for endpoint in items:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{name} holds {endpoint!r}, which is not of the form ip:port")
    if len(set(items)) != len(items):
        raise ValueError(f"{name} names an endpoint twice: {items}")
    return items


class RoleMakerBase:
    """A process's mode, role, index among the processes of that role, and the endpoints.

    ``current_id`` or ``worker_endpoints`` may be None until ``bind``: collective mode takes
    them from the MPI world, and so does a query before ``fleet.init``. Built with no arguments
    (as Paddle's base class) it is a collective worker whose place the MPI world decides."""

    def __init__(self, is_collective=True, role=Role.WORKER, current_id=None,
                 worker_endpoints=None, server_endpoints=()):
        if not isinstance(role, Role):
            raise ValueError(f"role must be fleetmpi.Role.WORKER or fleetmpi.Role.SERVER, "
                             f"not {role!r}")
        if is_collective and role is not Role.WORKER:
            raise ValueError("in collective mode every process is a worker; role=Role.SERVER "
                             "needs is_collective=False")
        self.is_collective = bool(is_collective)
        self.role = role
        self.current_id = None if current_id is None else _count("current_id", current_id, 0)
        self.worker_endpoints = worker_endpoints
        self.server_endpoints = list(server_endpoints)
        if not is_collective and not self.server_endpoints:
            raise ValueError("parameter-server mode needs at least one server: give "
                             "server_endpoints (or server_num)")
        if worker_endpoints is not None and current_id is not None:
            self._check_id()

    def _check_id(self):
        limit = self.worker_num() if self.is_worker() else self.server_num()
        if self.current_id >= limit:
            raise ValueError(f"current_id {self.current_id} is out of range for a "
                             f"{self.role.name.lower()}: there are {limit}")

    def _placed(self):
        """Fill in what the MPI world decides when ``bind`` has not yet run, so that a role
        maker answers before ``fleet.init`` as Paddle's does."""
        if self.worker_endpoints is None or self.current_id is None:
            from mpi4py import MPI

            self.bind(MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
        return self

    def worker_num(self):
        """The number of workers."""
        return len(self._placed().worker_endpoints)

    def server_num(self):
        """The number of servers (0 in collective mode)."""
        return len(self.server_endpoints)

    def worker_index(self):
        """This process's index among the processes of its role (Paddle's ``worker_index``
        answers a server's index too)."""
        return self._placed().current_id

    def server_index(self):
        """This process's index among the servers; a ModeError on a worker."""
        if not self.is_server():
            raise ModeError(f"server_index: this process is worker {self.worker_index()}, "
                            "not a server")
        return self.current_id

    def is_worker(self):
        return self.role is Role.WORKER

    def is_server(self):
        return self.role is Role.SERVER

    def is_first_worker(self):
        return self.is_worker() and self.worker_index() == 0

    def world_rank(self):
        """The MPI rank this role belongs to (see the module docstring)."""
        return self.current_id if self.is_worker() else self.worker_num() + self.current_id

    def bind(self, rank, size):
        """Fill in what the MPI world decides (collective mode) and raise ValueError unless
        this role fits the world of ``size`` ranks at ``rank``."""
        if self.worker_endpoints is None:
            self.worker_endpoints = endpoint_labels(size - self.server_num())
        if self.current_id is None:
            self.current_id = rank
        self._check_id()
        if size != self.worker_num() + self.server_num():
            raise ValueError(f"the role maker describes {self.worker_num()} worker(s) and "
                             f"{self.server_num()} server(s), but the MPI world has {size} "
                             f"rank(s); start {self.worker_num() + self.server_num()}")
        if rank != self.world_rank():
            raise ValueError(f"MPI rank {rank} cannot be {self.role.name.lower()} "
                             f"{self.current_id}: workers are ranks 0..{self.worker_num() - 1}"
                             + (f", servers ranks {self.worker_num()}.."
                                f"{self.worker_num() + self.server_num() - 1}"
                                if self.server_num() else ""))
        return self

    def current_endpoint(self):
        """This process's endpoint label."""
        ends = self.worker_endpoints if self.is_worker() else self.server_endpoints
        return ends[self.current_id]

    def __repr__(self):
        mode = "collective" if self.is_collective else "parameter-server"
        return (f"{type(self).__name__}({mode}, {self.role.name.lower()} {self.current_id}, "
                f"worker_num={len(self.worker_endpoints or ())}, "
                f"server_num={self.server_num()})")


class UserDefinedRoleMaker(RoleMakerBase):
    """Roles given by the script, as Paddle's: ``UserDefinedRoleMaker(current_id=0,
    role=Role.SERVER, worker_num=2, server_endpoints=["127.0.0.1:6001", "127.0.0.1:6002"])``.
    ``server_num=2`` instead of ``server_endpoints`` makes up the server labels;
    ``is_collective=True`` describes a collective job of ``worker_num`` workers."""

    def __init__(self, is_collective=False, init_gloo=False, current_id=0, role=Role.WORKER,
                 worker_num=1, server_endpoints=None, worker_endpoints=None, server_num=None):
        worker_num = _count("worker_num", worker_num, 1)
        if worker_endpoints is None:
            worker_endpoints = endpoint_labels(worker_num)
        else:
            worker_endpoints = _endpoints("worker_endpoints", worker_endpoints)
            if len(worker_endpoints) != worker_num:
                raise ValueError(f"worker_endpoints lists {len(worker_endpoints)} endpoint(s) "
                                 f"but worker_num is {worker_num}")
        if is_collective:
            if server_endpoints or server_num:
                raise ValueError("a collective job has no servers: leave server_endpoints "
                                 "and server_num out, or set is_collective=False")
            server_endpoints = []
        elif server_endpoints is None:
            server_num = _count("server_num", 1 if server_num is None else server_num, 1)
            server_endpoints = endpoint_labels(server_num, first=worker_num)
        else:
            server_endpoints = _endpoints("server_endpoints", server_endpoints)
            if server_num is not None and server_num != len(server_endpoints):
                raise ValueError(f"server_num={server_num!r} does not match server_endpoints, "
                                 f"which list {len(server_endpoints)}")
        super().__init__(is_collective, role, current_id, worker_endpoints, server_endpoints)


_ROLES = {"TRAINER": Role.WORKER, "PSERVER": Role.SERVER}


def _env_int(environ, name):
    text = environ.get(name, "")
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} must be an integer; start the job with "
                         "fleetmpirun --server_num S --worker_num W, or pass "
                         "fleet.init(role_maker=fleet.UserDefinedRoleMaker(...))") from None


def _env_endpoints(environ, name):
    text = environ.get(name, "")
    return _endpoints(name, text) if text.strip() else None


class PaddleCloudRoleMaker(RoleMakerBase):
    """Roles from the launcher's environment variables (see the module docstring).
    ``environ`` (default ``os.environ``) is read once, here."""

    def __init__(self, is_collective=False, environ=None, **kwargs):
        unknown = set(kwargs) - {"init_gloo", "path"}
        if unknown:
            raise TypeError(f"PaddleCloudRoleMaker got unexpected argument(s) "
                            f"{sorted(unknown)}; it takes is_collective (and Paddle's "
                            "init_gloo and path, which change nothing over MPI)")
        environ = os.environ if environ is None else environ
        if is_collective:
            self._init_collective(environ)
        else:
            self._init_parameter_server(environ)

    def _init_collective(self, environ):
        self._launched = (_env_endpoints(environ, "PADDLE_TRAINER_ENDPOINTS"),
                          environ.get("PADDLE_TRAINER_ID", ""),
                          environ.get("PADDLE_CURRENT_ENDPOINT", ""))
        super().__init__(True, Role.WORKER, None, None, [])

    def bind(self, rank, size):
        """Collective mode: the launcher's endpoints where they describe this job (as many as
        the MPI world has ranks; otherwise they were left over from another job, as
        ``fleetmpi.launcher_check`` judges), and then ``PADDLE_TRAINER_ID`` and
        ``PADDLE_CURRENT_ENDPOINT`` must name this rank."""
        if self.is_collective and self.worker_endpoints is None:
            workers, trainer_id, current = self._launched
            if workers is not None and len(workers) == size:
                if trainer_id not in ("", str(rank)):
                    raise ValueError(f"PADDLE_TRAINER_ID={trainer_id!r} but this process is "
                                     f"MPI rank {rank}")
                if current not in ("", workers[rank]):
                    raise ValueError(f"PADDLE_CURRENT_ENDPOINT={current!r} but MPI rank {rank} "
                                     f"is {workers[rank]!r} in PADDLE_TRAINER_ENDPOINTS")
                self.worker_endpoints = workers
        return super().bind(rank, size)

    def _init_parameter_server(self, environ):
        text = environ.get("TRAINING_ROLE", "")
        if text not in _ROLES:
            raise ValueError(f"TRAINING_ROLE={text!r} must be TRAINER or PSERVER in "
                             "parameter-server mode; start the job with fleetmpirun "
                             "--server_num S --worker_num W")
        role = _ROLES[text]
        workers = _env_endpoints(environ, "PADDLE_TRAINER_ENDPOINTS")
        worker_num = _env_int(environ, "PADDLE_TRAINERS_NUM") \
            if environ.get("PADDLE_TRAINERS_NUM", "") != "" or workers is None else len(workers)
        if workers is None:
            workers = endpoint_labels(_count("PADDLE_TRAINERS_NUM", worker_num, 1))
        elif len(workers) != worker_num:
            raise ValueError(f"PADDLE_TRAINERS_NUM={worker_num} but PADDLE_TRAINER_ENDPOINTS "
                             f"lists {len(workers)} endpoint(s)")
        servers = _env_endpoints(environ, "PADDLE_PSERVERS_IP_PORT_LIST")
        if servers is None:
            server_num = _count("PADDLE_PSERVERS_NUM", _env_int(environ, "PADDLE_PSERVERS_NUM"),
                                1)
            servers = endpoint_labels(server_num, first=len(workers))
        if role is Role.WORKER:
            current_id = _env_int(environ, "PADDLE_TRAINER_ID")
        elif environ.get("POD_IP", "") != "" and "PADDLE_PSERVERS_IP_PORT_LIST" in environ:
            current = f"{environ['POD_IP']}:{environ.get('PADDLE_PORT', '')}"
            if current not in servers:
                raise ValueError(f"POD_IP:PADDLE_PORT = {current!r} is not in "
                                 f"PADDLE_PSERVERS_IP_PORT_LIST {','.join(servers)}")
            current_id = servers.index(current)
        else:
            current_id = _env_int(environ, "PADDLE_PSERVER_ID")
        super().__init__(False, role, current_id, workers, servers)

"""Roles of parameter-server mode: which ranks are workers (trainers) and which are servers.

The world's ranks are laid out as ``fleetmpirun --server_num S --worker_num W`` lays them out:
ranks ``0..W-1`` are workers (worker ``i`` is rank ``i``), ranks ``W..W+S-1`` are servers
(server ``j`` is rank ``W+j``). A role maker says which one this process is:

* ``PaddleCloudRoleMaker`` (the default of ``fleet.init(is_collective=False)``) reads the
  launcher's variables ``TRAINING_ROLE`` (``TRAINER`` or ``PSERVER``), ``PADDLE_TRAINER_ID``,
  ``PADDLE_PSERVER_ID``, ``PADDLE_TRAINERS_NUM`` and ``PADDLE_PSERVERS_NUM``;
* ``UserDefinedRoleMaker(current_id, role, worker_num, server_num)`` takes them as arguments.

Either way the role must agree with this process's MPI rank, which ``check_world`` verifies.
"""
import enum
import os


class Role(enum.IntEnum):
    """Paddle's ``fleet.Role``: ``WORKER`` trains, ``SERVER`` holds parameters."""

    WORKER = 1
    SERVER = 2


def _count(name, value, least):
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, not {value!r}")
    return value


class RoleMakerBase:
    """A process's role, its index among the processes of that role, and the two counts."""

    def __init__(self, current_id, role, worker_num, server_num):
        if not isinstance(role, Role):
            raise ValueError(f"role must be fleetmpi.Role.WORKER or fleetmpi.Role.SERVER, "
                             f"not {role!r}")
        self.role = role
        self.worker_num = _count("worker_num", worker_num, 1)
        self.server_num = _count("server_num", server_num, 1)
        limit = self.worker_num if role is Role.WORKER else self.server_num
        self.current_id = _count("current_id", current_id, 0)
        if current_id >= limit:
            raise ValueError(f"current_id {current_id} is out of range for a "
                             f"{role.name.lower()}: there are {limit}")

    def is_worker(self):
        return self.role is Role.WORKER

    def is_server(self):
        return self.role is Role.SERVER

    def world_rank(self):
        """The MPI rank this role belongs to (see the module docstring)."""
        return self.current_id if self.is_worker() else self.worker_num + self.current_id

    def check_world(self, rank, size):
        """Raise unless this role fits the MPI world of ``size`` ranks at ``rank``."""
        if size != self.worker_num + self.server_num:
            raise ValueError(f"the role maker describes {self.worker_num} worker(s) and "
                             f"{self.server_num} server(s), but the MPI world has {size} "
                             f"rank(s); start {self.worker_num + self.server_num}")
        if rank != self.world_rank():
            raise ValueError(f"MPI rank {rank} cannot be {self.role.name.lower()} "
                             f"{self.current_id}: workers are ranks 0..{self.worker_num - 1}, "
                             f"servers ranks {self.worker_num}.."
                             f"{self.worker_num + self.server_num - 1}")

    def __repr__(self):
        return (f"{type(self).__name__}({self.role.name.lower()} {self.current_id}, "
                f"worker_num={self.worker_num}, server_num={self.server_num})")


class UserDefinedRoleMaker(RoleMakerBase):
    """Roles given by the script: ``UserDefinedRoleMaker(current_id=0, role=Role.SERVER,
    worker_num=2, server_num=2)``."""

    def __init__(self, current_id=0, role=Role.WORKER, worker_num=1, server_num=1):
        super().__init__(current_id, role, worker_num, server_num)


_ROLES = {"TRAINER": Role.WORKER, "PSERVER": Role.SERVER}


def _env_int(environ, name):
    text = environ.get(name, "")
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} must be an integer; start the job with "
                         "fleetmpirun --server_num S --worker_num W, or pass "
                         "fleet.init(role_maker=fleet.UserDefinedRoleMaker(...))") from None


class PaddleCloudRoleMaker(RoleMakerBase):
    """Roles from the launcher's environment variables (see the module docstring)."""

    def __init__(self, is_collective=False, environ=None):
        environ = os.environ if environ is None else environ
        text = environ.get("TRAINING_ROLE", "")
        if text not in _ROLES:
            raise ValueError(f"TRAINING_ROLE={text!r} must be TRAINER or PSERVER in "
                             "parameter-server mode; start the job with fleetmpirun "
                             "--server_num S --worker_num W")
        role = _ROLES[text]
        id_name = "PADDLE_TRAINER_ID" if role is Role.WORKER else "PADDLE_PSERVER_ID"
        super().__init__(_env_int(environ, id_name), role,
                         _env_int(environ, "PADDLE_TRAINERS_NUM"),
                         _env_int(environ, "PADDLE_PSERVERS_NUM"))

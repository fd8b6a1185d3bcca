"""The process-wide side of parameter-server mode: the roles, the communicators, and the
``fleet`` calls ``init_server``, ``run_server``, ``init_worker``, ``stop_worker`` and
``save_persistables``.

``fleet.init(is_collective=False)`` (``join``) checks the role against the MPI world and makes
two communicators: a duplicate of the world that carries every parameter-server message (so no
message can match a collective's or the script's own), and the workers' communicator for
``barrier_worker``. A script then builds its model and optimizer the same way on every rank,
calls ``fleet.distributed_model(model)`` and ``fleet.distributed_optimizer(...)``; servers call
``init_server()`` and ``run_server()``, workers ``init_worker()``, train, and ``stop_worker()``.
"""
from fleetmpi.core import job
from fleetmpi.core.log import logger
from fleetmpi.config.role_maker import ModeError

_comm = None
_workers = None
_model = None
_optimizer = None
_server = None
_client = None


def join(roles, topology):
    """Parameter-server mode for this process (``fleet.init``, after ``roles.bind``): the
    communicators."""
    global _comm, _workers
    _comm = topology.world.Dup()
    _workers = topology.world.Split(color=0 if roles.is_worker() else 1, key=topology.rank)
    logger.info("parameter-server mode: %r", roles)


def _roles(call):
    roles = job.roles()
    if roles is None:
        raise ModeError(f"fleet.{call}() belongs to parameter-server mode; start with "
                           "fleet.init(is_collective=False) or a role_maker")
    return roles


def worker_communicator():
    _roles("barrier_worker")
    return _workers


def role_communicator():
    """The MPI communicator of the ranks of this process's role: the workers, or the
    servers (parameter-server mode)."""
    return _workers


def is_server():
    """True on a server of parameter-server mode."""
    return job.role_maker().is_server()


def is_worker():
    """True on a worker, which every rank of a collective job is."""
    return job.role_maker().is_worker()


def server_num():
    """The number of servers (0 in collective mode)."""
    return job.role_maker().server_num()


def server_index():
    """This server's index among the servers; -1 on a worker."""
    return job.role_maker().current_id if is_server() else -1


def register_model(model):
    """``fleet.distributed_model`` in parameter-server mode: remember the model whose sparse
    tables the servers hold and whose parameters the workers pull."""
    global _model
    _model = model
    return model


def make_optimizer(optimizer, strategy):
    """``fleet.distributed_optimizer`` in parameter-server mode."""
    global _optimizer
    from .worker import ParameterServerOptimizer

    _optimizer = ParameterServerOptimizer(optimizer, strategy, _running_client, _model_tables)
    return _optimizer


def sparse_tables(model):
    """The ``SparseTable`` of every ``Embedding(sparse=True)`` of ``model``, in layer order."""
    return [layer.table for _, layer in [("", model)] + model.named_sublayers()
            if getattr(layer, "sparse", False) is True and hasattr(layer, "table")]


def _model_tables():
    """The sparse tables of the model ``distributed_model`` registered (none before)."""
    return [] if _model is None else sparse_tables(_model)


def _ready(call, role):
    roles = _roles(call)
    if (role == "server") != roles.is_server():
        raise ModeError(f"fleet.{call}() runs on a {role}, and this process is "
                           f"{roles.role.name.lower()} {roles.current_id}")
    if _model is None or _optimizer is None:
        raise RuntimeError(f"fleet.{call}() needs fleet.distributed_model(model) and "
                           "fleet.distributed_optimizer(optimizer, strategy) first")
    return roles


def init_server(dirname=None):
    """Build this server's blocks and table shards (from the model as built on this rank),
    or load them from the shards saved into ``dirname``."""
    global _server
    from .server import Server
    from .server_state import ServerState
    from .shards import load_shard

    roles = _ready("init_server", "server")
    state = ServerState(_optimizer.inner.parameters(), sparse_tables(_model), _optimizer.inner,
                        roles.current_id, roles.server_num())
    if dirname is not None:
        arrays, meta = load_shard(dirname, roles.current_id, roles.server_num())
        state.load(arrays, meta, f"the shard of server {roles.current_id} in {dirname}")
    _server = Server(_comm, state, _optimizer.mode, roles.worker_num())


def run_server(save_dirname=None):
    """Serve until every worker has stopped (or, in async/GEO, left); then, with
    ``save_dirname``, save this server's shard there. Returns the server's report (updates,
    pushes per worker, staleness, workers lost)."""
    from .shards import save_shard

    _roles("run_server")
    if _server is None:
        raise RuntimeError("fleet.run_server() needs fleet.init_server() first")
    report = _server.serve()
    if save_dirname is not None:
        state = _server.state
        report["saved"] = save_shard(save_dirname, state.server, state.server_num,
                                     state.to_arrays(), state.meta())
    return report


def init_worker():
    """Connect this worker to the servers: take their parameters into the model, and serve
    the model's sparse tables from them."""
    global _client
    from .worker import Client

    roles = _ready("init_worker", "worker")
    tables = sparse_tables(_model)
    _client = Client(_comm, roles, _optimizer.inner.parameters(), tables, _optimizer.mode,
                     _optimizer.inner)
    for table in tables:
        table.source = _client
    _client.pull_all()


def _running_client(running=True):
    if _client is not None and not running:
        return _client
    if _client is None or _client.stopped:
        raise RuntimeError("a worker trains between fleet.init_worker() and "
                           "fleet.stop_worker()")
    return _client


def stop_worker():
    """Push what GEO has not pushed yet, and tell every server this worker is done."""
    _roles("stop_worker")
    client = _running_client()
    _optimizer.flush()
    client.stop()
    for table in sparse_tables(_model):
        table.source = None


def save_persistables(dirname):
    """Ask every server to save its shard into ``dirname`` now (from one worker); returns
    the paths written."""
    _roles("save_persistables")
    return _running_client().save(dirname)

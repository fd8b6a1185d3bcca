"""A worker's side: the optimizer ``fleet.distributed_optimizer`` returns in parameter-server
mode, and the client that talks to the servers.

A worker trains with either idiom: ``opt.minimize(model, loss_fn, x, y)`` runs one step
(``fleetmpi.optimizer.step``: gradients cleared, forward, backward, then the update stage),
and Paddle dygraph's ``loss.backward(); opt.step(); opt.clear_grad()`` runs the update stage
on the gradients backward accumulated. Sparse lookups are recorded operations whose backward
leaves the touched rows' gradient in their ``SparseTable``. The update stage, instead of
updating locally: synchronous and asynchronous training push the gradients of every block
(and of the sparse rows the batch touched) to their servers and take back the servers'
parameters; GEO updates locally with the script's optimizer and every ``k_steps`` steps
pushes ``(parameters - parameters at the last exchange) / worker_num`` and takes back the
merged parameters.
"""
import atexit
import time

import numpy as np

from fleetmpi.autograd import as_array
from fleetmpi.core import backend, failure
from fleetmpi.optimizer import Optimizer, StepContext, StepHook, run_step
from fleetmpi.optimizer.step import finish_step, minimize_loss
from fleetmpi.strategies.configs import AsyncConfig
from . import wire
from .blocks import plan_blocks, split_by_owner
from .mode import GEO, SYNC, training_mode
from .server import timeout_seconds
from .server_state import model_signature


class ServerError(RuntimeError):
    """A server stopped or did not answer."""


class Client:
    """Talks to the ``server_num`` servers (ranks ``worker_num..``) for one worker."""

    def __init__(self, comm, roles, parameters, tables, mode, inner, timeout=None):
        self.comm = comm
        self.worker = roles.current_id
        self.worker_num = roles.worker_num()
        self.server_num = roles.server_num()
        self.parameters = parameters
        self.tables = tables
        self.mode = mode
        self.inner = inner
        # twice the servers' bound: a server that gives up on a step says so before this
        self.timeout = 2 * (timeout_seconds() if timeout is None else timeout)
        self.signature = model_signature(parameters, tables)
        blocks = plan_blocks([p.size for p in parameters], self.server_num)
        self.blocks = [[b for b in blocks if b.server == s] for s in range(self.server_num)]
        self.versions = [0] * self.server_num
        self.old = None
        self.caches = [RowCache(t) for t in tables] if mode == GEO else None
        self.stopped = False
        self.hung = None  # (server, seconds) of a server that did not answer
        self.steps = 0
        self.staleness = []
        self.last_pulled = [np.zeros(0, np.int64) for _ in tables]
        self.last_pushed = [np.zeros(0, np.int64) for _ in tables]
        atexit.register(self._leave_if_running)
        if mode != SYNC:
            failure.leave_instead(self._leave_after_error)

    def rank(self, server):
        return self.worker_num + server

    # -- messages ---------------------------------------------------------------------------
    def _request(self, server, kind, arrays=(), **header):
        data = wire.encode(kind, arrays, **header)
        return wire.send(self.comm, data, self.rank(server), wire.TAG_REQUEST), data

    def _answer(self, server):
        deadline = time.monotonic() + self.timeout
        message = wire.receive(self.comm, self.rank(server), wire.TAG_REPLY, deadline)
        if message is None:
            self.hung = (server, self.timeout)
            raise ServerError(f"server {server} (rank {self.rank(server)}) did not answer "
                              f"worker {self.worker} within {self.timeout:g} s")
        if message.kind == wire.Kind.ERROR:
            raise ServerError(message.text())
        self.versions[server] = message.version
        return message

    def _exchange(self, requests):
        """Send ``{server: (kind, arrays, header)}``, then wait for every answer."""
        sent = [self._request(s, kind, arrays, **header)
                for s, (kind, arrays, header) in requests.items()]
        answers = {s: self._answer(s) for s in requests}
        for request, _ in sent:
            request.Wait()
        return answers

    def _block_view(self, block, field):
        flat = as_array(getattr(self.parameters[block.param], field)).reshape(-1)
        return flat[block.start:block.stop]

    def _take_values(self, answers):
        for server, message in answers.items():
            for block, value in zip(self.blocks[server], message.arrays):
                self._block_view(block, "data")[...] = backend.asarray(value)
        if self.mode == GEO:
            self.old = [backend.to_numpy(p.data).copy() for p in self.parameters]

    # -- the calls of a step ----------------------------------------------------------------
    def pull_all(self):
        """The servers' dense parameters into the model (``init_worker``)."""
        answers = self._exchange({s: (wire.Kind.PULL, [self.signature], {})
                                  for s in range(self.server_num)})
        self._take_values(answers)

    def lookup(self, table, ids):
        """Rows ``ids`` (sorted, distinct) of ``table``: the ``SparseTable`` source."""
        t = self.tables.index(table)
        if self.caches is not None:
            rows = self.caches[t].lookup(ids, self._pull_rows(t))
            self.last_pulled[t] = self.caches[t].last_pulled
            return rows
        self.last_pulled[t] = ids
        return self._pull_rows(t)(ids)

    def _pull_rows(self, t):
        def pull(ids):
            rows = np.empty((len(ids), self.tables[t].dim), dtype=self.tables[t].dtype)
            parts = [(s, where) for s, where in split_by_owner(ids, self.server_num)
                     if len(where)]
            answers = self._exchange({s: (wire.Kind.PULL_ROWS, [ids[where]], {"extra": t})
                                      for s, where in parts})
            for s, where in parts:
                rows[where] = answers[s].arrays[0].reshape(len(where), -1)
            return rows
        return pull

    def push(self, dense, sparse, step, lr):
        """Push per-block arrays ``dense`` (a function of a block) and per-table ``(ids,
        values)``; take back the parameters."""
        requests = {}
        splits = [split_by_owner(ids, self.server_num) for ids, _ in sparse]
        for s in range(self.server_num):
            arrays = [dense(b) for b in self.blocks[s]]
            for (ids, values), parts in zip(sparse, splits):
                where = parts[s][1]
                arrays += [ids[where], values[where]]
            requests[s] = (wire.Kind.PUSH, arrays,
                           {"step": step, "version": self.versions[s], "lr": lr})
        for t, (ids, _) in enumerate(sparse):
            self.last_pushed[t] = ids
        answers = self._exchange(requests)
        if self.mode == "async":
            self.staleness.append(max(m.extra for m in answers.values()))
        self._take_values(answers)

    def push_gradients(self, step, lr):
        grads = [(t.grad_ids if t.grad_ids is not None else np.zeros(0, np.int64),
                  t.grad_values if t.grad_values is not None
                  else np.zeros((0, t.dim), t.dtype)) for t in self.tables]
        self.push(lambda b: backend.to_numpy(self._block_view(b, "grad")), grads, step,
                  lr)
        for t in self.tables:
            t.clear_gradient()

    def push_deltas(self, step):
        """GEO: push what changed since the last exchange, take back the merged values."""
        scale = 1.0 / self.worker_num

        def delta(block):
            now = backend.to_numpy(self._block_view(block, "data"))
            before = self.old[block.param].reshape(-1)[block.start:block.stop]
            return (now - before) * np.asarray(scale, dtype=now.dtype)
        sparse = [cache.deltas(scale) for cache in self.caches]
        self.push(delta, sparse, step, 0.0)
        for cache in self.caches:
            cache.clear()

    def update_rows_locally(self, lr):
        """GEO: the script's optimizer rule on the cached rows the last batch touched."""
        for table, cache in zip(self.tables, self.caches):
            if table.grad_ids is not None:
                cache.update(self.inner, table.grad_ids, table.grad_values, lr)
                table.clear_gradient()

    def save(self, dirname):
        answers = self._exchange({s: (wire.Kind.SAVE, [wire.text_array(dirname)], {})
                                  for s in range(self.server_num)})
        return [m.text() for _, m in sorted(answers.items())]

    def stop(self):
        requests = [self._request(s, wire.Kind.STOP, step=self.steps)
                    for s in range(self.server_num)]
        for request, _ in requests:
            request.Wait()
        self.stopped = True

    def _leave_if_running(self, reason="its process exited"):
        """At process exit without ``stop_worker``: tell the servers (synchronous servers
        stop with an error naming this worker, the others go on)."""
        from mpi4py import MPI

        if self.hung is not None and not MPI.Is_finalized():
            self._end_job_for_hung_server()
        if self.stopped or MPI.Is_finalized():
            return
        self.stopped = True
        text = wire.text_array(reason)
        for s in range(self.server_num):
            data = wire.encode(wire.Kind.LEFT, [text], step=self.steps)
            self.comm.Send(data, dest=self.rank(s), tag=wire.TAG_REQUEST)


    def _end_job_for_hung_server(self):
        """A worker leaving because its server hung ends the job, whatever the mode: the
        server would never finish, and the job would wait for it in ``MPI_Finalize``."""
        server, seconds = self.hung
        failure.abort(f"[fleetmpi] worker {self.worker} (rank {self.comm.Get_rank()}) leaves "
                      f"because server {server} (rank {self.rank(server)}) did not answer "
                      f"within {seconds:g} s (twice FLEETMPI_PS_TIMEOUT); a hung server would "
                      f"keep the job from ending: aborting the job",
                      linger=failure.REPORT_LINGER)

    def _leave_after_error(self, report):
        """Asynchronous and GEO: an uncaught exception ends this worker alone; the servers
        hear why (the exception's last line) and train on with the others."""
        lines = [line for line in report.strip().splitlines() if line.strip()]
        self._leave_if_running(f"it raised {lines[-1].strip()}" if lines else "it raised")


class RowCache:
    """GEO: the rows of one table a worker has pulled since its last exchange, their values
    then (``old``) and now, and the optimizer state of the local updates."""

    def __init__(self, table):
        self.table = table
        self.clear()

    def clear(self):
        self.ids = np.zeros(0, np.int64)
        self.rows = np.zeros((0, self.table.dim), self.table.dtype)
        self.old = self.rows.copy()
        self.state = {}
        self.last_pulled = np.zeros(0, np.int64)

    def lookup(self, ids, pull):
        missing = ids[~np.isin(ids, self.ids)]
        self.last_pulled = missing
        if len(missing):
            fresh = pull(missing)
            self.ids = np.concatenate([self.ids, missing])
            order = np.argsort(self.ids, kind="stable")
            self.ids = self.ids[order]
            self.rows = np.concatenate([self.rows, fresh])[order]
            self.old = np.concatenate([self.old, fresh])[order]
            self.state = {k: np.concatenate([v, np.zeros_like(fresh)])[order]
                          for k, v in self.state.items()}
        return self.rows[np.searchsorted(self.ids, ids)]

    def update(self, optimizer, ids, grads, lr):
        where = np.searchsorted(self.ids, ids)
        for name in optimizer.state_names:
            self.state.setdefault(name, np.zeros_like(self.rows))
        rows = self.rows[where]
        state = {name: flat[where] for name, flat in self.state.items()}
        optimizer.reference_update(rows, grads, state, lr)
        self.rows[where] = rows
        for name, flat in self.state.items():
            flat[where] = state[name]

    def deltas(self, scale):
        return self.ids, (self.rows - self.old) * np.asarray(scale, dtype=self.rows.dtype)


class _PushPull(StepHook):
    """Sync and async: the servers update; the local optimizer never steps."""

    def __init__(self, owner):
        self.owner = owner

    def update(self, ctx, proceed):
        self.owner.client().push_gradients(ctx.step, float(ctx.optimizer.get_lr()))


class _Geo(StepHook):
    """GEO: local updates, an exchange of deltas every ``k_steps`` steps."""

    def __init__(self, owner, k_steps):
        self.owner = owner
        self.k_steps = k_steps

    def update(self, ctx, proceed):
        proceed(ctx)
        self.owner.client().update_rows_locally(float(ctx.optimizer.get_lr()))

    def after_step(self, ctx, proceed):
        proceed(ctx)
        if (ctx.step + 1) % self.k_steps == 0:
            self.owner.client().push_deltas(ctx.step)


class ParameterServerOptimizer:
    """``fleet.distributed_optimizer(optimizer, strategy)`` in parameter-server mode; see the
    module docstring. ``mode`` is ``"sync"``, ``"async"`` or ``"geo"``."""

    def __init__(self, optimizer, strategy, client_of, tables_of):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"distributed_optimizer wraps a fleetmpi.optimizer optimizer, "
                            f"not {type(optimizer).__name__}")
        if optimizer.grad_clip is not None:
            raise ValueError(f"grad_clip={type(optimizer.grad_clip).__name__} cannot run in "
                             "parameter-server mode: each server sees only its blocks of the "
                             "gradient; pass grad_clip=None")
        self.inner = optimizer
        self.strategy = strategy
        self.mode = training_mode(strategy)
        self.k_steps = AsyncConfig.of(strategy).k_steps
        self._client_of = client_of
        self._tables_of = tables_of
        self.step_count = 0
        self.hook = _Geo(self, self.k_steps) if self.mode == GEO else _PushPull(self)

    def client(self):
        return self._client_of()

    @property
    def staleness(self):
        """Async: per push, the most updates any server applied between this worker's last
        pull and the push."""
        return list(self._client_of(running=False).staleness)

    def minimize(self, *args):
        """``minimize(model, loss_fn, x, y)``: one training step; returns this worker's mean
        loss as a 0-d array. ``minimize(loss)``: ``loss.backward()`` then ``step()``."""
        loss = minimize_loss(args)
        if loss is not None:
            loss.backward()
            self.step()
            return None
        client = self.client()
        ctx = StepContext(*args, self.inner, step=self.step_count)
        loss = run_step([self.hook], ctx)
        self._stepped(client)
        return loss

    def step(self):
        """The update stage of a step whose ``loss.backward()`` already ran (Paddle dygraph):
        push the accumulated gradients, or update locally in GEO, as ``minimize`` does."""
        client = self.client()
        finish_step([self.hook], StepContext(None, None, None, None, self.inner,
                                             step=self.step_count))
        self._stepped(client)

    def clear_grad(self):
        """Zero the dense gradients and the sparse tables' row gradients."""
        self.inner.clear_grad()
        for table in self._tables_of():
            table.clear_gradient()

    clear_gradients = clear_grad

    def _stepped(self, client):
        self.step_count += 1
        client.steps = self.step_count

    def flush(self):
        """GEO: push the local steps not yet exchanged (``stop_worker`` calls it)."""
        if self.mode == GEO and self.step_count % self.k_steps:
            self.client().push_deltas(self.step_count - 1)

    def __getattr__(self, name):
        return getattr(self.inner, name)


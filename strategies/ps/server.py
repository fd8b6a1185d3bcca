"""A server's message loop: answers pulls, applies pushes in the training mode, stops when
every worker has stopped.

Synchronous: a step's pushes are held until every worker still training has pushed that step;
then the gradients are averaged (summed in worker order, divided by their number), the
optimizer updates, and every pusher gets the new parameters. A worker that stopped
(``stop_worker``) no longer counts, so workers with fewer batches finish cleanly. A worker
that leaves without ``stop_worker`` (its process exits, an exception included) ends
synchronous training: the server tells the workers still waiting, then raises
``WorkerLostError`` naming the rank. So does a step whose pushes stay incomplete for longer than
``FLEETMPI_PS_TIMEOUT`` seconds (a hung or killed worker), naming the ranks missing.

Asynchronous: each push is applied at once with its own gradient, and answered; the answer
carries the push's staleness, the number of updates the server applied between the pusher's
last pull and this push. GEO: each push carries parameter deltas, which are added. In both a
worker that leaves is logged and training goes on with the others. A worker may be silent as
long as others train; but when every worker still counted has sent nothing for
``FLEETMPI_PS_TIMEOUT`` seconds (a hung worker after the others stopped, say), the server stops
naming them, as in synchronous training, instead of waiting forever.
"""
import os
import time

import numpy as np

from fleetmpi.core.knobs import PS_TIMEOUT
from fleetmpi.core.log import logger
from . import wire
from .mode import SYNC



class WorkerLostError(RuntimeError):
    """Synchronous training cannot go on: a worker left or stopped answering."""


def timeout_seconds(environ=os.environ):
    """``FLEETMPI_PS_TIMEOUT``: seconds a synchronous step may wait for missing pushes."""
    return PS_TIMEOUT.value(environ)


class Server:
    """Serves ``state`` (a ``ServerState``) to ``worker_num`` workers over ``comm`` (ranks
    ``0..worker_num-1`` are the workers)."""

    def __init__(self, comm, state, mode, worker_num, timeout=None):
        self.comm = comm
        self.state = state
        self.mode = mode
        self.worker_num = worker_num
        self.timeout = timeout_seconds() if timeout is None else timeout
        self.active = set(range(worker_num))
        self.pending = {}
        self.pending_since = None
        self.sends = []
        self.staleness = []
        self.pushes = [0] * worker_num
        self.lost = []
        self.save_dirname = None
        self.last_heard = None      # worker: when its last message came, from the first one

    # -- sending ----------------------------------------------------------------------------
    def _reply(self, worker, arrays=(), version=0, extra=0):
        data = wire.encode(wire.Kind.REPLY, arrays, version=version, extra=extra)
        self.sends.append((wire.send(self.comm, data, worker, wire.TAG_REPLY), data))
        if len(self.sends) > 64:
            self.sends = [(r, d) for r, d in self.sends if not r.Test()]

    def _values_reply(self, worker, extra=0):
        self._reply(worker, self.state.values(), self.state.version, extra)

    def _finish_sends(self, seconds=30.0):
        deadline = time.monotonic() + seconds
        poller = wire.Poller()
        while self.sends:
            self.sends = [(r, d) for r, d in self.sends if not r.Test()]
            if self.sends and time.monotonic() > deadline:
                logger.warning("server %d: %d answer(s) were never received", self.state.server,
                               len(self.sends))
                return
            if self.sends:
                poller.pause()

    # -- the loop ---------------------------------------------------------------------------
    def serve(self):
        """Answer messages until every worker has stopped or left; returns ``report()``."""
        from mpi4py import MPI

        while self.active:
            message = wire.receive(self.comm, MPI.ANY_SOURCE, wire.TAG_REQUEST,
                                   on_poll=self._check_timeout)
            now = time.monotonic()
            if self.last_heard is None:     # the silence clocks start with training
                self.last_heard = dict.fromkeys(range(self.worker_num), now)
            self.last_heard[message.source] = now
            self.handle(message)
        self._finish_sends()
        return self.report()

    def report(self):
        """Counts of this server's work: updates, pushes per worker, the staleness of
        asynchronous pushes (mean, max, and every value), the workers that left."""
        staleness = np.array(self.staleness, dtype=np.int64)
        return {"server": self.state.server, "mode": self.mode, "updates": self.state.version,
                "pushes": list(self.pushes), "lost_workers": list(self.lost),
                "staleness": staleness.tolist(),
                "staleness_mean": float(staleness.mean()) if staleness.size else 0.0,
                "staleness_max": int(staleness.max()) if staleness.size else 0}

    def handle(self, message):
        worker = message.source
        handler = {wire.Kind.PULL: self._pull, wire.Kind.PUSH: self._push,
                   wire.Kind.PULL_ROWS: self._pull_rows, wire.Kind.STOP: self._stop,
                   wire.Kind.LEFT: self._left, wire.Kind.SAVE: self._save}[message.kind]
        handler(worker, message)

    def _pull(self, worker, message):
        signature = np.asarray(message.arrays[0])
        if not np.array_equal(signature, self.state.signature):
            self._fail(f"worker {worker} (rank {worker}) built a different model: signature "
                       f"{signature.tolist()} (parameter sizes, then table shapes), server "
                       f"{self.state.server} has {self.state.signature.tolist()}")
        self._values_reply(worker)

    def _pull_rows(self, worker, message):
        ids = np.asarray(message.arrays[0])
        self._reply(worker, [self.state.shards[message.extra].get(ids)], self.state.version)

    def _split_push(self, message):
        count = len(self.state.block_params)
        dense = message.arrays[:count]
        rest = message.arrays[count:]
        sparse = [(np.asarray(rest[2 * t]), rest[2 * t + 1].reshape(-1, shard.rows.shape[1]))
                  for t, shard in enumerate(self.state.shards)]
        return dense, sparse

    def _push(self, worker, message):
        self.pushes[worker] += 1
        if self.mode == SYNC:
            self.pending[worker] = message
            if self.pending_since is None:
                self.pending_since = time.monotonic()
            self._complete_sync_step()
            return
        dense, sparse = self._split_push(message)
        if self.mode == "async":
            staleness = self.state.version - message.version
            self.staleness.append(staleness)
            self.state.apply_gradients(dense, sparse, message.lr)
            self._values_reply(worker, extra=staleness)
        else:
            self.state.add_deltas(dense, sparse)
            self._values_reply(worker)

    def _complete_sync_step(self):
        if not self.pending or not self.active.issubset(self.pending):
            return
        workers = sorted(self.pending)
        steps = {self.pending[w].step for w in workers}
        if len(steps) != 1:
            self._fail(f"workers pushed different steps in synchronous training: "
                       f"{ {w: self.pending[w].step for w in workers} }")
        parts = [self._split_push(self.pending[w]) for w in workers]
        n = len(workers)
        dense = [sum(np.asarray(p[0][i]) for p in parts) / n
                 for i in range(len(self.state.block_params))]
        sparse = []
        for t in range(len(self.state.shards)):
            ids = np.concatenate([p[1][t][0] for p in parts])
            values = np.concatenate([p[1][t][1] for p in parts])
            unique, inverse = np.unique(ids, return_inverse=True)
            summed = np.zeros((len(unique), values.shape[1]), dtype=values.dtype)
            np.add.at(summed, inverse, values)
            sparse.append((unique, summed / n))
        self.state.apply_gradients(dense, sparse, self.pending[workers[0]].lr)
        self.pending = {}
        self.pending_since = None
        for w in workers:
            self._values_reply(w)

    def _stop(self, worker, message):
        self.active.discard(worker)
        logger.info("server %d: worker %d stopped", self.state.server, worker)
        if self.mode == SYNC:
            self._complete_sync_step()

    def _left(self, worker, message):
        why = (f"worker {worker} (rank {worker}) left the job without stop_worker after "
               f"{message.step} step(s): {message.text()}")
        self.lost.append(worker)
        self.active.discard(worker)
        self.pending.pop(worker, None)
        if self.mode == SYNC:
            self._fail(f"{why}; synchronous training cannot go on without it")
        logger.warning("server %d: %s; training goes on with the other workers",
                       self.state.server, why)

    def _save(self, worker, message):
        from .shards import save_shard

        path = save_shard(message.text(), self.state.server, self.state.server_num,
                          self.state.to_arrays(), self.state.meta())
        self._reply(worker, [wire.text_array(path)], self.state.version)

    def _check_timeout(self):
        if self.mode != SYNC:
            self._check_silence()
            return
        if self.pending_since is None or time.monotonic() - self.pending_since < self.timeout:
            return
        missing = sorted(self.active - set(self.pending))
        self._fail(f"worker(s) {missing} (rank(s) {missing}) pushed nothing for step "
                   f"{next(iter(self.pending.values())).step} within {self.timeout:g} s "
                   f"({PS_TIMEOUT.name}) while the others waited; synchronous training cannot go "
                   "on")

    def _check_silence(self):
        """Asynchronous and GEO: stop when every worker still counted has been silent for the
        timeout, naming them."""
        now = time.monotonic()
        if self.last_heard is None or any(now - self.last_heard[w] < self.timeout
                                          for w in self.active):
            return
        silent = sorted(self.active)
        self._fail(f"worker(s) {silent} (rank(s) {silent}) sent nothing for {self.timeout:g} s "
                   f"({PS_TIMEOUT.name}) and no other worker is training; the server stops "
                   "instead of waiting forever")

    def _fail(self, why):
        """Tell every worker still training why this server stops, then raise."""
        text = f"server {self.state.server} stopped: {why}"
        logger.error("%s", text)
        for worker in sorted(self.active):
            data = wire.encode(wire.Kind.ERROR, [wire.text_array(text)])
            self.sends.append((wire.send(self.comm, data, worker, wire.TAG_REPLY), data))
        self._finish_sends(seconds=5.0)
        raise WorkerLostError(text)

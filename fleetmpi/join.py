"""``fleet.Join``: training on uneven data, the ranks whose batches run out first carried
along until every rank's loop has ended (PyTorch's ``Join`` context manager, Horovod's
``hvd.join()``).

    with fleet.Join(opt) as join:
        for x, y in loader:                 # as many batches as this rank has
            loss = F.cross_entropy(model(x), y)
            loss.backward(); opt.step(); opt.clear_grad()     # or opt.minimize(...)
    join.last_joined                        # the last rank to leave its loop

Inside the block each step first counts the ranks still training; a rank whose loop has
ended answers the others' steps with zero gradients (``DistributedOptimizer.shadow_step``)
and the averages count only the ranks that had a batch (the math, and the strategies that
cannot join and why, are in ``fleetmpi.strategies.join``). When every rank has left its loop
all leave the block together, and every rank takes the parameters and optimizer state
(learning-rate scheduler and step counts included) of ``last_joined``, which every rank
already matches where the ranks' learning rates were alike (a joined rank applies each update
with the others); a scheduler stepped once per batch is the case this settles. Layers' buffers
(batch-norm running statistics) stay each rank's own, as without ``Join``.

Without ``Join`` a rank whose loop ends early is reported by the stall watchdog as soon as the
others wait for it (docs/reliability.md). Between the steps of the block, calls that
communicate (an evaluation's allreduce, a barrier) would meet a joined rank's count instead,
which the collectives' agreement or the stall watchdog reports: make them after it.
"""
import json

import numpy as np

from .core import backend
from .parallel import DistributedOptimizer
from .strategies.join import JoinExchange, check_joinable


class Join:
    """The context manager of the module docstring, over ``optimizer`` (from
    ``fleet.distributed_optimizer``). ``last_joined``: None until the block has ended; then the
    last rank to leave its loop (the highest of them where several left at the same step; the
    highest rank when no rank trained at all)."""

    def __init__(self, optimizer):
        if not isinstance(optimizer, DistributedOptimizer):
            raise TypeError("fleet.Join takes the optimizer fleet.distributed_optimizer "
                            f"returned, not {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.last_joined = None
        self._exchange = None

    def __enter__(self):
        opt = self.optimizer
        if self._exchange is not None:
            raise RuntimeError("this fleet.Join block is already open; a block cannot be "
                               "entered twice at once")
        if opt.calibrating:
            raise RuntimeError("strategy.auto calibrates on the first minimize call, whose "
                               "candidates do not count joined ranks: train the first step "
                               "before fleet.Join")
        if opt.step_open:
            raise RuntimeError("fleet.Join entered while a step opened by calling the model "
                               "waits for opt.step(); finish it first")
        check_joinable(opt.strategies, opt.hybrid is not None)
        self._exchange = JoinExchange(opt.communicator)
        opt.add_hook(self._exchange, first=True)
        return self

    def __exit__(self, kind, error, traceback):
        exchange, self._exchange = self._exchange, None
        try:
            if kind is None:
                self._follow(exchange)
        finally:
            self.optimizer.hooks.remove(exchange)
        return False

    def _follow(self, exchange):
        """Take the steps of the ranks still training until none does, then take the state of
        the last of them to leave."""
        if self.optimizer.step_open:
            raise RuntimeError("the fleet.Join block ended while a step opened by calling the "
                               "model waits for opt.step(); finish each step inside the block")
        while True:
            flags = exchange.exchange(False)
            if not flags.any():
                break
            self.optimizer.shadow_step(int(flags.sum()))
        self.last_joined = exchange.last_joined
        take_training_state(self.optimizer, self.last_joined)


def take_training_state(optimizer, root):
    """Give every rank ``root``'s parameters and optimizer state (``state_dict``: its arrays,
    and its numbers and scheduler state as JSON text) over the optimizer's communicator."""
    comm = optimizer.communicator
    if comm is None or comm.size == 1:
        return
    comm.broadcast_many([run.data for run in optimizer.inner.runs], root=root)
    state = optimizer.state_dict()
    arrays = sorted(key for key, value in state.items() if hasattr(value, "shape"))
    moved = [backend.asarray(state[key]) for key in arrays]
    comm.broadcast_many(moved, root=root)
    state.update((key, backend.to_numpy(value)) for key, value in zip(arrays, moved))
    numbers = {key: value for key, value in state.items() if key not in arrays}
    state.update(json.loads(_broadcast_text(comm, json.dumps(numbers, default=_plain), root)))
    optimizer.set_state_dict(state)


def _plain(value):
    """A NumPy scalar as the Python number JSON writes."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} in an optimizer state cannot be sent as JSON")


def _broadcast_text(comm, text, root):
    """``root``'s ``text`` on every rank (its length first, then its code points)."""
    codes = np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int32)
    length = comm.broadcast(backend.asarray(np.array([len(codes)], dtype=np.int64)), root=root)
    length = int(backend.to_numpy(length)[0])
    if comm.rank != root:
        codes = np.zeros(length, dtype=np.int32)
    codes = backend.to_numpy(comm.broadcast(backend.asarray(codes), root=root))
    return codes.astype(np.uint8).tobytes().decode()

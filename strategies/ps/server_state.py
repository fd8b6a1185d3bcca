"""What one server holds: its dense blocks with an optimizer over them, and its rows of every
sparse table with their optimizer state.

The server's optimizer is a copy of the script's optimizer (same class and hyperparameters)
built over the server's blocks; each update takes the learning rate the workers pushed. Sparse
rows are updated lazily: only the rows a push names change, with the same update rule applied
to those rows and to their slice of the optimizer state.
"""
import numpy as np

from fleetmpi.core import backend
from fleetmpi.nn import Parameter
from fleetmpi.nn.flat import flatten
from .blocks import local_rows, plan_blocks, server_blocks, shard_rows

SPARSE_INIT_STREAM = 7


def model_signature(parameters, tables):
    """Sizes of the dense parameters, then ``(rows, dim)`` of every sparse table: what workers
    and servers must agree on."""
    sizes = [p.size for p in parameters]
    return np.array([len(sizes)] + sizes + [v for t in tables for v in (t.num_rows, t.dim)],
                    dtype=np.int64)


class SparseShard:
    """Server ``server``'s rows of one table (``id % server_num == server``) and their
    optimizer state, all ``(rows, dim)`` host arrays."""

    def __init__(self, table, index, server, server_num, state_names):
        self.server_num = server_num
        rows = shard_rows(table.num_rows, server, server_num)
        seed = np.random.SeedSequence([backend.get_seed(), SPARSE_INIT_STREAM, index, server])
        generator = np.random.default_rng(seed)
        if table.dtype in (np.float32, np.float64):
            self.rows = generator.standard_normal((rows, table.dim), dtype=table.dtype)
        else:
            self.rows = generator.standard_normal((rows, table.dim)).astype(table.dtype)
        self.state = {name: np.zeros_like(self.rows) for name in state_names}

    def get(self, ids):
        return self.rows[local_rows(ids, self.server_num)]

    def add(self, ids, deltas):
        np.add.at(self.rows, local_rows(ids, self.server_num), deltas)

    def update(self, optimizer, ids, grads, lr):
        """Apply ``optimizer``'s rule to the rows ``ids`` (distinct) with gradient ``grads``."""
        where = local_rows(ids, self.server_num)
        rows = self.rows[where]
        state = {name: flat[where] for name, flat in self.state.items()}
        optimizer.reference_update(rows, np.asarray(grads, dtype=rows.dtype), state, lr)
        self.rows[where] = rows
        for name, flat in self.state.items():
            flat[where] = state[name]


class ServerState:
    """Server ``server`` of ``server_num``: blocks of ``parameters`` and shards of
    ``tables``, updated with a copy of ``inner``."""

    def __init__(self, parameters, tables, inner, server, server_num):
        self.server = server
        self.server_num = server_num
        self.signature = model_signature(parameters, tables)
        self.blocks = server_blocks(plan_blocks([p.size for p in parameters], server_num),
                                    server)
        self.block_params = [
            Parameter(backend.to_numpy(parameters[b.param].data).reshape(-1)[b.start:b.stop])
            for b in self.blocks]
        self.optimizer = None
        if self.block_params:
            flatten(self.block_params)
            self.optimizer = inner.copy_for(self.block_params)
        self.rule = inner
        self.shards = [SparseShard(t, i, server, server_num, inner.state_names)
                       for i, t in enumerate(tables)]
        self.version = 0

    def values(self):
        return [backend.to_numpy(p.data) for p in self.block_params]

    def apply_gradients(self, grads, sparse, lr):
        """One optimizer update of the blocks from ``grads`` (one array per block) and of the
        sparse rows ``sparse`` (per table, ``(ids, grads)``)."""
        if self.optimizer is not None:
            for p, g in zip(self.block_params, grads):
                p.grad.data[...] = backend.asarray(g)
            self.optimizer.set_lr(lr)
            self.optimizer.step()
        # the script's optimizer does nothing else on a server: it lends its update rule to
        # the sparse rows, with the step count of this server's updates (Adam's correction)
        step_count = self.optimizer.step_count if self.optimizer else self.version + 1
        self.rule.step_count = step_count
        for shard, (ids, values) in zip(self.shards, sparse):
            if len(ids):
                shard.update(self.rule, ids, values, lr)
        self.version += 1

    def add_deltas(self, deltas, sparse):
        """GEO: add the pushed deltas to the blocks and rows."""
        for p, d in zip(self.block_params, deltas):
            p.data[...] += backend.asarray(d)
        for shard, (ids, values) in zip(self.shards, sparse):
            if len(ids):
                shard.add(ids, values)
        self.version += 1

    # -- shards on disk ---------------------------------------------------------------------
    def to_arrays(self):
        arrays = {f"block.{i}": v for i, v in enumerate(self.values())}
        if self.optimizer is not None:
            for key, value in self.optimizer.state_dict().items():
                if isinstance(value, np.ndarray):
                    arrays[f"optimizer.{key}"] = value
        for t, shard in enumerate(self.shards):
            arrays[f"table.{t}"] = shard.rows
            for name, flat in shard.state.items():
                arrays[f"table.{t}.{name}"] = flat
        return arrays

    def meta(self):
        return {"server": self.server, "server_num": self.server_num,
                "signature": self.signature.tolist(), "version": self.version,
                "step_count": self.optimizer.step_count if self.optimizer else 0}

    def load(self, arrays, meta, where):
        if meta["signature"] != self.signature.tolist():
            raise ValueError(f"{where} was saved for a model with signature "
                             f"{meta['signature']} (parameter sizes, then table shapes), not "
                             f"this one's {self.signature.tolist()}")
        for i, p in enumerate(self.block_params):
            p.data[...] = backend.asarray(arrays[f"block.{i}"])
        if self.optimizer is not None:
            state = {k[len("optimizer."):]: v for k, v in arrays.items()
                     if k.startswith("optimizer.")}
            state.update(step_count=meta["step_count"], lr_scheduler=None)
            self.optimizer.set_state_dict(state)
        for t, shard in enumerate(self.shards):
            shard.rows[...] = arrays[f"table.{t}"]
            for name, flat in shard.state.items():
                flat[...] = arrays[f"table.{t}.{name}"]
        self.version = int(meta["version"])

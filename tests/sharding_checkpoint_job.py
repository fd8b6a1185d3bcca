"""A sharded training job for the re-sharding test, started under ``mpiexec -n N``.

    python sharding_checkpoint_job.py STAGE save DIRECTORY      # steps [0, HALF), checkpoint
    python sharding_checkpoint_job.py STAGE resume DIRECTORY OUT  # load, steps [HALF, STEPS)

Every rank trains on its shard of ``strategy_support.global_batch(step)`` with Adam under
``sharding`` of ``STAGE``; ``resume`` starts from other parameters (seed 7) and writes the final parameters
and each rank's optimizer-state bytes into ``OUT`` (``np.savez``). With ``--lazy`` after the
arguments the model is built under ``LazyGuard``, and ``resume`` checks on every rank that the
loaded model equals the saved values.
"""
import sys

import numpy as np

import fleetmpi as fleet
from fleetmpi.core import backend
from fleetmpi.training import checkpoint
from fleetmpi import nn, optimizer
from strategy_support import global_batch, make_mlp, make_strategy, shard, world_gather

STEPS = 6
HALF = 3
# The model built under LazyGuard: deeper than make_mlp()'s, its shards cutting layers.
LAZY_SIZES = (6,) + (64,) * 8 + (4,)


def adam(parameters):
    return optimizer.Adam(learning_rate=0.01, parameters=parameters)


def build(seed, stage, lazy=False):
    backend.manual_seed(seed)
    if lazy:
        with fleet.LazyGuard():
            model = fleet.distributed_model(make_mlp(sizes=LAZY_SIZES))
    else:
        model = fleet.distributed_model(make_mlp())
    opt = fleet.distributed_optimizer(adam(model.parameters()),
                                      make_strategy(sharding=True,
                                                    sharding_configs={"stage": int(stage)}))
    return model, opt


def train(model, opt, steps):
    rank, size = fleet.worker_index(), fleet.worker_num()
    for step in steps:
        x, y = global_batch(step)
        opt.minimize(model, nn.CrossEntropyLoss(), shard(x, rank, size), shard(y, rank, size))


def main(stage, mode, directory, out=None, lazy=False):
    fleet.init(is_collective=True)
    if mode == "save":
        model, opt = build(0, stage, lazy)
        train(model, opt, range(HALF))
        checkpoint.save(directory, model, opt, HALF)
        return
    model, opt = build(7, stage, lazy)
    info = checkpoint.load(directory, model, opt)
    if lazy:
        for name, value in model.state_dict().items():
            if not np.array_equal(value, checkpoint.saved_model_value(directory, name)):
                raise AssertionError(f"{name} after loading differs from the saved values")
    train(model, opt, range(info["step"], STEPS))
    final = model.state_dict()        # under stage 3 a collective: every rank calls it
    for name, value in final.items():
        every = world_gather(value)
        if not all(np.array_equal(every[0], other) for other in every[1:]):
            raise AssertionError(f"{name} differs between the ranks after resuming")
    state_bytes = world_gather(np.array([opt.inner.state_nbytes()]))[:, 0]
    if fleet.worker_index() == 0:
        np.savez(out, state_bytes=state_bytes, **final)


if __name__ == "__main__":
    arguments = [a for a in sys.argv[1:] if a != "--lazy"]
    main(*arguments, lazy=len(arguments) < len(sys.argv) - 1)

"""Parameter-server jobs that tests/test_pserver.py starts under mpiexec.

    mpiexec -n S+W python tests/pserver_jobs.py SCENARIO --servers S [--out DIR] [...]

Ranks ``0..W-1`` are workers, the rest servers (``UserDefinedRoleMaker``, or the variables of
``fleetmpirun --server_num S --worker_num W`` when it started the job). Every worker checks
its own results against single-process math and prints ``ok <scenario> worker <i>``; a failed
check raises, which ends the job with a non-zero exit. Servers print their report as JSON
after ``report <server>``.
"""
import argparse
import json
import os
import signal
import sys
import time

import numpy as np

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from fleetmpi.core import backend
from fleetmpi.training import data
from fleetmpi import nn, optimizer

FEATURES, CLASSES, HIDDEN = 64, 4, 160   # fc0 has 64 * 160 > 8192 elements: split in blocks
ROWS, DIM = 1000, 8


def say(line):
    """One line in one write: under PYTHONUNBUFFERED a print's text and newline are two, and
    the launcher interleaves the ranks' output between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def parse():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario")
    parser.add_argument("--servers", type=int, required=True)
    parser.add_argument("--mode", default="sync", choices=["sync", "async", "geo"])
    parser.add_argument("--k-steps", type=int, default=4)
    parser.add_argument("--idiom", default="minimize", choices=["minimize", "dygraph"])
    parser.add_argument("--out")
    parser.add_argument("--load")
    return parser.parse_args()


def join(servers):
    """Roles from fleetmpirun's variables when it started the job, else given here."""
    if "TRAINING_ROLE" in os.environ:
        fleet.init(is_collective=False)
        assert fleet.server_num() == servers
        return
    from mpi4py import MPI

    size, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    workers = size - servers
    role = fleet.Role.WORKER if rank < workers else fleet.Role.SERVER
    fleet.init(role_maker=fleet.UserDefinedRoleMaker(
        current_id=rank if rank < workers else rank - workers, role=role,
        worker_num=workers, server_num=servers))


def strategy_for(mode, k_steps):
    strategy = fleet.DistributedStrategy()
    strategy.a_sync = mode != "sync"
    strategy.a_sync_configs = {"k_steps": {"sync": -1, "async": 0, "geo": k_steps}[mode]}
    return strategy


def serve(args):
    fleet.init_server(args.load)
    report = fleet.run_server(save_dirname=args.out if args.scenario == "restart" else None)
    report.pop("staleness")
    say(f"report {fleet.server_index()} {json.dumps(report)}")


# -- sync equals data parallel, with uneven batch counts, and a restart in the middle --------
def dense_model():
    backend.manual_seed(3)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN, dtype="float64"), nn.Tanh(),
                         nn.Linear(HIDDEN, CLASSES, dtype="float64"))


def adam(parameters):
    return optimizer.Adam(learning_rate=0.01, parameters=parameters)


def step_batches(worker, worker_num, step):
    """Worker ``w`` has ``6 - w`` batches of 8; step ``t``'s global batch is the batches of
    the workers that still have one, in worker order."""
    rng = np.random.default_rng(500 + step)
    x, y = rng.standard_normal((8 * worker_num, FEATURES)), rng.integers(0, CLASSES,
                                                                         8 * worker_num)
    alive = [w for w in range(worker_num) if step < 6 - w]
    parts = {w: (x[8 * w:8 * w + 8], y[8 * w:8 * w + 8]) for w in alive}
    return parts, (np.concatenate([parts[w][0] for w in alive]),
                   np.concatenate([parts[w][1] for w in alive]))


def reference_parameters(worker_num, steps):
    model = dense_model()
    opt = fleet.distributed_optimizer(adam(model.parameters()), local=True)
    for step in range(steps):
        _, (x, y) = step_batches(0, worker_num, step)
        opt.minimize(model, nn.CrossEntropyLoss(), x, y)
    return [backend.to_numpy(p.data).copy() for p in model.parameters()]


def sync_equals_dp(args, steps_range, save_after=None):
    model = fleet.distributed_model(dense_model())
    opt = fleet.distributed_optimizer(adam(model.parameters()), strategy_for("sync", 0))
    if fleet.is_server():
        return serve(args)
    fleet.init_worker()
    w, n = fleet.worker_index(), fleet.worker_num()
    for step in steps_range:
        parts, _ = step_batches(w, n, step)
        if w in parts:
            opt.minimize(model, nn.CrossEntropyLoss(), *parts[w])
        if step == save_after and fleet.is_first_worker():
            fleet.save_persistables(os.path.join(args.out, "on-request"))
    fleet.stop_worker()
    return model, w, n


def scenario_sync(args):
    done = sync_equals_dp(args, range(6))
    if done is None:
        return
    model, w, n = done
    # worker w's last answer came after its own last step, 6 - w
    for got, want in zip(model.parameters(), reference_parameters(n, 6 - w)):
        np.testing.assert_allclose(backend.to_numpy(got.data), want, rtol=1e-10, atol=1e-12)
    say(f"ok sync worker {w}: {6 - w} steps, parameters equal one process")


def scenario_restart(args):
    """First job (no --load): steps 0-2, shards saved at shutdown into --out. Second job
    (--load): steps 3-5 from the shards; the end equals 6 uninterrupted steps."""
    first = args.load is None
    done = sync_equals_dp(args, range(3) if first else range(3, 6),
                          save_after=1 if first else None)
    if done is None:
        return
    model, w, n = done
    if not first:
        for got, want in zip(model.parameters(), reference_parameters(n, 6 - w)):
            np.testing.assert_allclose(backend.to_numpy(got.data), want, rtol=1e-10,
                                       atol=1e-12)
    say(f"ok restart worker {w} ({'first' if first else 'resumed'} job)")


# -- async and GEO on digits ------------------------------------------------------------------
def scenario_digits(args):
    backend.manual_seed(0)
    model = fleet.distributed_model(nn.MLP([64, 128, 10]))
    opt = fleet.distributed_optimizer(
        optimizer.Momentum(learning_rate=0.05, momentum=0.9, parameters=model.parameters()),
        strategy_for(args.mode, args.k_steps))
    if fleet.is_server():
        return serve(args)
    fleet.init_worker()
    train, test = data.load_digits()
    sampler = data.DistributedSampler(len(train), 32)
    for epoch in range(20):
        sampler.set_epoch(epoch)
        for x, y in train.batches(sampler):
            opt.minimize(model, nn.CrossEntropyLoss(), x, y)
    fleet.stop_worker()
    model.eval()
    predicted = model(test.features).numpy().argmax(axis=1)
    accuracy = float((predicted == test.labels).mean())
    stale = opt.staleness if args.mode == "async" else []
    assert accuracy >= 0.95, f"{args.mode}: test accuracy {accuracy:.4f} < 0.95"
    say(f"ok digits {args.mode} worker {fleet.worker_index()}: accuracy {accuracy:.4f}, "
        f"staleness mean {np.mean(stale) if stale else 0:.2f}")


# -- sparse rows -------------------------------------------------------------------------------
class Bag(nn.Layer):
    """Embedding of 3 ids per sample, summed over the ids, then a Linear layer."""

    def __init__(self, sparse):
        super().__init__(dtype="float64")
        self.embedding = nn.Embedding(ROWS, DIM, dtype="float64", sparse=sparse)
        self.fc = nn.Linear(DIM, CLASSES, dtype="float64")

    def forward(self, ids):
        return self.fc(self.embedding(ids).sum(axis=1))


def sparse_batch(step, worker_num):
    rng = np.random.default_rng(900 + step)
    return (rng.integers(0, ROWS // 4, (4 * worker_num, 3)) * 4 + step % 4,
            rng.integers(0, CLASSES, 4 * worker_num))


def scenario_sparse(args):
    backend.manual_seed(5)
    model = fleet.distributed_model(Bag(sparse=True))
    sgd = optimizer.SGD(learning_rate=0.5, parameters=model.parameters())
    opt = fleet.distributed_optimizer(sgd, strategy_for(args.mode, args.k_steps))
    if fleet.is_server():
        return serve(args)
    fleet.init_worker()
    w, n = fleet.worker_index(), fleet.worker_num()
    table = model.embedding.table
    client = fleet.strategies.ps.runtime._client
    start_rows = table.lookup(np.arange(ROWS)).copy() if args.mode == "sync" else None
    start_fc = [backend.to_numpy(p.data).copy() for p in model.parameters()]
    touched_since_push = []
    steps = 8
    for step in range(steps):
        ids, y = sparse_batch(step, n)
        mine = slice(4 * w, 4 * w + 4)
        if args.idiom == "minimize":
            opt.minimize(model, nn.CrossEntropyLoss(), ids[mine], y[mine])
        else:
            loss = F.cross_entropy(model(ids[mine]), y[mine])
            loss.backward()
            opt.step()
            opt.clear_grad()
        touched = np.unique(ids[mine])
        touched_since_push.append(touched)
        if args.mode == "geo":
            cached_before = np.concatenate(touched_since_push[:-1] or [np.zeros(0, np.int64)])
            np.testing.assert_array_equal(client.last_pulled[0],
                                          np.setdiff1d(touched, cached_before))
            if (step + 1) % args.k_steps == 0:
                np.testing.assert_array_equal(client.last_pushed[0],
                                              np.unique(np.concatenate(touched_since_push)))
                touched_since_push = []
        else:
            np.testing.assert_array_equal(client.last_pulled[0], touched)
            np.testing.assert_array_equal(client.last_pushed[0], touched)
    if args.mode == "sync":
        check_sparse_equals_dense(model, table, start_rows, start_fc, steps, n)
    fleet.stop_worker()
    say(f"ok sparse {args.mode} {args.idiom} worker {w}: pulled and pushed exactly the "
        "touched rows")


def check_sparse_equals_dense(model, table, start_rows, start_fc, steps, n):
    dense = Bag(sparse=False)
    dense.embedding.weight.data[...] = start_rows
    for p, value in zip(dense.fc.parameters(), start_fc):
        p.data[...] = value
    ref = fleet.distributed_optimizer(optimizer.SGD(learning_rate=0.5,
                                                    parameters=dense.parameters()), local=True)
    for step in range(steps):
        ref.minimize(dense, nn.CrossEntropyLoss(), *sparse_batch(step, n))
    np.testing.assert_allclose(table.lookup(np.arange(ROWS)), dense.embedding.weight.data,
                               rtol=1e-10, atol=1e-12)
    for got, want in zip(model.parameters(), dense.fc.parameters()):
        np.testing.assert_allclose(got.data, want.data, rtol=1e-10, atol=1e-12)


# -- faults ----------------------------------------------------------------------------------
def scenario_leave(args):
    """Worker 1 leaves after 2 steps: by an exception in sync mode, by exiting without
    stop_worker otherwise; or (scenario ``stall``) stops pushing for three timeouts; or
    (scenario ``raise``) raises in any mode; or (scenario ``interrupt``) hangs until SIGINT
    ends it, as the MPI launcher ends a hung rank while it ends the job; or (scenario
    ``server-hang``) server 0 hangs at its fourth push, printing ``FAULT <epoch seconds>``."""
    model = fleet.distributed_model(dense_model())
    opt = fleet.distributed_optimizer(adam(model.parameters()), strategy_for(args.mode, 2))
    if args.scenario == "server-hang":
        hang_server_at_push(4)
    if fleet.is_server():
        return serve(args)
    fleet.init_worker()
    w, n = fleet.worker_index(), fleet.worker_num()
    for step in range(6):
        if w == 1 and step == 2 and args.scenario == "stall":
            time.sleep(3 * float(os.environ["FLEETMPI_PS_TIMEOUT"]))
        elif w == 1 and step == 2 and args.scenario == "interrupt":
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(60)
        elif w == 1 and step == 2:
            if args.mode == "sync" or args.scenario == "raise":
                raise ValueError("worker 1 fails on purpose")
            say("worker 1 exits without stop_worker")
            return
        parts, _ = step_batches(0, n, step)
        opt.minimize(model, nn.CrossEntropyLoss(), *parts[0])
    fleet.stop_worker()
    say(f"ok leave {args.mode} worker {w}")


def hang_server_at_push(count):
    """Every rank prints ``PID`` and ``SEGMENTS``; server 0 sleeps a minute at push
    ``count``."""
    from fleetmpi.launch import shm
    from fleetmpi.strategies.ps.server import Server

    say(f"PID {os.getpid()}")
    say(" ".join(["SEGMENTS"] + sorted(shm.mapped_segments(os.getpid()))))
    push, pushes = Server._push, []

    def hanging_push(self, worker, message):
        pushes.append(worker)
        if self.state.server == 0 and len(pushes) == count:
            say(f"FAULT {time.time():.6f}")
            time.sleep(60)
        return push(self, worker, message)
    Server._push = hanging_push


# -- roles, endpoints and fleet.util in each group ------------------------------------------
def scenario_roles(args):
    """Every rank checks its role, the endpoint lists and fleet.util over the workers, the
    servers and everyone; workers print ``ok roles worker <i>``, servers ``ok roles server
    <j>``."""
    from mpi4py import MPI

    from fleetmpi.config.role_maker import endpoint_labels

    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    servers = args.servers
    workers = size - servers
    assert fleet.server_num() == servers and fleet.worker_num() == workers
    assert fleet.worker_endpoints() == endpoint_labels(workers)
    assert fleet.server_endpoints(to_string=True) == ",".join(endpoint_labels(servers, workers))
    if "PADDLE_PSERVERS_IP_PORT_LIST" in os.environ:   # fleetmpirun's variables, as Paddle's
        assert os.environ["PADDLE_PSERVERS_IP_PORT_LIST"] == fleet.server_endpoints(True)
        assert os.environ["PADDLE_TRAINER_ENDPOINTS"] == fleet.worker_endpoints(True)
    strategy = fleet.DistributedStrategy()
    strategy.a_sync_configs = {"send_queue_size": 4}
    strategy.nccl_comm_num = 2
    model = fleet.distributed_model(nn.Linear(4, 2))
    fleet.distributed_optimizer(optimizer.SGD(learning_rate=0.1,
                                              parameters=model.parameters()), strategy)
    assert fleet.applied_strategy().active == ("parameter_server (async)",)
    assert set(fleet.applied_strategy().not_applied) == {"a_sync_configs.send_queue_size",
                                                         "nccl_comm_num"}
    everyone = fleet.util.all_gather(rank, comm_world="all")
    assert everyone == list(range(size)), everyone
    if fleet.is_server():
        j = fleet.server_index()
        assert rank == workers + j and not fleet.is_worker()
        assert fleet.util.all_reduce(j, comm_world="server") == servers * (servers - 1) // 2
        fleet.util.barrier(comm_world="server")
        say(f"ok roles server {j}")
        return
    i = fleet.worker_index()
    assert rank == i and fleet.server_index() == -1 and fleet.is_worker()
    assert fleet.util.all_reduce(i, mode="max") == workers - 1
    assert fleet.util.all_gather(i) == list(range(workers))
    fleet.util.barrier()
    files = [f"part-{k}" for k in range(workers + 1)]
    assert sum(fleet.util.all_gather(len(fleet.util.get_file_shard(files))), 0) == workers + 1
    say(f"ok roles worker {i}")


def main():
    args = parse()
    join(args.servers)
    scenarios = {"sync": scenario_sync, "restart": scenario_restart, "digits": scenario_digits,
                 "sparse": scenario_sparse, "leave": scenario_leave, "stall": scenario_leave,
                 "raise": scenario_leave, "interrupt": scenario_leave,
                 "server-hang": scenario_leave, "roles": scenario_roles}
    scenarios[args.scenario](args)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()

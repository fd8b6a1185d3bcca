"""Across GPUs, one per rank: NCCL's allreduce (native, ring and hierarchical, each op and
dtype, fp16 compression), the other collectives and their asynchronous forms equal the MPI
transport's result on the same data, and data-parallel training over NCCL (sharding too) equals
one process on the global batch.

For machines with two or more GPUs: ``FLEETMPI_DEVICE=gpu python tests/mpi_pytest.py -n N -- -k
multi_gpu`` with N up to the GPUs visible. Every test is marked ``mpi`` and ``gpu``; where a
node's ranks see fewer GPUs than there are ranks on it (or compute on NumPy), every rank skips
and says why, so ``tests/run``'s multi-rank runs skip them on CPU.

Where the MPI transport and NCCL run the same algorithm (ring, hierarchical, tree, chain,
pairwise, linear) they add in the same order, so their results are compared bit for bit; NCCL's
native reductions add in an order of their own and are compared within float rounding.
"""
import numpy as np
import pytest
from mpi4py import MPI

import fleetmpi as fleet
from fleetmpi.core import backend
from fleetmpi.comm import Communicator
from fleetmpi.comm.ops import OPS
from fleetmpi.comm.transport_choice import device_identity
from fleetmpi.core.knobs import AUTO_TRANSPORT

from comm_support import all_data, close, equal, ok, rank_data, single_process, tolerance
from strategy_support import GLOBAL_BATCH, STAGES, by_stage, make_strategy, train, world_gather
from test_user_model import assert_states_equal

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.gpu]
xp = backend.array_module()
DTYPES = ["float16", "float32", "float64", "int32", "int64"]


def visible_gpus():
    """The CUDA devices CuPy sees from this rank (0 without CuPy or a driver)."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # CuPy missing, or no driver or device: no GPU for this rank
        return 0


def gpu_per_rank_or_skip():
    """Skip on every rank, saying why, unless every rank drives a GPU of its own (a decision
    all ranks share, so none goes on into a collective the others skipped)."""
    fleet.init()
    places = MPI.COMM_WORLD.allgather((visible_gpus(), fleet.local_size(), backend.on_gpu()))
    short = [(visible, ranks) for visible, ranks, _ in places if visible < ranks]
    if short:
        visible, ranks = min(short)
        pytest.skip(f"needs {ranks} GPUs, one per rank; this machine has {visible} visible")
    if not all(on_gpu for _, _, on_gpu in places):
        pytest.skip("the arrays live on the host (FLEETMPI_DEVICE=cpu); run with "
                    "FLEETMPI_DEVICE=gpu")


def communicators(**settings):
    """``(over NCCL, over MPI)``: two world communicators with the same ``settings``."""
    gpu_per_rank_or_skip()
    topology = fleet.world.topology()
    return (Communicator(topology, transport="nccl", **settings),
            Communicator(topology, transport="mpi", **settings))


@pytest.fixture(scope="module")
def pair():
    made = communicators()
    yield made
    for comm in made:
        comm.free()


@pytest.fixture(scope="module")
def chunked_pair():
    """Rings and chains in 96-byte chunks: many small NCCL groups per call."""
    made = communicators(chunk_bytes=96)
    yield made
    for comm in made:
        comm.free()


def on_host(value):
    """A collective's array result on the host (alltoall's comes with its splits)."""
    return backend.to_numpy(value[0] if isinstance(value, tuple) else value)


def test_multi_gpu_each_rank_drives_its_own_device_and_auto_takes_nccl(pair):
    import cupy

    identities = MPI.COMM_WORLD.allgather(device_identity())
    ok(len(set(identities)) == len(identities), f"ranks share devices: {identities}")
    want = fleet.local_rank() % visible_gpus()
    ok(cupy.cuda.Device().id == want, f"rank drives device {cupy.cuda.Device().id}, not {want}")
    auto = Communicator(fleet.world.topology(), transport=AUTO_TRANSPORT)
    ok(auto.transport_name == "nccl", f"auto chose {auto.transport_name}")
    auto.free()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algorithm", ["native", "ring", "hierarchical"])
@pytest.mark.parametrize("op", OPS)
def test_multi_gpu_allreduce_over_nccl_equals_mpi(pair, op, algorithm, dtype):
    nccl, mpi = pair
    stack = all_data(nccl.size, 3001, dtype, case=2)
    x = stack[nccl.rank]
    got = on_host(nccl.allreduce(xp.asarray(x), op=op, algorithm=algorithm))
    want = mpi.allreduce(x, op=op, algorithm=algorithm)
    ok(got.dtype == want.dtype and got.shape == want.shape)
    if np.dtype(dtype).kind == "f":
        rtol, atol = tolerance(dtype, nccl.size)
        close(got.astype(np.float64), single_process(stack, op), rtol=rtol, atol=atol)
    if algorithm == "native" and np.dtype(dtype).kind == "f" and op in ("sum", "mean"):
        close(got, want, rtol=rtol, atol=atol)
    else:
        equal(got, want)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("algorithm", ["ring", "hierarchical"])
def test_multi_gpu_fp16_compression_over_nccl_equals_mpi(chunked_pair, algorithm, dtype):
    """Blocking and asynchronous, plain and fused, in chunks: the same float16 bits."""
    nccl, mpi = chunked_pair
    x = rank_data(nccl.rank, 1001, dtype, case=4)
    want = mpi.allreduce(x, algorithm=algorithm, compression="fp16")
    equal(on_host(nccl.allreduce(xp.asarray(x), algorithm=algorithm, compression="fp16")),
          want)
    handle = nccl.allreduce_async(xp.asarray(x), algorithm=algorithm, compression="fp16")
    equal(on_host(handle.wait()), want)
    fused = [xp.asarray(x[:600]), xp.asarray(x[600:])]
    nccl.allreduce_many(fused, algorithm=algorithm, compression="fp16",
                        fuse_grad_size_in_MB=1e-3)
    equal(np.concatenate([on_host(a) for a in fused]), want)


def collectives(rank, size):
    """Test id: (method, argument array, keyword arguments) of this rank, for every collective
    besides allreduce: uneven rows (an empty part on some ranks) and a last-rank root."""
    x = rank_data(rank, 3 * size + 5, np.float32, case=6)
    rows = rank_data(rank, [2, 0, 3, 1][rank % 4] * 3, np.float64, case=7).reshape(-1, 3)
    splits = [(rank + r) % 3 for r in range(size)]
    parts = (np.arange(sum(splits) * 2.0).reshape(-1, 2) + rank).astype(np.float32)
    return {
        "broadcast-tree": ("broadcast", x, {"root": size - 1, "algorithm": "tree"}),
        "broadcast-chain": ("broadcast", x, {"root": size - 1, "algorithm": "chain"}),
        "broadcast-native": ("broadcast", x, {"root": size - 1, "algorithm": "native"}),
        "allgather-ring": ("allgather", rows, {}),
        "allgather-native": ("allgather", x, {"algorithm": "native"}),
        "allgather-stacked": ("allgather", x, {"stack": True}),
        "reduce_scatter-ring": ("reduce_scatter", x, {"op": "mean"}),
        "reduce_scatter-native-max": ("reduce_scatter", x, {"algorithm": "native", "op": "max"}),
        "alltoall": ("alltoall", parts, {"splits": splits}),
        "gather": ("gather", rows, {"root": size - 1}),
        "scatter": ("scatter", x, {"root": size - 1}),
    }


@pytest.mark.parametrize("case", sorted(collectives(0, 2)))
def test_multi_gpu_collectives_and_their_asynchronous_forms_over_nccl_equal_mpi(
        chunked_pair, case):
    nccl, mpi = chunked_pair
    method, x, kwargs = collectives(nccl.rank, nccl.size)[case]
    want = getattr(mpi, method)(x, **kwargs)
    got = getattr(nccl, method)(xp.asarray(x), **kwargs)
    if want is None:
        ok(got is None, f"{method} returned an array off its root")
        return
    equal(on_host(got), on_host(want))
    if method == "alltoall":
        ok(got[1] == want[1], f"alltoall splits {got[1]} != {want[1]}")
    if hasattr(nccl, f"{method}_async"):
        handle = getattr(nccl, f"{method}_async")(xp.asarray(x), **kwargs)
        equal(on_host(handle.wait()), on_host(want))


def test_multi_gpu_send_recv_around_the_ring_and_barriers(pair):
    nccl, _ = pair
    rank, size = nccl.rank, nccl.size
    received = xp.zeros((4, 5), xp.float64)
    mine = xp.asarray(rank_data(rank, 20, np.float64).reshape(4, 5))
    if rank % 2 == 0:
        nccl.send(mine, (rank + 1) % size)
        nccl.recv(received, (rank - 1) % size)
    else:
        nccl.recv(received, (rank - 1) % size)
        nccl.send(mine, (rank + 1) % size)
    equal(on_host(received), rank_data((rank - 1) % size, 20, np.float64).reshape(4, 5))
    nccl.barrier()
    ok(nccl.barrier_async().wait() is None)


@pytest.mark.parametrize("stage", STAGES)
def test_multi_gpu_training_over_nccl_equals_one_process_on_the_global_batch(pair, stage):
    nccl, _ = pair
    if GLOBAL_BATCH % nccl.size:
        pytest.skip(f"the global batch of {GLOBAL_BATCH} does not split over {nccl.size} ranks")
    model, opt, losses = train(by_stage(stage), communicator=nccl)
    ok(opt.communicator is nccl)
    reference, _, reference_losses = train(make_strategy(), local=True)
    close(world_gather(np.array(losses)).mean(axis=0), reference_losses, rtol=1e-10)
    assert_states_equal(model, reference, check=close, rtol=1e-10, atol=1e-12)

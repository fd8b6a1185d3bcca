"""Step time, communication share and scaling efficiency of data-parallel training at N ranks.

A ``Workload`` is a model's gradient buckets and its compute time per step on one rank; a
``Cluster`` is ranks per node, the intra- and inter-node links, and the device's local costs.
``predict`` walks one step as the trainer runs it:

* ``"ring"`` (no strategy flags): each bucket is one ``allreduce_many`` call (argument
  agreement, then the allreduce the communicator chooses by ``fleetmpi.comm.algorithm_choice``:
  the library's own below ``NATIVE_BELOW_BYTES``, the shared-memory one on a single node with
  the MPI transport when it times faster, our ring otherwise);
* ``"hierarchical"`` (``use_hierarchical_allreduce``): the two-level allreduce for every bucket;
* ``"fp16"`` (``fp16_allreduce``): our ring with float16 on the wire for every bucket;
* ``"dgc"`` (after its ramp-up, at ``sparsity``): no bucket reductions; after backward, top-k
  selection per tensor, one ring allgather of every rank's (int32 index, float32 value) pairs,
  and the scatter-add of all ranks' pairs.

Overlap. The trainer reduces a bucket as soon as backward has finished its parameters, but the
reduction is a blocking call made from inside backward: backward resumes only when it returns
(with NCCL the caller's stream waits for the transfer). So nothing overlaps, and
``overlap="none"`` (the default) adds every bucket's time to the compute time. ``"backward"``
models a trainer whose reductions run beside backward (Horovod, PyTorch DDP): bucket ``i`` starts
when backward has produced it and the previous bucket is done; backward's time is spread over
the buckets by their bytes, after a forward pass of ``1 - backward_fraction`` of the compute.

Efficiency is weak scaling at a fixed per-rank batch: ``T(1) / T(N)``, throughput at ``N`` ranks
over ``N`` times one rank's.
"""
import dataclasses
import math
import numbers

import numpy as np

from fleetmpi.comm.algorithm_choice import TIMED, choose
from fleetmpi.comm.topology import topology_of
from fleetmpi.strategies.dgc import INDEX_DTYPE, keep_count
from . import costs
from .buckets import Buckets
from .links import Link

ALGORITHMS = ("ring", "hierarchical", "fp16", "dgc")
OVERLAPS = ("none", "backward")
TRANSPORTS = ("nccl", "mpi")
MAX_RANKS = 1 << 20


@dataclasses.dataclass(frozen=True)
class Device:
    """A rank's local costs: ``gamma`` seconds per byte reduced, ``cast`` seconds per float32
    byte rounded to float16, ``widen`` seconds per float16 byte added or copied into float32,
    ``select`` and ``scatter`` seconds per element of dgc's
    top-k selection and scatter-add, ``call_overhead`` seconds of a collective call's own work
    (Python, argument checks) before any message."""

    name: str
    gamma: float
    cast: float
    widen: float
    select: float
    scatter: float
    call_overhead: float


# A GPU of the P100/V100 class: elementwise work at a few hundred GB/s of memory traffic; the
# collective call's Python side as measured on CPU hosts (tens of microseconds).
GPU = Device("gpu", gamma=1 / 300e9, cast=1 / 300e9, widen=1 / 300e9, select=3e-10,
             scatter=1e-10, call_overhead=30e-6)


@dataclasses.dataclass(frozen=True)
class SharedMemory:
    """The shared-memory allreduce of one node: ``barrier_alpha`` seconds per barrier round,
    ``copy_beta`` seconds per byte copied into or out of the window."""

    barrier_alpha: float
    copy_beta: float


@dataclasses.dataclass(frozen=True)
class Cluster:
    """``gpus_per_node`` ranks per node; ``intra``/``inter`` links; the ranks' ``device``;
    ``transport`` (``"nccl"``, or ``"mpi"`` where the shared-memory allreduce exists on one
    node); ``native``: the library allreduce's own link where it differs from ours; ``shm``;
    ``cores``: when set, the ranks of a node share that many cores (this machine) and compute
    slows by ``ranks per node / cores`` once they outnumber them; ``concurrent_slowdown``: how much slower a
    rank computes while other ranks of its node compute too (measured on this machine)."""

    gpus_per_node: int
    intra: Link
    inter: Link
    device: Device = GPU
    transport: str = "nccl"
    native: Link = None
    shm: SharedMemory = None
    cores: int = None
    concurrent_slowdown: float = 1.0

    def __post_init__(self):
        _check_count("gpus_per_node", self.gpus_per_node)
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is not known; allowed: "
                             f"{', '.join(TRANSPORTS)}")
        if self.cores is not None:
            _check_count("cores", self.cores)

    def layout(self, ranks):
        """(ranks per node, nodes) of a job of ``ranks`` ranks."""
        _check_count("ranks", ranks)
        if ranks > MAX_RANKS:
            raise ValueError(f"ranks={ranks} is more than the planner models ({MAX_RANKS})")
        if ranks <= self.gpus_per_node:
            return ranks, 1
        if ranks % self.gpus_per_node:
            raise ValueError(f"ranks={ranks} is not a whole number of nodes of "
                             f"gpus_per_node={self.gpus_per_node}; use a multiple of "
                             f"{self.gpus_per_node}, or at most {self.gpus_per_node} ranks")
        return self.gpus_per_node, ranks // self.gpus_per_node


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model's ``buckets``, its ``compute_s`` per step on one rank (forward, backward and
    update of the per-rank ``batch``), and the share of the compute that is backward."""

    buckets: Buckets
    compute_s: float
    batch: int = 1
    backward_fraction: float = 2 / 3

    def __post_init__(self):
        if isinstance(self.compute_s, bool) or not isinstance(self.compute_s, numbers.Real) \
                or self.compute_s <= 0:
            raise ValueError(f"compute_s={self.compute_s!r} must be a positive number of "
                             f"seconds")
        _check_count("batch", self.batch)
        if not 0 < self.backward_fraction <= 1:
            raise ValueError(f"backward_fraction={self.backward_fraction!r} must lie in (0, 1]")


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One predicted step: ``comm_s`` is the communication's own time, ``exposed_s`` the part
    of it the step waits for; ``comm_share = exposed_s / step_s``."""

    algorithm: str
    ranks: int
    nodes: int
    step_s: float
    compute_s: float
    comm_s: float
    exposed_s: float
    efficiency: float
    samples_per_s: float
    bucket_algorithms: tuple

    @property
    def comm_share(self):
        return self.exposed_s / self.step_s


def _check_count(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def pick_allreduce(nbytes, algorithm, cluster, ranks, nodes):
    """The allreduce the communicator runs for a bucket of ``nbytes``: its row of
    ``fleetmpi.comm.algorithm_choice.CHOICES`` with the strategy's flags. ``"shm"`` stands for
    a ``TIMED`` row, the communicator's measured choice between shm and ring on one node,
    which ``bucket_seconds`` makes by cost (the ring where the cluster has no shm model)."""
    picked = choose("allreduce", nbytes, cluster.transport, topology_of(ranks, ranks // nodes),
                    compression="fp16" if algorithm == "fp16" else None,
                    hierarchical=algorithm == "hierarchical").algorithm
    if picked == TIMED:
        return "shm" if cluster.shm is not None else "ring"
    return picked


def bucket_seconds(nbytes, algorithm, cluster, ranks):
    """(seconds, algorithm run) of one bucket's ``allreduce_many`` call on ``ranks`` ranks."""
    local, nodes = cluster.layout(ranks)
    if ranks == 1:
        return 0.0, "none"
    dev = cluster.device
    link = cluster.intra if nodes == 1 else cluster.inter
    compression = "fp16" if algorithm == "fp16" else None
    picked = pick_allreduce(nbytes, algorithm, cluster, ranks, nodes)
    call = costs.agreement(ranks, link, dev.call_overhead)
    if picked == "native":
        native = cluster.native if cluster.native is not None and nodes == 1 else link
        return call + costs.native_allreduce(nbytes, ranks, native, dev.gamma), picked
    if picked == "shm":
        shm = call + costs.shm_allreduce(nbytes, ranks, cluster.shm.barrier_alpha,
                                         cluster.shm.copy_beta, dev.gamma)
        ring = call + costs.ring_allreduce(nbytes, ranks, link, dev.gamma, dev.cast, dev.widen,
                                           compression)
        return (shm, "shm") if shm < ring else (ring, "ring")
    if picked == "hierarchical":
        return call + costs.hierarchical_allreduce(nbytes, local, nodes, cluster.intra,
                                                   cluster.inter, dev.gamma, dev.cast,
                                                   dev.widen, compression), picked
    return call + costs.ring_allreduce(nbytes, ranks, link, dev.gamma, dev.cast, dev.widen,
                                       compression), picked


def dgc_seconds(buckets, cluster, ranks, sparsity):
    """Seconds of dgc's exchange after backward: selection, one allgather, scatter-add."""
    if ranks == 1:
        return 0.0
    _, nodes = cluster.layout(ranks)
    dev = cluster.device
    link = cluster.intra if nodes == 1 else cluster.inter
    pairs = sum(keep_count(n, sparsity) for n in buckets.tensor_sizes)
    payload = pairs * (costs.FLOAT32_BYTES + np.dtype(INDEX_DTYPE).itemsize)
    numel = sum(buckets.tensor_sizes)
    return (numel * dev.select + costs.agreement(ranks, link, dev.call_overhead)
            + costs.allgather_ring(payload, ranks, link) + ranks * pairs * dev.scatter)


def _overlapped(workload, compute_s, bucket_times):
    """Step time when bucket ``i``'s reduction runs beside the rest of backward."""
    forward = compute_s * (1 - workload.backward_fraction)
    backward = compute_s * workload.backward_fraction
    total = workload.buckets.total_bytes or 1
    ready, done = forward, forward
    for nbytes, seconds in zip(workload.buckets.nbytes, bucket_times):
        ready += backward * nbytes / total
        done = max(done, ready) + seconds
    return max(forward + backward, done)


def predict(workload, cluster, ranks, algorithm="ring", overlap="none", sparsity=0.999):
    """The ``Prediction`` of one step of ``workload`` on ``ranks`` ranks of ``cluster``."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not known; allowed: "
                         f"{', '.join(ALGORITHMS)}")
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap={overlap!r} is not known; allowed: {', '.join(OVERLAPS)}")
    if not 0 <= sparsity < 1:
        raise ValueError(f"sparsity={sparsity!r} must lie in [0, 1)")
    per_node, nodes = cluster.layout(ranks)
    compute = workload.compute_s
    if ranks > 1:
        compute *= cluster.concurrent_slowdown
    if cluster.cores is not None:  # each node's ranks share its cores, not the job's
        compute *= max(1.0, per_node / cluster.cores)
    if algorithm == "dgc":
        comm = dgc_seconds(workload.buckets, cluster, ranks, sparsity)
        picked = ("allgather",) if ranks > 1 else ()
        step = compute + comm
    else:
        timed = [bucket_seconds(n, algorithm, cluster, ranks) for n in workload.buckets.nbytes]
        comm = sum(t for t, _ in timed)
        picked = tuple(a for _, a in timed)
        step = (compute + comm if overlap == "none"
                else _overlapped(workload, compute, [t for t, _ in timed]))
    return Prediction(algorithm, ranks, nodes, step, compute, comm, step - compute,
                      workload.compute_s / step, ranks * workload.batch / step, picked)


def scaling(workload, cluster, ranks_list, algorithm="ring", overlap="none", sparsity=0.999):
    """``predict`` at every rank count of ``ranks_list`` that the cluster's layout allows
    (a whole number of nodes, or at most one node)."""
    result = []
    for ranks in ranks_list:
        if ranks > cluster.gpus_per_node and ranks % cluster.gpus_per_node:
            continue
        result.append(predict(workload, cluster, ranks, algorithm, overlap, sparsity))
    return result


def powers_of_two(low=1, high=4096):
    return [1 << k for k in range(int(math.log2(low)), int(math.log2(high)) + 1)]

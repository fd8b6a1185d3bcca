"""Every collective algorithm the communicator runs, one line each in ``BUILT_IN``.

``dispatch`` runs ``lookup(collective, name)``; ``call_checks`` checks an ``algorithm=``
argument against the names registered for its collective and asks the algorithm whether it
takes the call; the rows of ``algorithm_choice.CHOICES`` name algorithms registered here.
Adding an algorithm is one module (an ``algorithm.Algorithm`` subclass that runs it) and one
line in ``BUILT_IN``; ``docs/architecture.md`` walks through one.

The order of registration is the order in which error messages list a collective's
algorithms; ``NAMES`` (every name once, in that order, after None) is the table the agreement
codes an ``algorithm=`` argument by, so every rank must register the same algorithms.
"""
from .barrier import DisseminationBarrierAlgorithm
from .broadcast import ChainBroadcastAlgorithm, TreeBroadcastAlgorithm
from .exchange import LinearGatherAlgorithm, LinearScatterAlgorithm, PairwiseAlltoallAlgorithm
from .hierarchical import HierarchicalAllreduceAlgorithm
from .native import (NativeAllgatherAlgorithm, NativeAllreduceAlgorithm,
                     NativeBroadcastAlgorithm, NativeReduceScatterAlgorithm)
from .p2p import PointToPointRecvAlgorithm, PointToPointSendAlgorithm
from .ring import RingAllgatherAlgorithm, RingAllreduceAlgorithm, RingReduceScatterAlgorithm
from .shm import SharedMemoryAllreduceAlgorithm

BUILT_IN = (
    RingAllreduceAlgorithm(),
    HierarchicalAllreduceAlgorithm(),
    NativeAllreduceAlgorithm(),
    SharedMemoryAllreduceAlgorithm(),
    TreeBroadcastAlgorithm(),
    ChainBroadcastAlgorithm(),
    NativeBroadcastAlgorithm(),
    RingAllgatherAlgorithm(),
    NativeAllgatherAlgorithm(),
    RingReduceScatterAlgorithm(),
    NativeReduceScatterAlgorithm(),
    PairwiseAlltoallAlgorithm(),
    LinearGatherAlgorithm(),
    LinearScatterAlgorithm(),
    PointToPointSendAlgorithm(),
    PointToPointRecvAlgorithm(),
    DisseminationBarrierAlgorithm(),
)

ALGORITHMS = {}  # (collective, name) -> the Algorithm
NAMES = [None]


def register(algorithm):
    """Add ``algorithm`` under its collective and name (every rank registers alike)."""
    key = (algorithm.collective, algorithm.name)
    if key in ALGORITHMS:
        raise ValueError(f"{algorithm.collective} algorithm {algorithm.name!r} is registered "
                         f"already: {ALGORITHMS[key]!r}")
    ALGORITHMS[key] = algorithm
    if algorithm.name not in NAMES:
        NAMES.append(algorithm.name)
    return algorithm


def unregister(algorithm):
    """Take back what ``register(algorithm)`` added (a test's own algorithm)."""
    del ALGORITHMS[algorithm.collective, algorithm.name]
    if all(name != algorithm.name for _, name in ALGORITHMS):
        NAMES.remove(algorithm.name)


def algorithms_of(collective):
    """The algorithms registered for ``collective``, in order of registration."""
    return [a for (c, _), a in ALGORITHMS.items() if c == collective]


def lookup(collective, name):
    """The algorithm ``name`` of ``collective``; a ``ValueError`` naming the allowed ones
    when there is none."""
    try:
        found = ALGORITHMS.get((collective, name))
    except TypeError:  # an unhashable name
        found = None
    if found is None:
        article = "an" if collective[0] in "aeiou" else "a"
        allowed = ", ".join(repr(a.name) for a in algorithms_of(collective))
        raise ValueError(f"algorithm={name!r} is not {article} {collective} algorithm; "
                         f"allowed: None, {allowed}")
    return found


for _algorithm in BUILT_IN:
    register(_algorithm)

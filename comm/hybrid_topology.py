"""The hybrid layout: ranks over data x pipeline x sharding x model parallel axes, and a
communicator for each axis.

Ranks are laid out over the axes ``("data", "pipe", "sharding", "model")`` in this order, the
model-parallel axis innermost: ``rank = ((dp * pp_degree + pp) * sharding_degree + sharding)
* mp_degree + mp``. The ranks of one model-parallel group are neighbours, so they sit on one
node whenever ``mp_degree`` divides the ranks per node (Megatron-LM's and Paddle's layout);
tensor parallelism communicates twice per block and direction, far more than the others.

Every axis's communicator is split from the job's ``Communicator`` (``Communicator.split``)
and so runs this library's own algorithms with the job's knobs. ``data_communicator`` joins
the ranks of one model-parallel coordinate (every data, pipeline and sharding coordinate): the
strategies of ``fleetmpi.strategies`` run over it as over a world of their own, its ranks
ordered ``(dp, sharding, pp)`` so that pipeline's own layout (stage ``rank % stages``,
replica ``rank // stages``) and sharding's (groups of ``sharding_degree`` consecutive
replicas) find their coordinates in it.
"""
import collections
import math

AXES = ("data", "pipe", "sharding", "model")
DEGREE_NAMES = {"data": "dp_degree", "pipe": "pp_degree", "sharding": "sharding_degree",
                "model": "mp_degree"}

_current = None


def resolve_degrees(configs, world_size):
    """``{"data": dp, "pipe": pp, "sharding": sh, "model": mp}`` from ``hybrid_configs``
    (a mapping of Paddle's keys); ``dp_degree=-1`` takes what the others leave of
    ``world_size``. Raises a ValueError naming every degree when their product is not the
    world size."""
    degrees = {axis: int(configs[DEGREE_NAMES[axis]]) for axis in AXES}
    for axis, value in degrees.items():
        if value < 1 and not (axis == "data" and value == -1):
            allowed = "-1 (what the others leave) or a positive integer" \
                if axis == "data" else "a positive integer"
            raise ValueError(f"hybrid_configs['{DEGREE_NAMES[axis]}']={value}; allowed: "
                             f"{allowed}")
    others = degrees["pipe"] * degrees["sharding"] * degrees["model"]
    named = ", ".join(f"{DEGREE_NAMES[axis]}={degrees[axis]}" for axis in AXES)
    if degrees["data"] == -1:
        if world_size % others:
            raise ValueError(f"hybrid_configs {named}: mp_degree x pp_degree x "
                             f"sharding_degree = {others} does not divide the world size "
                             f"{world_size}, so no dp_degree fills it")
        degrees["data"] = world_size // others
    elif math.prod(degrees.values()) != world_size:
        raise ValueError(f"hybrid_configs {named}: dp_degree x mp_degree x pp_degree x "
                         f"sharding_degree = {math.prod(degrees.values())}, but the world "
                         f"has {world_size} rank(s); the product must equal the world size")
    return degrees


def coordinates(rank, degrees):
    """``{axis: coordinate}`` of ``rank`` in the layout of ``degrees`` (model innermost)."""
    coords = {}
    for axis in reversed(AXES):
        rank, coords[axis] = divmod(rank, degrees[axis])
    return {axis: coords[axis] for axis in AXES}


def rank_of(coords, degrees):
    """The rank at ``coords`` (the inverse of ``coordinates``)."""
    rank = 0
    for axis in AXES:
        rank = rank * degrees[axis] + coords[axis]
    return rank


class CommunicateTopology:
    """Paddle's ``CommunicateTopology``: the axes of a layout and their sizes, and the
    coordinates of each rank (model innermost, as ``coordinates``). What
    ``HybridCommunicateGroup.topology()`` returns, and what ``PipelineLayer(topology=...)``
    reads its stage from."""

    def __init__(self, hybrid_group_names=AXES, dims=(1, 1, 1, 1)):
        if tuple(hybrid_group_names) != AXES or len(dims) != len(AXES):
            raise ValueError(f"CommunicateTopology({list(hybrid_group_names)}, {list(dims)}): "
                             f"the axes are {list(AXES)}, one size each")
        self.degrees = dict(zip(AXES, (int(d) for d in dims)))
        self.coordinate = collections.namedtuple("Coordinate", AXES)

    def get_hybrid_group_names(self):
        return list(AXES)

    def get_dim(self, axis_name):
        if axis_name not in self.degrees:
            raise ValueError(f"no axis {axis_name!r}; the axes are {list(AXES)}")
        return self.degrees[axis_name]

    get_dim_size = get_dim

    def world_size(self):
        return math.prod(self.degrees.values())

    def get_coord(self, rank):
        if not 0 <= rank < self.world_size():
            raise ValueError(f"rank {rank} is outside the layout of {self.world_size()} ranks")
        return self.coordinate(**coordinates(rank, self.degrees))

    def get_rank(self, **coords):
        return rank_of(coords, self.degrees)


class HybridCommunicateGroup:
    """This rank's coordinates in the hybrid layout and the communicator of each axis
    (Paddle's ``HybridCommunicateGroup`` names). A group of one rank is None: nothing to
    communicate. ``communicator`` is the job's (the world); ``degrees`` as
    ``resolve_degrees`` returns them."""

    def __init__(self, communicator, degrees):
        if math.prod(degrees.values()) != communicator.size:
            raise ValueError(f"degrees {degrees} do not multiply to the world size "
                             f"{communicator.size}")
        self.degrees = dict(degrees)
        self.communicator = communicator
        self.rank = communicator.rank
        self.coords = coordinates(self.rank, degrees)
        self.groups = {axis: self._axis_group(axis) for axis in AXES}
        data_key = ((self.coords["data"] * degrees["sharding"] + self.coords["sharding"])
                    * degrees["pipe"] + self.coords["pipe"])
        # The world's own order already is (dp, sharding, pp) when one of pp and sharding
        # is 1; decided from the degrees alone, so every rank splits or none does.
        same_order = degrees["model"] == 1 and 1 in (degrees["pipe"], degrees["sharding"])
        self.data_communicator = self._split(self.coords["model"], data_key,
                                             communicator.size // degrees["model"], same_order)

    def _split(self, color, key, size, is_world):
        if is_world:
            return self.communicator
        return self.communicator.split(color, key) if size > 1 else None

    def _axis_group(self, axis):
        """The ranks that differ from this one in ``axis`` alone, ordered by that axis."""
        others = dict(self.coords, **{axis: 0})
        size = self.degrees[axis]
        return self._split(rank_of(others, self.degrees), self.coords[axis], size,
                           size == self.communicator.size)

    # -- Paddle's queries ----------------------------------------------------------------
    def topology(self):
        return CommunicateTopology(AXES, [self.degrees[axis] for axis in AXES])

    def get_global_rank(self):
        return self.rank

    def get_model_parallel_rank(self):
        return self.coords["model"]

    def get_model_parallel_world_size(self):
        return self.degrees["model"]

    def get_model_parallel_group(self):
        return self.groups["model"]

    def get_data_parallel_rank(self):
        return self.coords["data"]

    def get_data_parallel_world_size(self):
        return self.degrees["data"]

    def get_data_parallel_group(self):
        return self.groups["data"]

    def get_stage_id(self):
        return self.coords["pipe"]

    def get_pipe_parallel_world_size(self):
        return self.degrees["pipe"]

    def get_pipe_parallel_group(self):
        return self.groups["pipe"]

    def get_sharding_parallel_rank(self):
        return self.coords["sharding"]

    def get_sharding_parallel_world_size(self):
        return self.degrees["sharding"]

    def get_sharding_parallel_group(self):
        return self.groups["sharding"]

    def __repr__(self):
        degrees = ", ".join(f"{DEGREE_NAMES[a]}={self.degrees[a]}" for a in AXES)
        coords = ", ".join(f"{a}={self.coords[a]}" for a in AXES)
        return f"HybridCommunicateGroup(rank {self.rank}: {coords}; {degrees})"


def set_current(group):
    """Make ``group`` (a ``HybridCommunicateGroup``, or None) the job's hybrid layout, which
    tensor-parallel layers built without an explicit group use."""
    global _current
    _current = group


def current():
    """The job's ``HybridCommunicateGroup``, or None when ``fleet.init`` built none."""
    return _current

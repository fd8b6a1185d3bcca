"""Step time and memory of a GPT model laid out over data x pipeline x sharding x model ranks.

A ``Layout`` is the four degrees of ``hybrid_configs`` (``dp``, ``pp``, ``sharding``, ``mp``),
placed as ``fleetmpi.hybrid`` places them: model-parallel ranks innermost (neighbours), then
sharding, pipeline and data. A group of an axis whose ranks sit ``stride`` apart and span
``stride * size`` ranks stays on one node when that fits in ``gpus_per_node``; otherwise it
crosses the nodes' network ports, which the node's ``min(stride, gpus_per_node)`` groups of
that axis share at once.

One step of a ``Transformer`` on ``global_batch`` sequences, as the trainer runs it:

* each data replica (``dp * sharding`` of them) takes ``global_batch / (dp * sharding)``
  sequences in ``micro_batches`` micro-batches through ``pp`` stages of ``n_layer / pp`` blocks;
* a micro-batch's stage time is its compute (forward ``2 * params`` plus attention's
  ``4 * n_layer * seq * n_embd`` flops per token, backward twice that, divided over ``mp``) plus
  the tensor-parallel all-reduces: two per block in forward and two in backward (Megatron-LM's
  ``g`` after attention and after the MLP, and their ``f`` in backward), each of the
  micro-batch's activations ``micro_batch * seq * n_embd`` float32 values over the ``mp``
  group, blocking; plus, with ``pp > 1``, one activation sent forward and one gradient back;
* a 1F1B pipeline takes ``micro_batches + pp - 1`` stage times;
* then the gradients of the stage's ``params / (mp * pp)`` are reduced over the data replicas:
  a ring allreduce over ``dp`` without sharding; with sharding, a reduce-scatter over the
  sharding group, the allreduce of its ``1 / sharding`` part over ``dp``, and the parameters'
  allgather over the sharding group after the update (ZeRO's stage 1 and 2 traffic).

Memory per rank (float32, Adam's two moments): parameters and gradients of the stage's share,
optimizer state divided over the sharding group, and activations of the micro-batches in flight
on the first stage (``min(pp, micro_batches)``) for its blocks: per block ``seq * b * n_embd *
(10 + 24 / mp + 5 * n_head * seq / (n_embd * mp))`` two-byte values (Korthikanti et al. 2022,
"Reducing Activation Recomputation", without sequence parallelism), doubled for float32; with
``recompute``, the block inputs alone.
"""
import dataclasses
import itertools
import numbers

from . import costs
from .predict import Cluster

ADAM_STATE_BYTES = 8  # two float32 moments per parameter
AXES = ("dp", "pp", "sharding", "mp")  # outermost first; mp innermost


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


@dataclasses.dataclass(frozen=True)
class Transformer:
    """A GPT: ``n_layer`` blocks of width ``n_embd`` with ``n_head`` heads, a ``vocab_size``
    embedding tied to the head, ``seq`` tokens per sequence."""

    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    seq: int

    def __post_init__(self):
        for field in dataclasses.fields(self):
            _positive_int(field.name, getattr(self, field.name))
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")

    @property
    def block_params(self):
        """Attention (q, k, v and projection) and the 4x MLP with biases, two layer norms."""
        h = self.n_embd
        return 12 * h * h + 13 * h

    @property
    def params(self):
        return (self.n_layer * self.block_params + (self.vocab_size + self.seq) * self.n_embd
                + 2 * self.n_embd)

    def flops_per_token(self):
        """Forward and backward: three times forward's ``2 * params + 4 * n_layer * seq * h``."""
        return 3 * (2 * self.params + 4 * self.n_layer * self.seq * self.n_embd)

    @classmethod
    def from_spec(cls, spec):
        """``gpt:N_LAYER,N_EMBD,N_HEAD,VOCAB,SEQ`` (the ``--model`` spelling)."""
        name, _, sizes = spec.partition(":")
        parts = sizes.split(",")
        if name != "gpt" or len(parts) != 5 or not all(p.isdigit() for p in parts):
            raise ValueError(f"model {spec!r}: a GPT is gpt:N_LAYER,N_EMBD,N_HEAD,VOCAB,SEQ "
                             f"(e.g. gpt:24,2048,16,50304,1024)")
        return cls(*map(int, parts))


@dataclasses.dataclass(frozen=True)
class Layout:
    dp: int = 1
    pp: int = 1
    sharding: int = 1
    mp: int = 1

    def __post_init__(self):
        for axis in AXES:
            _positive_int(axis, getattr(self, axis))

    @property
    def world(self):
        return self.dp * self.pp * self.sharding * self.mp

    def stride(self, axis):
        """Ranks between neighbours of ``axis`` (mp innermost)."""
        inner = AXES[AXES.index(axis) + 1:]
        stride = 1
        for name in inner:
            stride *= getattr(self, name)
        return stride

    def describe(self):
        return " x ".join(f"{axis}{getattr(self, axis)}" for axis in AXES
                          if getattr(self, axis) > 1) or "1 rank"

    @classmethod
    def from_spec(cls, spec):
        """``dp=2,mp=4,pp=2,sharding=1`` (missing degrees are 1)."""
        degrees = {}
        for part in spec.split(","):
            name, _, value = part.partition("=")
            if name not in AXES or not value.isdigit():
                raise ValueError(f"layout {spec!r}: each part is AXIS=DEGREE with AXIS one of "
                                 f"{', '.join(AXES)}, not {part!r}")
            degrees[name] = int(value)
        return cls(**degrees)


@dataclasses.dataclass(frozen=True)
class HybridPrediction:
    """One step: ``compute_s`` of the micro-batches themselves, ``tensor_parallel_s`` of the
    all-reduces on the pipeline's critical path, ``pipeline_s`` of its bubble and of the
    stage-to-stage sends, ``data_parallel_s`` of the gradient reduction; they add up to
    ``step_s``. ``memory_bytes`` per rank."""

    layout: Layout
    step_s: float
    compute_s: float
    tensor_parallel_s: float
    pipeline_s: float
    data_parallel_s: float
    memory_bytes: float
    samples_per_s: float


def axis_link(cluster, layout, axis):
    """The link a group of ``axis`` communicates over (see the module docstring)."""
    stride, size = layout.stride(axis), getattr(layout, axis)
    if stride * size <= cluster.gpus_per_node:
        return cluster.intra
    return cluster.inter.shared(min(stride, cluster.gpus_per_node))


def _allreduce(nbytes, ranks, link, cluster):
    dev = cluster.device
    return costs.ring_allreduce(nbytes, ranks, link, dev.gamma) if ranks > 1 else 0.0


def check_layout(model, layout, global_batch, micro_batches):
    _positive_int("global_batch", global_batch)
    _positive_int("micro_batches", micro_batches)
    replicas = layout.dp * layout.sharding
    if global_batch % (replicas * micro_batches):
        raise ValueError(f"global_batch={global_batch} must split into dp x sharding = "
                         f"{replicas} replicas of micro_batches={micro_batches} equal "
                         f"micro-batches")
    if model.n_head % layout.mp or model.vocab_size % layout.mp:
        raise ValueError(f"mp={layout.mp} must divide n_head={model.n_head} and "
                         f"vocab_size={model.vocab_size}")
    if layout.pp > model.n_layer:
        raise ValueError(f"pp={layout.pp} is more stages than n_layer={model.n_layer} blocks")


def predict_layout(model, layout, cluster, global_batch, micro_batches=1, flops=100e12,
                   recompute=False):
    """The ``HybridPrediction`` of one step; ``flops``: a rank's achieved flop/s."""
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a fleetmpi.plan.Cluster, not {type(cluster).__name__}")
    if isinstance(flops, bool) or not isinstance(flops, numbers.Real) or flops <= 0:
        raise ValueError(f"flops={flops!r} must be a positive number of flop/s")
    check_layout(model, layout, global_batch, micro_batches)
    if layout.world > cluster.gpus_per_node:
        cluster.layout(layout.world)  # a whole number of nodes, or an error saying so
    micro = global_batch // (layout.dp * layout.sharding * micro_batches)
    blocks = model.n_layer / layout.pp
    activation = micro * model.seq * model.n_embd * costs.FLOAT32_BYTES
    stage_compute = (micro * model.seq * model.flops_per_token()
                     / (layout.mp * layout.pp) / flops)
    tensor_parallel = 4 * blocks * _allreduce(activation, layout.mp,
                                              axis_link(cluster, layout, "mp"), cluster)
    p2p = 0.0
    if layout.pp > 1:
        link = axis_link(cluster, layout, "pp")
        p2p = 2 * (link.alpha + activation / layout.mp * link.beta)
    rounds = micro_batches + layout.pp - 1
    stage_params = model.params / (layout.mp * layout.pp)
    grads = stage_params * costs.FLOAT32_BYTES
    dp_link, sh_link = axis_link(cluster, layout, "dp"), axis_link(cluster, layout, "sharding")
    dev = cluster.device
    if layout.sharding > 1:
        data_parallel = (costs.reduce_scatter_ring(grads, layout.sharding, sh_link, dev.gamma)
                         + _allreduce(grads / layout.sharding, layout.dp, dp_link, cluster)
                         + costs.allgather_ring(grads / layout.sharding, layout.sharding,
                                                sh_link))
    else:
        data_parallel = _allreduce(grads, layout.dp, dp_link, cluster)
    step = rounds * (stage_compute + tensor_parallel + p2p) + data_parallel
    per_block = model.seq * micro * model.n_embd * 2 * (
        10 + 24 / layout.mp + 5 * model.n_head * model.seq / (model.n_embd * layout.mp))
    if recompute:
        per_block = model.seq * micro * model.n_embd * costs.FLOAT32_BYTES
    in_flight = min(layout.pp, micro_batches)
    memory = (2 * grads + stage_params * ADAM_STATE_BYTES / layout.sharding
              + in_flight * blocks * per_block)
    return HybridPrediction(layout, step, micro_batches * stage_compute,
                            rounds * tensor_parallel,
                            (rounds - micro_batches) * stage_compute + rounds * p2p,
                            data_parallel, memory, global_batch / step)


def layouts(world, model, global_batch, micro_batches):
    """Every ``Layout`` of ``world`` ranks the model and batch allow."""
    _positive_int("world", world)
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    found = []
    for dp, pp, sharding in itertools.product(divisors, repeat=3):
        if world % (dp * pp * sharding):
            continue
        layout = Layout(dp, pp, sharding, world // (dp * pp * sharding))
        try:
            check_layout(model, layout, global_batch, micro_batches)
        except ValueError:
            continue
        found.append(layout)
    return found


def rank_layouts(model, cluster, world, global_batch, micro_batches=1, flops=100e12,
                 memory_bytes=None, recompute=False):
    """Predictions of every layout of ``world`` ranks that fits ``memory_bytes`` per rank,
    fastest first."""
    predictions = [predict_layout(model, layout, cluster, global_batch, micro_batches, flops,
                                  recompute)
                   for layout in layouts(world, model, global_batch, micro_batches)]
    fitting = [p for p in predictions if memory_bytes is None or p.memory_bytes <= memory_bytes]
    return sorted(fitting, key=lambda p: p.step_s)

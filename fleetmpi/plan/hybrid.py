"""Step time and memory per rank of a GPT under a hybrid layout (data x pipeline x sharding x
tensor parallel), and the layouts of a cluster ranked by predicted step time.

The model (``GPTShape``): ``layers`` transformer blocks of width ``h`` with ``heads`` heads over
``seq`` tokens, a vocabulary of ``vocab``; ``P = layers * 12 h^2 + (vocab + seq) h`` parameters.
A step of the global ``batch`` costs ``6 P`` floating point operations per token (forward and
backward of every weight), spread over the ``mp x pp`` ranks of one replica and run at the
device's ``flops``.

Communication per step, each priced with ``costs`` on the link its group runs over (a group of
ranks inside one node on the intra-node link, otherwise the inter-node one; ranks are laid out
mp innermost, then sharding, pipeline and data, ``fleetmpi.comm.hybrid_topology``):

* tensor parallel: per block and micro-batch two ring allreduces of the activation
  (``b_micro * seq * h`` values) in forward, after the attention and after the MLP, and two in
  backward, into their inputs; plus the embedding's in forward and the output projection's
  in backward;
* pipeline: per micro-batch and stage boundary one activation sent forward and its gradient
  back; the schedule's bubble makes the compute ``(m + pp - 1) / m`` of its share (``m``
  micro-batches, 1F1B);
* data parallel and sharding: the rank's gradients (``P / (mp pp)`` values) averaged over the
  ``dp x sharding`` ranks of its model-parallel coordinate, a ring allreduce (sharding's
  reduce-scatter and broadcast move the same bytes).

Memory per rank: parameters and gradients ``P / (mp pp)`` values each, Adam's two moments
divided by ``sharding``, and the activations of the micro-batches in flight on the first stage
(``min(m, pp)``), per block ``seq b_micro h (34 + 5 heads seq / h)`` bytes at 16 bits
(Korthikanti et al. 2022), scaled to the value size and divided by ``mp``.
"""
import dataclasses
import itertools
import math

from . import costs

AXES = ("dp", "pp", "sharding", "mp")
# Activation-sized allreduces of the model-parallel group per micro-batch: per block the
# attention's and the MLP's row-parallel outputs in forward and their column-parallel inputs'
# gradients in backward; outside the blocks the token embedding's lookup in forward and the
# output projection's input gradient in backward (tests/test_plan_hybrid.py counts them in a
# step of nn.GPT).
ALLREDUCES_PER_BLOCK = 4
ALLREDUCES_OUTSIDE_BLOCKS = 2


@dataclasses.dataclass(frozen=True)
class GPTShape:
    layers: int
    width: int
    heads: int
    vocab: int
    seq: int
    batch: int
    value_bytes: int = 4

    def __post_init__(self):
        for name in ("layers", "width", "heads", "vocab", "seq", "batch", "value_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")

    @property
    def parameters(self):
        return self.layers * 12 * self.width ** 2 + (self.vocab + self.seq) * self.width


@dataclasses.dataclass(frozen=True)
class HybridPrediction:
    layout: dict
    step_s: float
    compute_s: float
    tensor_parallel_s: float
    pipeline_s: float
    data_parallel_s: float
    memory_bytes: float


def check_layout(layout, ranks, model):
    """``layout`` (``{"dp": .., "pp": .., "sharding": .., "mp": ..}``, missing ones 1) as a full
    dict; refuses a product other than ``ranks`` naming every degree, and degrees the model
    cannot be split by."""
    unknown = set(layout) - set(AXES)
    if unknown:
        raise ValueError(f"unknown degree(s) {sorted(unknown)}; allowed: {', '.join(AXES)}")
    full = {axis: int(layout.get(axis, 1)) for axis in AXES}
    named = ", ".join(f"{axis}={full[axis]}" for axis in AXES)
    if any(value < 1 for value in full.values()):
        raise ValueError(f"layout {named}: every degree must be a positive integer")
    if math.prod(full.values()) != ranks:
        raise ValueError(f"layout {named}: the degrees multiply to "
                         f"{math.prod(full.values())}, not the {ranks} ranks")
    for what, value, degree in (("heads", model.heads, full["mp"]),
                                ("vocab", model.vocab, full["mp"]),
                                ("layers", model.layers, full["pp"]),
                                ("batch", model.batch, full["dp"] * full["sharding"])):
        if value % degree:
            raise ValueError(f"layout {named}: {what}={value} does not split over {degree}")
    return full


def _group_link(cluster, span):
    """The link of a group whose ranks lie ``span`` ranks apart at most."""
    return cluster.intra if span <= cluster.gpus_per_node else cluster.inter


def _allreduce(nbytes, ranks, link, cluster):
    device = cluster.device
    return costs.ring_allreduce(nbytes, ranks, link, device.gamma) + device.call_overhead \
        if ranks > 1 else 0.0


def tensor_parallel_seconds(model, layout, cluster, micro_batches):
    """The tensor-parallel allreduces of one step on the busiest stage: per micro-batch
    ``ALLREDUCES_PER_BLOCK`` per block of the stage (two in forward, two in backward) of the
    micro-batch's activation, and those outside the blocks (both on one stage without
    pipeline, one on the first and one on the last stage with it). The parallel cross
    entropy's allreduces of a few numbers per token are left out."""
    mp = layout["mp"]
    if mp == 1:
        return 0.0
    b_micro = model.batch // (layout["dp"] * layout["sharding"]) // micro_batches
    activation = b_micro * model.seq * model.width * model.value_bytes
    one = _allreduce(activation, mp, _group_link(cluster, mp), cluster)
    blocks_per_stage = model.layers // layout["pp"]
    outside = ALLREDUCES_OUTSIDE_BLOCKS if layout["pp"] == 1 else 1
    return micro_batches * (ALLREDUCES_PER_BLOCK * blocks_per_stage + outside) * one


def predict_layout(model, layout, cluster, flops, micro_batches=None):
    """The ``HybridPrediction`` of ``model`` under ``layout`` (degrees by ``AXES``) on
    ``cluster`` whose devices run ``flops`` floating point operations per second."""
    ranks = math.prod(layout.get(axis, 1) for axis in AXES)
    layout = check_layout(layout, ranks, model)
    dp, pp, sharding, mp = (layout[axis] for axis in AXES)
    replicas = dp * sharding
    micro = micro_batches or (pp if pp > 1 else 1)
    micro = max(1, min(micro, model.batch // replicas))
    tokens = model.batch // replicas * model.seq
    compute = 6 * model.parameters * tokens / (mp * pp) / flops
    compute *= (micro + pp - 1) / micro
    tp = tensor_parallel_seconds(model, layout, cluster, micro)
    b_micro = model.batch // replicas // micro
    activation = b_micro * model.seq * model.width * model.value_bytes
    pipe_link = _group_link(cluster, mp * sharding * pp)
    pipeline = 0.0 if pp == 1 else \
        2 * micro * (pp - 1) * (pipe_link.alpha + activation * pipe_link.beta)
    local = model.parameters / (mp * pp) * model.value_bytes
    data = _allreduce(local, replicas, _group_link(cluster, ranks), cluster)
    per_block = model.seq * b_micro * model.width * (34 + 5 * model.heads * model.seq /
                                                     model.width) * model.value_bytes / 2
    activations = model.layers / pp * min(micro, pp) * per_block / mp
    memory = 2 * local + 2 * local / sharding + activations
    return HybridPrediction(layout, compute + tp + pipeline + data, compute, tp, pipeline, data,
                            memory)


def layouts(ranks, model):
    """Every layout of ``ranks`` ranks the model splits by, as dicts by ``AXES``."""
    found = []
    divisors = [d for d in range(1, ranks + 1) if ranks % d == 0]
    for dp, pp, sharding in itertools.product(divisors, repeat=3):
        if ranks % (dp * pp * sharding):
            continue
        layout = {"dp": dp, "pp": pp, "sharding": sharding, "mp": ranks // (dp * pp * sharding)}
        try:
            check_layout(layout, ranks, model)
        except ValueError:
            continue
        found.append(layout)
    return found


def rank_layouts(model, ranks, cluster, flops, memory_bytes=None, micro_batches=None):
    """Every layout's prediction, fastest first; with ``memory_bytes``, those that fit it
    before those that do not."""
    predictions = [predict_layout(model, layout, cluster, flops, micro_batches)
                   for layout in layouts(ranks, model)]
    fits = (lambda p: memory_bytes is None or p.memory_bytes <= memory_bytes)
    return sorted(predictions, key=lambda p: (not fits(p), p.step_s))


def describe(layout):
    return " x ".join(f"{axis}{layout[axis]}" for axis in AXES if layout[axis] > 1) or "1 rank"

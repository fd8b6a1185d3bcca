"""Megatron-LM's tensor-parallel layers (Paddle's ``fleet.meta_parallel`` names):
``ColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding`` and
``ParallelCrossEntropy``.

Each splits its weight over the ranks of a model-parallel group: a rank holds one contiguous
part and the layer's forward and backward communicate through the operations of
``functional.tensor_parallel``. ``mp_group`` is that group's ``Communicator``; left None it is
the model-parallel group of the layout ``fleet.init(is_collective=True, strategy=...)`` built
from ``hybrid_configs``, or no group at all (one rank: the serial layer).

A part starts as the same part of the serial layer's initial weight: the layer draws the whole
weight from the shared generator (as the serial layer does, the same draws in the same order)
and keeps its own slice, so a tensor-parallel model built from a seed starts from the weights
of the serial model built from that seed. An ``Assign`` initializer in ``weight_attr`` holds
the rank's part, as in Paddle (``initializer.part_values``). ``full_weight_shape`` and
``weight_part`` say which slice a rank holds (``initialize_weight`` uses them to re-initialise
a layer the same way).
"""
import dataclasses

import numpy as np

from ..core import backend
from ..autograd import as_array
from fleetmpi.comm import hybrid_topology
from . import functional as F
from . import initializer
from .functional.loss import _check_reduction
from .layer import Layer
from .param_attr import needed
from .basic_layers import check_input, check_positive_int


def model_parallel_group(mp_group=None):
    """``mp_group``, or when None the model-parallel communicator of the current hybrid
    layout; None where that group would be this rank alone."""
    if mp_group is None:
        layout = hybrid_topology.current()
        mp_group = None if layout is None else layout.get_model_parallel_group()
    return mp_group if mp_group is not None and mp_group.size > 1 else None


def _split(what, value, group):
    size = 1 if group is None else group.size
    if value % size:
        raise ValueError(f"{what}={value} does not split over the {size} ranks of the "
                         f"model-parallel group; it must be a multiple of {size}")
    return value // size


def initialize_weight(layer, init):
    """Set ``layer.weight`` from the initializer ``init``: for a tensor-parallel layer its
    own part (``initializer.part_values``), the values the serial layer would get from the
    same draws."""
    weight = layer.weight
    part = getattr(layer, "weight_part", ...)
    if not weight.materialized and part is ...:
        # Under LazyGuard: the initializer is recorded in place of the one the layer gave,
        # so that sharding stage 3 draws only this rank's shard of it.
        weight.defer(init, weight.deferred_init.layer)
        return
    shape = getattr(layer, "full_weight_shape", weight.shape)
    weight.set_value(initializer.part_values(init, shape, part))


def _check_fuse_matmul_bias(value):
    if not isinstance(value, bool):
        raise ValueError(f"fuse_matmul_bias must be True or False, not {value!r}")


class TensorParallelLayer(Layer):
    """A layer whose parameters are split over a model-parallel group (``split_index`` says
    which part each rank holds)."""

    def __init__(self, mp_group, dtype, name=None):
        super().__init__(dtype, name_scope=name)
        self.mp_group = model_parallel_group(mp_group)
        self.mp_rank = 0 if self.mp_group is None else self.mp_group.rank
        self.mp_size = 1 if self.mp_group is None else self.mp_group.size

    def _part_parameter(self, full_shape, part, attr=None, default_initializer=None,
                        is_bias=False):
        """A parameter holding ``part`` of a ``full_shape`` weight, its values from the
        initializer of ``attr`` (the ``weight_attr``) when it has one
        (``initializer.part_values``)."""
        attr = needed(attr, "weight_attr")
        init = attr.initializer or default_initializer
        if init is None:
            init = initializer.Constant(0.0) if is_bias else initializer.XavierUniform()
        values = initializer.part_values(init, full_shape, part)
        parameter = self.create_parameter(values.shape,
                                          dataclasses.replace(attr, initializer=None),
                                          default_initializer=values)
        parameter.is_distributed = self.mp_size > 1 and tuple(values.shape) != tuple(full_shape)
        return parameter

    def _range(self, width, rank=None):
        rank = self.mp_rank if rank is None else rank
        return slice(rank * width, (rank + 1) * width)

    def split_index(self, name, rank):
        """The index into the serial layer's parameter ``name`` of the part rank ``rank`` of
        the group holds; None for a parameter every rank holds whole."""
        raise NotImplementedError


class ColumnParallelLinear(TensorParallelLayer):
    """``y = x @ weight + bias`` with the output features split: a rank holds
    ``out_features / size`` columns of the weight and the bias. The input is used whole
    (its gradient summed over the group); ``gather_output=True`` joins the parts into the
    whole output, False leaves each rank its part (for a ``RowParallelLinear`` with
    ``input_is_parallel=True``, or ``ParallelCrossEntropy``).

    Paddle's arguments and defaults: ``has_bias=None`` (or False) makes no bias, as Paddle's
    layer; ``fuse_matmul_bias`` is accepted either way, the product and the bias being one
    operation (``F.linear``) here already.

    ``output_blocks`` (not a Paddle argument): the output features are that many equal blocks
    each split over the ranks, so a fused query-key-value projection keeps its own heads of
    each block on a rank; needs ``gather_output=False``."""

    def __init__(self, in_features, out_features, weight_attr=None, has_bias=None,
                 gather_output=True, fuse_matmul_bias=False, mp_group=None, name=None, dtype=None,
                 output_blocks=1):
        super().__init__(mp_group, dtype, name)
        _check_fuse_matmul_bias(fuse_matmul_bias)
        self.in_features = check_positive_int("in_features", in_features)
        self.out_features = check_positive_int("out_features", out_features)
        self.output_blocks = check_positive_int("output_blocks", output_blocks)
        if output_blocks > 1 and gather_output:
            raise ValueError("ColumnParallelLinear: output_blocks > 1 leaves each rank its part "
                             "of every block; use gather_output=False")
        if out_features % (output_blocks * self.mp_size):
            raise ValueError(f"out_features={out_features} does not split into "
                             f"{output_blocks} block(s) of equal parts over the "
                             f"{self.mp_size} ranks of the model-parallel group")
        block = out_features // output_blocks // self.mp_size
        self.gather_output = bool(gather_output)
        self.full_weight_shape = (in_features, out_features)
        self._block = block
        self.weight_part = self.split_index("weight", self.mp_rank)
        self.weight = self._part_parameter(self.full_weight_shape, self.weight_part, weight_attr)
        self.bias = self._part_parameter((out_features,), self.weight_part[1], is_bias=True) \
            if has_bias else None

    def _columns(self, rank):
        """Rank ``rank``'s columns: its part of every block."""
        if self.output_blocks == 1:
            return self._range(self._block, rank)
        width = self.out_features // self.output_blocks
        return np.concatenate([np.arange(b * width + rank * self._block,
                                         b * width + (rank + 1) * self._block)
                               for b in range(self.output_blocks)])

    def split_index(self, name, rank):
        columns = self._columns(rank)
        return (slice(None), columns) if name == "weight" else (columns,)

    def extra_repr(self):
        return (f"{self.in_features}, {self.out_features}, rank part "
                f"{self.weight.shape[1]}, gather_output={self.gather_output}")

    def forward(self, x):
        check_input(self, x, (), self.in_features, axis=-1)
        y = F.linear(F.copy_to_model_parallel(x, self.mp_group), self.weight, self.bias)
        return F.gather_from_model_parallel(y, self.mp_group) if self.gather_output else y


class RowParallelLinear(TensorParallelLayer):
    """``y = x @ weight + bias`` with the input features split: a rank holds
    ``in_features / size`` rows of the weight, multiplies its part of the input and the
    partial products are summed over the group; the bias (whole on every rank) is added after.
    ``input_is_parallel=True``: the input already is this rank's part (a
    ``ColumnParallelLinear``'s output without ``gather_output``); False: the whole input,
    of which the layer takes its part."""

    def __init__(self, in_features, out_features, weight_attr=None, has_bias=True,
                 input_is_parallel=False, fuse_matmul_bias=False, mp_group=None, name=None,
                 dtype=None):
        super().__init__(mp_group, dtype, name)
        _check_fuse_matmul_bias(fuse_matmul_bias)
        self.in_features = check_positive_int("in_features", in_features)
        self.out_features = check_positive_int("out_features", out_features)
        self.input_is_parallel = bool(input_is_parallel)
        self._rows = _split("in_features", in_features, self.mp_group)
        self.full_weight_shape = (in_features, out_features)
        self.weight_part = self.split_index("weight", self.mp_rank)
        self.weight = self._part_parameter(self.full_weight_shape, self.weight_part, weight_attr)
        self.bias = self.create_parameter((out_features,), is_bias=True) if has_bias else None

    def split_index(self, name, rank):
        return (self._range(self._rows, rank), slice(None)) if name == "weight" else None

    def extra_repr(self):
        return (f"{self.in_features}, {self.out_features}, rank part {self.weight.shape[0]}, "
                f"input_is_parallel={self.input_is_parallel}")

    def forward(self, x):
        if self.input_is_parallel:
            check_input(self, x, (), self.weight.shape[0], axis=-1)
        else:
            check_input(self, x, (), self.in_features, axis=-1)
            x = F.scatter_to_model_parallel(x, self.mp_group)
        y = F.reduce_from_model_parallel(F.linear(x, self.weight), self.mp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(TensorParallelLayer):
    """An ``Embedding`` whose rows (the vocabulary) are split: a rank holds rows
    ``[rank * V / size, (rank + 1) * V / size)``, looks up the ids in its range (zeros for the
    others) and the group sums the lookups."""

    def __init__(self, num_embeddings, embedding_dim, weight_attr=None, mp_group=None, name=None,
                 dtype=None):
        super().__init__(mp_group, dtype, name)
        self.num_embeddings = check_positive_int("num_embeddings", num_embeddings)
        self.embedding_dim = check_positive_int("embedding_dim", embedding_dim)
        self._rows = _split("num_embeddings", num_embeddings, self.mp_group)
        self.vocab_start = self.mp_rank * self._rows
        self.full_weight_shape = (num_embeddings, embedding_dim)
        self.weight_part = self.split_index("weight", self.mp_rank)
        self.weight = self._part_parameter(self.full_weight_shape, self.weight_part, weight_attr,
                                           initializer.Normal())

    def split_index(self, name, rank):
        return self._range(self._rows, rank), slice(None)

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}, rank part {self.weight.shape[0]}"

    def forward(self, ids):
        ids = backend.asarray(as_array(ids))
        F.common.check_indices(ids, self.num_embeddings)
        if self.mp_group is None:
            return F.embedding(ids, self.weight)
        rows = self.weight.shape[0]
        mine = (ids >= self.vocab_start) & (ids < self.vocab_start + rows)
        local = backend.array_module().where(mine, ids - self.vocab_start, 0)
        found = F.embedding(local, self.weight) * mine[..., None].astype(self.weight.dtype)
        return F.reduce_from_model_parallel(found, self.mp_group)


class ParallelCrossEntropy(Layer):
    """Softmax cross entropy of logits split over the vocabulary across the model-parallel
    group (``functional.parallel_cross_entropy``); the loss of the whole logits on every
    rank, the logits never gathered.

    As Paddle's layer it returns the loss of each token, of shape ``(..., 1)`` for logits
    ``(..., V / size)`` (``reduction="none"``, the default); ``reduction="mean"`` or
    ``"sum"`` (not a Paddle argument) reduces them in the same operation."""

    def __init__(self, mp_group=None, name=None, reduction="none"):
        super().__init__(name_scope=name)
        _check_reduction(reduction)
        self.mp_group = model_parallel_group(mp_group)
        self.reduction = reduction

    def extra_repr(self):
        return f"reduction={self.reduction!r}"

    def forward(self, input, label):  # noqa: A002 - Paddle's argument name
        loss = F.parallel_cross_entropy(input, label, self.mp_group, self.reduction)
        return loss.reshape(list(loss.shape) + [1]) if self.reduction == "none" else loss

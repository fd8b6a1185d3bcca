"""``recompute``: the checkpointed parts of the model keep no activations through forward and
are computed again in backward, trading computation for activation memory.

``recompute_configs["checkpoints"]`` names sublayers of the model at any depth by their dotted
names from ``named_sublayers()`` (``"blocks.0"``, ``"encoder.layer3"``):

* a sublayer of an ``nn.Sequential`` is a boundary, as in Paddle's static graph: the steps
  of that Sequential are cut after every checkpoint into segments, and every segment but
  the last is recomputed (a name of an activation that kernel fusion folded into the layer
  before it means that fused step). The last segment is not dropped: backward starts with it,
  so recomputing it at once would cost time and lower no peak.
* any other sublayer is itself the recomputed segment: each call of it.

A recomputed segment runs through ``fleetmpi.autograd.recompute.run_recomputed``: forward keeps
only its inputs, backward runs it again (same dropout masks, same amp casts, batch-norm running
statistics moved once) and backpropagates through it, reporting each parameter's gradient as
final in the order the run without recompute does, so the bucketed allreduce overlaps backward
as before. Gradients are those of the run without recompute bit for bit.

The strategy acts by giving the affected layers a ``forward`` of their own (an instance
attribute) for the forward stage of each step, which both training idioms run around the
model's forward; the layers get their own back afterwards, also when the step fails.

``enable_offload`` also moves the kept inputs of recomputed segments to host memory (a
device-to-host copy into page-locked buffers on a GPU, a copy into preallocated NumPy buffers on
CPU) and back before the segment is recomputed; the model's own input is not copied. The host
buffers are allocated once and reused, which is why offload needs ``checkpoint_shape``: the one
fixed shape, batch dimension included, of every checkpoint (the output of a Sequential's
checkpoint, the input of another checkpoint).
"""
import numpy as np

from fleetmpi.core import backend
from fleetmpi.autograd import Tensor
from fleetmpi.core.capture_checks import check_host_read
from fleetmpi.autograd.recompute import ActivationMeter, held_activation_bytes, run_recomputed
from fleetmpi.nn import Sequential
from .base import Strategy
from .configs import RecomputeConfig

__all__ = ["ActivationMeter", "HostCheckpoints", "Recompute", "Segment", "checkpoint_forwards",
           "cut_into_segments", "held_activation_bytes"]


# -- where the checkpoints are ----------------------------------------------------------------

class Segment:
    """Consecutive steps ``(layer, fused activation or None)`` of a Sequential's steps;
    ``checkpoint``: the dotted name of the checkpoint whose output ends it (None when it ends
    the Sequential without one). Calling it runs the steps as ``Sequential.forward`` does."""

    def __init__(self, steps, checkpoint):
        self.steps = steps
        self.checkpoint = checkpoint

    @property
    def layers(self):
        return [layer for layer, _ in self.steps]

    def __call__(self, x):
        for layer, act in self.steps:
            x = layer.forward_act(x, act) if act else layer(x)
        return x


def cut_into_segments(sequential, names, prefix=""):
    """``sequential``'s steps cut after the step of each of its children ``names`` (the
    checkpoints ``prefix + name``)."""
    steps = sequential.steps()
    children = sequential.named_children()
    step_of = {}
    position = 0
    for index, (layer, act) in enumerate(steps):
        while children[position][1] is not layer:
            position += 1
        step_of[children[position][0]] = index
        if act:
            step_of[children[position + 1][0]] = index
    ends = {}
    for name in names:
        ends.setdefault(step_of[name], prefix + name)
    segments, first = [], 0
    for end in sorted(ends):
        segments.append(Segment(steps[first:end + 1], ends[end]))
        first = end + 1
    if first < len(steps):
        segments.append(Segment(steps[first:], None))
    return segments


def _resolve(model, checkpoints):
    """``(boundaries, wholes)``: for each Sequential holding checkpoints, ``(its dotted name,
    it, [its children's names])``; and ``(name, layer)`` of each other checkpoint."""
    sublayers = dict(model.named_sublayers())
    unknown = [name for name in checkpoints if name not in sublayers]
    if unknown:
        names = list(sublayers)
        shown = names[:12] + (["..."] if len(names) > 12 else [])
        raise ValueError(f"recompute checkpoints {unknown} are not sublayers of the "
                         f"{type(model).__name__}; checkpoints are dotted names from its "
                         f"named_sublayers(): {shown}")
    boundaries, wholes = {}, []
    for name in checkpoints:
        parent_name, _, child = name.rpartition(".")
        parent = sublayers[parent_name] if parent_name else model
        if isinstance(parent, Sequential):
            boundaries.setdefault(parent_name, (parent_name, parent, []))[2].append(child)
        else:
            wholes.append((name, sublayers[name]))
    return list(boundaries.values()), wholes


# -- offload ------------------------------------------------------------------------------------

class HostCheckpoints:
    """Page-locked (GPU) or plain NumPy (CPU) host buffers of ``shape`` for offloaded inputs,
    allocated once and reused every step; a buffer is busy from ``store`` until ``load``, and
    ``release_all`` frees every one at the start of a step."""

    def __init__(self, shape):
        self.shape = tuple(shape)
        self._pools = {}
        self._busy = set()

    def check(self, what, array):
        if tuple(array.shape) != self.shape:
            raise ValueError(f"recompute offload: {what} has shape {tuple(array.shape)}, but "
                             f"checkpoint_shape is {list(self.shape)}; offload needs every "
                             "checkpoint to have exactly checkpoint_shape (batch dimension "
                             "included)")

    def _allocate(self, dtype):
        if backend.on_gpu():
            import cupyx

            return cupyx.empty_pinned(self.shape, dtype=dtype)
        return np.empty(self.shape, dtype=dtype)

    def store(self, key, what, array):
        """A host copy of ``array`` (``what`` names it in errors) in a free buffer of pool
        ``key``."""
        self.check(what, array)
        pool = self._pools.setdefault((key, np.dtype(array.dtype)), [])
        buffer = next((b for b in pool if id(b) not in self._busy), None)
        if buffer is None:
            buffer = self._allocate(array.dtype)
            pool.append(buffer)
        self._busy.add(id(buffer))
        check_host_read("recompute's offload of a checkpoint to host memory")
        if backend.on_gpu():
            array.get(out=buffer)
        else:
            buffer[...] = array
        return buffer

    def load(self, buffer):
        """``buffer``'s values in device memory; the buffer is free again."""
        self._busy.discard(id(buffer))
        return backend.array_module().array(buffer)

    def release_all(self):
        self._busy.clear()

    def slot(self, key, what):
        """What ``run_recomputed`` takes as ``offload`` for the inputs of one segment."""
        return _Slot(self, key, what)

    @property
    def nbytes(self):
        return sum(b.nbytes for pool in self._pools.values() for b in pool)


class _Slot:
    def __init__(self, host, key, what):
        self._host, self._key, self._what = host, key, what

    def store(self, position, array):
        what = self._what if position == 0 else f"{self._what} (argument {position})"
        return self._host.store((self._key, position), what, array)

    def load(self, buffer):
        return self._host.load(buffer)


# -- the forwards a step runs ---------------------------------------------------------------------

def _segmented_forward(segments, host, observe):
    """A Sequential's forward with every segment but the last recomputed."""
    *dropped, last = segments

    def forward(x):
        for index, segment in enumerate(dropped):
            offload = None
            if host is not None and index > 0:
                name = dropped[index - 1].checkpoint
                offload = host.slot(name, f"checkpoint {name!r}")
            x = run_recomputed(segment, (x,), layers=segment.layers, offload=offload,
                               observe=observe)
            if host is not None:
                host.check(f"checkpoint {segment.checkpoint!r}", x)
        y = last(x)
        if host is not None and last.checkpoint is not None:
            host.check(f"checkpoint {last.checkpoint!r}", y)
        return y
    return forward


def _recomputed_forward(name, layer, own_forward, host, observe):
    """``layer``'s forward, each call of it recomputed."""
    def forward(*args, **kwargs):
        offload = host.slot(name, f"the input of checkpoint {name!r}") if host else None
        return run_recomputed(own_forward, args, kwargs, layers=[layer], offload=offload,
                              observe=observe)
    return forward


class checkpoint_forwards:
    """Inside the block, the sublayers of ``model`` named by ``checkpoints`` are recomputed
    (module docstring): the affected layers get a ``forward`` instance attribute, and on exit
    each gets back what it had. ``host``: a ``HostCheckpoints`` to offload kept inputs to;
    ``observe``: given to ``run_recomputed``. Unknown names raise a ValueError listing valid
    ones. This is what the strategy runs each step, and what a stage of a pipeline can run its
    micro-batches in."""

    _none = object()

    def __init__(self, model, checkpoints, host=None, observe=None):
        self.boundaries, self.wholes = _resolve(model, checkpoints)
        self.host = host
        self.observe = observe
        self._saved = []

    def _give(self, layer, forward):
        self._saved.append((layer, vars(layer).get("forward", self._none)))
        layer.forward = forward

    def __enter__(self):
        try:
            for prefix, parent, names in self.boundaries:
                segments = cut_into_segments(parent, names, f"{prefix}." if prefix else "")
                if len(segments) > 1:
                    self._give(parent, _segmented_forward(segments, self.host, self.observe))
            for name, layer in self.wholes:
                self._give(layer, _recomputed_forward(name, layer, layer.forward, self.host,
                                                      self.observe))
        except BaseException:
            self._restore()
            raise
        return self

    def _restore(self):
        while self._saved:
            layer, previous = self._saved.pop()
            if previous is self._none:
                del layer.forward
            else:
                layer.forward = previous

    def __exit__(self, *exc):
        self._restore()
        return False


def _tensors_in(value):
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, Tensor)]
    if isinstance(value, dict):
        return [v for v in value.values() if isinstance(v, Tensor)]
    return []


class Recompute(Strategy):
    """Activation recomputation of the named checkpoints (module docstring).

    After each step ``peak_activation_bytes`` holds the most device bytes that the recorded
    graph and the kept inputs held at once during it (``ActivationMeter``, counted when each
    recomputed segment has run forward, when forward has ended, and when each segment has
    been recomputed in backward), and ``offloaded_bytes`` the bytes of the host buffers
    holding offloaded inputs."""

    name = "recompute"
    config_class = RecomputeConfig

    def __init__(self, strategy, optimizer, communicator):
        super().__init__(strategy, optimizer, communicator)
        self.checkpoints = list(self.config.checkpoints)
        self.enable_offload = self.config.enable_offload
        self.checkpoint_shape = list(self.config.checkpoint_shape)
        self._host = HostCheckpoints(self.checkpoint_shape) if self.enable_offload else None
        self.peak_activation_bytes = 0
        self.offloaded_bytes = 0
        self._meter = None
        self._peak = 0

    @classmethod
    def check(cls, strategy, optimizer):
        super().check(strategy, optimizer)
        config = RecomputeConfig.of(strategy)
        checkpoints = list(config.checkpoints)
        if not checkpoints:
            raise ValueError(f"recompute needs recompute_configs['checkpoints'], a non-empty list "
                             f"of sublayer names (dotted names from the model's "
                             f"named_sublayers()), got {checkpoints!r}")
        repeated = sorted({name for name in checkpoints if checkpoints.count(name) > 1})
        if repeated:
            raise ValueError(f"recompute checkpoints {repeated} are listed more than once")
        # The schema holds each size to [1, inf); an empty shape is the default.
        if config.enable_offload and not config.checkpoint_shape:
            raise ValueError(f"recompute_configs['enable_offload'] needs "
                             f"recompute_configs['checkpoint_shape'], the fixed shape (batch "
                             f"dimension included, every size >= 1) shared by all checkpoints; "
                             f"got {list(config.checkpoint_shape)!r}")

    def _observe(self, roots):
        self._peak = max(self._peak, self._meter.held(*roots))

    def forward(self, ctx, proceed):
        if ctx.model is None:
            return proceed(ctx)
        self._meter = ActivationMeter(ctx.model)
        self._peak = 0
        if self._host is not None:
            self._host.release_all()
        with checkpoint_forwards(ctx.model, self.checkpoints, self._host, self._observe):
            result = proceed(ctx)
        self._observe(_tensors_in(ctx.output))
        return result

    def backward(self, ctx, proceed):
        try:
            return proceed(ctx)
        finally:
            self.peak_activation_bytes = self._peak
            self.offloaded_bytes = self._host.nbytes if self._host is not None else 0

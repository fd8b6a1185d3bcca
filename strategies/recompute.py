"""``recompute``: keep only the outputs of the checkpoint layers through forward and recompute
everything between them during backward, trading computation for activation memory.

The model must be an ``nn.Sequential``; ``recompute_configs["checkpoints"]`` names some of its
top-level layers (a name of an activation that the fusion plan folded into the layer before it
means that fused step). The steps of the Sequential's plan are cut after every checkpoint into
pieces. Every piece but the last runs forward, keeps its input and drops the activations its
layers cached; backward goes over the pieces from the last: a dropped piece is first run forward
again from its kept input, then backward through it as ``Sequential.backward`` does, reporting
each layer's gradients as they become final so the bucketed allreduce still overlaps backward.
The last piece is not dropped in forward: backward starts with it, so recomputing it at once
would cost time and lower no peak. The model's input is kept by the caller anyway, so the piece
before the first checkpoint is dropped too. Every piece's caches are dropped once backward has
gone through it, so nothing is held between steps.

Gradients are bit for bit those of the run without recompute: the recomputation repeats the
same operations on the same inputs, draws the same dropout masks (the rank generator's state
at the start of the piece is replayed) and leaves layer buffers (batch-norm running statistics)
as the first forward left them.

``enable_offload`` also moves the kept checkpoints to host memory (a device-to-host copy into
page-locked buffers on a GPU, a copy into preallocated NumPy buffers on CPU) and back before
their piece is recomputed. The host buffers are allocated once, which is why offload needs
``checkpoint_shape``: the one fixed shape, batch dimension included, of every checkpoint.

A layer's activation caches are its instance attributes holding backend arrays: parameters are
``Parameter`` objects and buffers live in ``layer._buffers``, so neither is such an attribute,
and a layer holds none before its first forward. Forward assigns every one of them again
(some are views of parameters, such as Linear's operand ``_w``, or are set in backward, such
as BatchNorm's ``_xhat`` after a fused forward), so dropping them all and running forward again
restores exactly what backward reads.
"""
import numpy as np

from .. import backend
from ..nn import Sequential
from ..nn.containers import backward_steps, forward_steps
from .base import Strategy


def _backend_array_type():
    return backend.array_module().ndarray


def _layer_tree(layer):
    return [layer] + [child for _, child in layer.named_sublayers()]


def activation_arrays(layer):
    """``(attribute name, array)`` for every activation cache of ``layer`` itself."""
    array = _backend_array_type()
    return [(name, value) for name, value in vars(layer).items() if isinstance(value, array)]


def drop_activations(layers):
    """Delete the activation caches of ``layers`` and of every layer inside them."""
    for layer in layers:
        for member in _layer_tree(layer):
            for name, _ in activation_arrays(member):
                delattr(member, name)


def _owner(array):
    """The array that owns ``array``'s memory (itself unless it is a view)."""
    kind = type(array)
    while isinstance(array.base, kind):
        array = array.base
    return array


class ActivationMeter:
    """Counts the bytes of device memory held by a model's activation caches, each memory
    block once (a view counts as its owner); parameters, gradients and buffers never count."""

    def __init__(self, model):
        self.layers = _layer_tree(model)
        self._state = {id(_owner(b)) for layer in self.layers for b in layer._buffers.values()}
        self._state |= {id(_owner(a)) for p in model.parameters() for a in (p.data, p.grad)}

    def held(self, extra=()):
        """The bytes the caches and the backend arrays in ``extra`` hold now."""
        array = _backend_array_type()
        owners = {}
        cached = [a for layer in self.layers for _, a in activation_arrays(layer)]
        for value in cached + [a for a in extra if isinstance(a, array)]:
            owner = _owner(value)
            if id(owner) not in self._state:
                owners[id(owner)] = owner.nbytes
        return sum(owners.values())


def held_activation_bytes(model, extra=()):
    """``ActivationMeter(model).held(extra)``: e.g. after a plain forward, everything the
    model keeps for backward."""
    return ActivationMeter(model).held(extra)


# -- the rank generator: dropout masks must be drawn again exactly as in forward --------------

class _DrawRecorder:
    """Stands in for the rank generator (``backend.rank_rng()``) while a piece runs forward.
    The first draw snapshots the generator's state first, so the recompute can replay the draws;
    pieces that draw nothing cost no snapshot (on a GPU the state is megabytes)."""

    def __init__(self, generator):
        self._generator = generator
        self.state = None

    def __getattr__(self, name):
        if self.state is None:
            self.state = backend.rank_rng_snapshot(self._generator)
        return getattr(self._generator, name)


def _run_recording_draws(run):
    """``run()`` with the rank generator recorded; returns ``(result, state or None)``."""
    recorder = _DrawRecorder(backend.rank_rng())
    with backend.rank_rng_replaced(recorder):
        result = run()
    return result, recorder.state


def _run_replaying_draws(run, state):
    """``run()`` with the rank generator set back to ``state`` (when not None), and left
    afterwards as it was before."""
    if state is None:
        return run()
    now = backend.rank_rng_snapshot()
    backend.restore_rank_rng(state)
    try:
        return run()
    finally:
        backend.restore_rank_rng(now)


def _run_keeping_buffers(layers, run):
    """``run()`` with the buffers of ``layers`` restored afterwards, so a recomputation does not
    update batch-norm running statistics a second time."""
    buffers = [b for layer in layers for member in _layer_tree(layer)
               for b in member._buffers.values()]
    saved = [b.copy() for b in buffers]
    try:
        return run()
    finally:
        for buffer, value in zip(buffers, saved):
            buffer[...] = value


# -- the plan of a Sequential cut into pieces ---------------------------------------------------

class Piece:
    """Consecutive steps ``(layer, fused activation or None)`` of a Sequential's plan, from plan
    index ``first``; ``checkpoint`` is the name of the checkpoint whose output ends it (None
    when the piece ends the model without one)."""

    def __init__(self, steps, first, checkpoint):
        self.steps = steps
        self.first = first
        self.checkpoint = checkpoint

    @property
    def layers(self):
        return [layer for layer, _ in self.steps]

    def forward(self, x):
        return forward_steps(self.steps, x)

    def backward(self, dy, on_gradient, input_grad):
        """``Sequential.backward`` over these steps."""
        return backward_steps(self.steps, dy, on_gradient, input_grad, self.first)


def cut_into_pieces(model, checkpoints):
    """``model``'s plan cut after the step of every name in ``checkpoints``; refuses a model
    that is not a Sequential and names that are not its top-level layers."""
    if not isinstance(model, Sequential):
        raise TypeError(f"recompute needs an nn.Sequential model (checkpoints name its top-level "
                        f"layers), not {type(model).__name__}")
    step_of = {}
    names = list(model._children)
    children = list(model._children.values())
    position = 0
    for index, (layer, act) in enumerate(model._plan):
        while children[position] is not layer:
            position += 1
        step_of[names[position]] = index
        if act:
            step_of[names[position + 1]] = index
    unknown = [name for name in checkpoints if name not in step_of]
    if unknown:
        raise ValueError(f"recompute checkpoints {unknown} are not layers of the model; "
                         f"checkpoints name its top-level layers: {names}")
    ends = {}
    for name in checkpoints:
        ends.setdefault(step_of[name], name)
    pieces, first = [], 0
    for end in sorted(ends):
        pieces.append(Piece(model._plan[first:end + 1], first, ends[end]))
        first = end + 1
    if first < len(model._plan):
        pieces.append(Piece(model._plan[first:], first, None))
    return pieces


# -- one step of the model with recomputation ----------------------------------------------------

class _HostCheckpoints:
    """Page-locked (GPU) or plain NumPy (CPU) host buffers of ``shape``, one per checkpoint,
    allocated once and reused every step."""

    def __init__(self, shape):
        self.shape = tuple(shape)
        self._buffers = {}

    def check(self, name, array):
        if tuple(array.shape) != self.shape:
            raise ValueError(f"recompute offload: checkpoint {name!r} has shape "
                             f"{tuple(array.shape)}, but checkpoint_shape is {list(self.shape)}; "
                             "offload needs every checkpoint to have exactly checkpoint_shape "
                             "(batch dimension included)")

    def _buffer(self, name, dtype):
        buffer = self._buffers.get(name)
        if buffer is None or buffer.dtype != dtype:
            if backend.on_gpu():
                import cupyx

                buffer = cupyx.empty_pinned(self.shape, dtype=dtype)
            else:
                buffer = np.empty(self.shape, dtype=dtype)
            self._buffers[name] = buffer
        return buffer

    def store(self, name, array):
        """Copy ``array`` to its host buffer and return the buffer."""
        buffer = self._buffer(name, array.dtype)
        if backend.on_gpu():
            array.get(out=buffer)
        else:
            buffer[...] = array
        return buffer

    @property
    def nbytes(self):
        return sum(b.nbytes for b in self._buffers.values())


class RecomputedModel:
    """Stands in for the Sequential ``model`` during one step: ``forward`` and ``backward`` as
    the model's, with the pieces before the last dropped in forward and recomputed in backward.
    Anything else is the model's. ``peak_bytes``: the most device bytes that activation caches
    and kept inputs held at the end of a piece's forward or recomputation."""

    def __init__(self, model, pieces, host=None):
        self._model = model
        self._pieces = pieces
        self._host = host
        self._meter = ActivationMeter(model)
        self._inputs = []
        self._offloaded = {}
        self._draws = []
        self.peak_bytes = 0

    def __getattr__(self, name):
        return getattr(self._model, name)

    @property
    def model(self):
        """The Sequential this stands in for."""
        return self._model

    @property
    def pieces(self):
        return self._pieces

    @property
    def host(self):
        """The host buffers of offloaded checkpoints (None without offload)."""
        return self._host

    def _note_held(self):
        self.peak_bytes = max(self.peak_bytes, self._meter.held(self._inputs))

    def _keep(self, index, x):
        """Keep ``x``, the input of dropped piece ``index``: in device memory, or with offload
        as a host copy (but the model's input, which the caller holds anyway)."""
        if self._host is not None and index > 0:
            self._offloaded[index] = self._host.store(self._pieces[index - 1].checkpoint, x)
            x = None
        self._inputs.append(x)

    def _kept(self, index):
        """The input of dropped piece ``index`` in device memory (copied back from the host
        when it was offloaded)."""
        if self._inputs[index] is None:
            self._inputs[index] = backend.array_module().array(self._offloaded.pop(index))
        return self._inputs[index]

    def forward(self, x):
        *dropped, last = self._pieces
        self._inputs, self._offloaded, self._draws = [], {}, []
        for index, piece in enumerate(dropped):
            self._keep(index, x)
            x, draws = _run_recording_draws(lambda: piece.forward(x))
            self._draws.append(draws)
            if self._host is not None:
                self._host.check(piece.checkpoint, x)
            self._note_held()
            drop_activations(piece.layers)
        y = last.forward(x)
        if self._host is not None and last.checkpoint is not None:
            self._host.check(last.checkpoint, y)
        self._note_held()
        return y

    def backward(self, dy, on_gradient=None, input_grad=True):
        *dropped, last = self._pieces
        dy = last.backward(dy, on_gradient, input_grad)
        drop_activations(last.layers)
        for index in range(len(dropped) - 1, -1, -1):
            piece = dropped[index]
            x = self._kept(index)
            _run_keeping_buffers(piece.layers, lambda: _run_replaying_draws(
                lambda: piece.forward(x), self._draws[index]))
            self._note_held()
            dy = piece.backward(dy, on_gradient, input_grad)
            drop_activations(piece.layers)
            self._inputs[index] = None
        self._inputs, self._offloaded, self._draws = [], {}, []
        return dy


class Recompute(Strategy):
    """Activation recomputation between named checkpoint layers (module docstring).

    After each step ``peak_activation_bytes`` holds the most device bytes that activation caches
    and kept checkpoints held at once during it (counted from the caches at the end of each
    piece's forward and recomputation), and ``offloaded_bytes`` the bytes of the host buffers
    holding offloaded checkpoints."""

    name = "recompute"

    def __init__(self, strategy, optimizer, communicator):
        super().__init__(strategy, optimizer, communicator)
        self.checkpoints = list(self.configs["checkpoints"])
        self.enable_offload = bool(self.configs["enable_offload"])
        self.checkpoint_shape = list(self.configs["checkpoint_shape"])
        self._host = _HostCheckpoints(self.checkpoint_shape) if self.enable_offload else None
        self.peak_activation_bytes = 0
        self.offloaded_bytes = 0
        self._step_model = None

    @classmethod
    def check(cls, strategy, optimizer):
        super().check(strategy, optimizer)
        configs = dict(strategy.recompute_configs)
        checkpoints = configs.get("checkpoints")
        if (not isinstance(checkpoints, (list, tuple)) or not checkpoints
                or not all(isinstance(name, str) for name in checkpoints)):
            raise ValueError(f"recompute needs recompute_configs['checkpoints'], a non-empty list "
                             f"of layer names (the top-level layers of the nn.Sequential model "
                             f"whose outputs are kept), got {checkpoints!r}")
        repeated = sorted({name for name in checkpoints if checkpoints.count(name) > 1})
        if repeated:
            raise ValueError(f"recompute checkpoints {repeated} are listed more than once")
        offload = configs.get("enable_offload", False)
        if not isinstance(offload, bool):
            raise ValueError(f"recompute_configs['enable_offload'] must be True or False, "
                             f"not {offload!r}")
        shape = configs.get("checkpoint_shape", [])
        if offload and (not shape or not all(isinstance(n, int) and not isinstance(n, bool)
                                             and n >= 1 for n in shape)):
            raise ValueError(f"recompute_configs['enable_offload'] needs "
                             f"recompute_configs['checkpoint_shape'], the fixed shape (batch "
                             f"dimension included, every size >= 1) shared by all checkpoints; "
                             f"got {shape!r}")

    def forward(self, ctx, proceed):
        model = ctx.model
        self._step_model = RecomputedModel(model, cut_into_pieces(model, self.checkpoints),
                                           self._host)
        ctx.model = self._step_model
        try:
            return proceed(ctx)
        except BaseException:
            ctx.model = model
            self._step_model = None
            raise

    def backward(self, ctx, proceed):
        try:
            return proceed(ctx)
        finally:
            step_model, self._step_model = self._step_model, None
            ctx.model = step_model._model
            self.peak_activation_bytes = step_model.peak_bytes
            self.offloaded_bytes = self._host.nbytes if self._host is not None else 0

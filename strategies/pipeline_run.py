"""The pipeline's machinery, shared by the ``pipeline`` strategy (``opt.minimize``) and
``PipelineParallel.train_batch``/``eval_batch``: where a rank sits (``StageLayout``), the
activations and gradients between neighbouring stages (``send_value``/``recv_value``), the
passes of one step on one stage (``StageSchedule``) and the loss every stage returns
(``final_loss``). ``pipeline``'s docstring says what a step computes.

What a stage hands on is a tensor or a tuple of tensors (Paddle's ``PipelineLayer`` models hand
``(hidden, mask)`` on), each with a header of its dtype, shape, the tuple's length and whether
it travels with a gradient: a floating tensor that requires one. The next stage receives such
a tensor as a leaf that requires a gradient and, in backward, sends back the gradients of
those alone, in order (none at all when no item has one); the others (a mask, token ids)
arrive with ``stop_gradient=True``.
"""
import contextlib
import time

import numpy as np

from fleetmpi.core import backend
from fleetmpi.autograd import Tensor, as_array, no_grad, run_backward
from .pipeline_schedule import FORWARD, compute_order

# dtype code, ndim, tuple length (LONE: not a tuple), gradient flag; then the shape
_HEADER = 36
_FIELDS = 4
LONE = -1
# The dtypes that travel between stages, by their index in this tuple.
WIRE_DTYPES = tuple(np.dtype(t) for t in ("float16", "float32", "float64", "int32", "int64",
                                          "bool"))


class StageLayout:
    """Where this rank sits: ``stages`` x ``replicas`` ranks, this rank running ``stage`` of
    ``replica``; ``model_stages``: the stages of the model. Without a communicator: one
    process running every stage."""

    def __init__(self, stages, communicator):
        self.model_stages = stages
        if communicator is None:
            self.stages, self.replicas, self.stage, self.replica = 1, 1, 0, 0
            return
        size, rank = communicator.size, communicator.rank
        if size % stages:
            raise ValueError(f"pipeline: {stages} stages do not fit a world of {size} ranks; "
                             "the world size must be a multiple of the stage count (world = "
                             "stages x replicas)")
        self.stages, self.replicas = stages, size // stages
        self.stage, self.replica = rank % stages, rank // stages

    @property
    def first(self):
        return self.stage == 0

    @property
    def last(self):
        return self.stage == self.stages - 1


# -- point to point between neighbouring stages ---------------------------------------------------

def _items(value):
    """``(arrays, gradient flags, tuple length or LONE)`` of a stage's output ``value``: a
    Tensor, an array, or a tuple of them (module docstring)."""
    items = value if isinstance(value, tuple) else (value,)
    if not items:
        raise ValueError("pipeline: a stage hands on an empty tuple; it may hand on a tensor "
                         "or a tuple of tensors")
    arrays, needs = [], []
    for item in items:
        array = as_array(item)
        if not hasattr(array, "dtype") or array.dtype not in WIRE_DTYPES:
            raise TypeError(f"pipeline: a stage hands on a {type(item).__name__}"
                            f"{' of ' + str(array.dtype) if hasattr(array, 'dtype') else ''}; "
                            f"it may hand on a tensor or a tuple of tensors of "
                            f"{', '.join(d.name for d in WIRE_DTYPES)}")
        arrays.append(array)
        needs.append(isinstance(item, Tensor) and not item.stop_gradient
                     and array.dtype.kind == "f")
    return arrays, needs, len(items) if isinstance(value, tuple) else LONE


def _gradient_roots(value):
    """The items of ``value`` (a stage's output) that travel with a gradient."""
    items = value if isinstance(value, tuple) else (value,)
    return [item for item, need in zip(items, _items(value)[1]) if need]


def send_value(communicator, value, dest):
    """Send ``value`` (a stage's output: ``_items``) to ``dest``, each array after its
    header."""
    xp = backend.array_module()
    arrays, needs, length = _items(value)
    for array, need in zip(arrays, needs):
        array = xp.ascontiguousarray(array)
        header = np.zeros(_HEADER, dtype=np.int64)
        header[:_FIELDS] = (WIRE_DTYPES.index(array.dtype), array.ndim, length, need)
        header[_FIELDS:_FIELDS + array.ndim] = array.shape
        communicator.send(xp.asarray(header), dest)
        communicator.send(array, dest)


def recv_value(communicator, source):
    """What ``send_value`` sent from ``source``: ``(arrays, gradient flags, tuple length or
    LONE)``."""
    xp = backend.array_module()
    arrays, needs, length = [], [], LONE
    while not arrays or len(arrays) < length:
        header = backend.to_numpy(communicator.recv(xp.empty(_HEADER, dtype=np.int64), source))
        code, ndim, length, need = (int(n) for n in header[:_FIELDS])
        shape = tuple(int(n) for n in header[_FIELDS:_FIELDS + ndim])
        arrays.append(communicator.recv(xp.empty(shape, WIRE_DTYPES[code]), source))
        needs.append(bool(need))
    return arrays, needs, length


def elapsed(started):
    """Seconds since ``started``, once the device has finished what was queued."""
    backend.synchronize()
    return time.perf_counter() - started


# -- one step of one stage --------------------------------------------------------------------

class StageSchedule:
    """Every micro-batch's forward (and, when ``train``, backward) of this rank's stage in the
    order of ``schedule_mode``, with the messages to the neighbouring stages over
    ``communicator`` (the stages of this replica). Per micro-batch in flight it keeps the
    received inputs that travel with a gradient (leaves whose gradients go back), the roots of
    its recorded graph (the stage's outputs that travel with a gradient, or the loss) and
    their gradients, until its backward frees them.

    The messages with the next stage follow that stage's order (``pipeline_schedule``): the
    sends of finished forwards as soon as it allows, the receive of a gradient when a backward
    needs it. Without ``train`` the forwards run alone, recording nothing."""

    def __init__(self, layout, communicator, schedule_mode, micro_batches, train=True):
        self.layout, self.comm, self.train = layout, communicator, train
        self.mode, self.micro_batches = schedule_mode, micro_batches
        self.order = self._order(layout.stage)
        # the messages with the next stage, in the order both issue them
        self.right = [] if layout.last else self._order(layout.stage + 1)
        self.position = 0
        self.inputs, self.roots, self.grads, self.unsent = {}, {}, {}, {}
        self.forwarded = set()
        self.losses, self.outputs, self.busy = [], [], 0.0

    def _order(self, stage):
        order = compute_order(self.mode, self.layout.stages, self.micro_batches, stage)
        return order if self.train else [entry for entry in order if entry[0] == FORWARD]

    def run(self, modules, xs, ys, loss_fn, seed):
        """Run the passes: ``modules`` one after the other on each micro-batch (``xs[k]`` on the
        first stage), ``loss_fn(output, ys[k])`` on the last stage when given, backward from
        its loss with the gradient ``seed(loss)``. Returns the last stage's losses, the
        outputs (without ``loss_fn``) and the seconds spent computing."""
        with contextlib.nullcontext() if self.train else no_grad():
            for kind, k in self.order:
                if kind == FORWARD:
                    self._forward(k, modules, xs, ys, loss_fn, seed)
                else:
                    self._backward(k)
        if self.position != len(self.right):
            raise RuntimeError(f"pipeline schedule: stage {self.layout.stage} left "
                               f"{len(self.right) - self.position} messages to stage "
                               f"{self.layout.stage + 1} unsent")
        return self.losses, self.outputs, self.busy

    def _forward(self, k, modules, xs, ys, loss_fn, seed):
        layout = self.layout
        if layout.first:
            x = xs[k]
        else:
            arrays, needs, length = recv_value(self.comm, layout.stage - 1)
            received = [Tensor(a, stop_gradient=not (self.train and need))
                        for a, need in zip(arrays, needs)]
            x = received[0] if length == LONE else tuple(received)
            if self.train:
                self.inputs[k] = [t for t in received if not t.stop_gradient]
        started = time.perf_counter()
        y = x
        for module in modules:
            y = module(y)
        if layout.last and loss_fn is not None:
            loss = loss_fn(y, ys[k])
            self.losses.append(as_array(loss))
            roots = [loss]
            if self.train:
                self.grads[k] = [seed(loss)]
        else:
            if loss_fn is None:
                self.outputs.append(y)
            roots = [] if layout.last else _gradient_roots(y)
        if not layout.last:
            self.unsent[k] = y
        if self.train:
            self.roots[k] = roots
        self.busy += elapsed(started)
        self.forwarded.add(k)
        self._flush()

    def _backward(self, k):
        layout = self.layout
        if not layout.last and k not in self.grads:
            self._flush(until=k)
        started = time.perf_counter()
        roots, grads = self.roots.pop(k), self.grads.pop(k)
        if roots:
            run_backward(roots, grads)
        self.busy += elapsed(started)
        received = self.inputs.pop(k, [])
        if received:
            xp = backend.array_module()
            send_value(self.comm, tuple(xp.zeros_like(t.data) if t.grad is None
                                        else as_array(t.grad) for t in received),
                       layout.stage - 1)
        self._flush()

    def _flush(self, until=None):
        """Issue the messages to the next stage in its order: receives up to the gradient
        ``until``, and the sends of finished forwards, as far as they go."""
        following = self.layout.stage + 1
        while self.position < len(self.right):
            kind, k = self.right[self.position]
            if kind == FORWARD:
                if k not in self.forwarded:
                    if until is not None:
                        raise RuntimeError(f"pipeline schedule: stage {self.layout.stage} "
                                           f"needs gradient {until} before its forward {k}")
                    return
                send_value(self.comm, self.unsent.pop(k), following)
            elif until is None:
                return
            else:
                # the gradients of the outputs that travelled with one, if any did
                self.grads[k] = (recv_value(self.comm, following)[0] if self.roots.get(k)
                                 else [])
                if k == until:
                    until = None
            self.position += 1


def final_loss(layout, communicator, losses):
    """The mean loss over the micro-batches, from the last stage to every stage of the
    replica over ``communicator`` (in the dtype the last stage computed it in)."""
    xp = backend.array_module()
    loss = xp.stack(losses).mean() if losses else None
    if layout.stages == 1:
        return loss
    message = xp.zeros(2, dtype=np.float64)
    if layout.last:
        message[0], message[1] = loss, WIRE_DTYPES.index(loss.dtype)
    message = backend.to_numpy(communicator.broadcast(message, root=layout.stages - 1))
    if layout.last:
        return loss
    return xp.asarray(message[0], dtype=WIRE_DTYPES[int(message[1])])

"""The pipeline's machinery, shared by the ``pipeline`` strategy (``opt.minimize``) and
``PipelineParallel.train_batch``/``eval_batch``: where a rank sits (``StageLayout``), the
activations and gradients between neighbouring stages (``send_array``/``recv_array``), the
passes of one step on one stage (``StageSchedule``) and the loss every stage returns
(``final_loss``). ``pipeline``'s docstring says what a step computes.
"""
import contextlib
import time

import numpy as np

from fleetmpi.core import backend
from fleetmpi.autograd import Tensor, as_array, no_grad, run_backward
from .pipeline_schedule import FORWARD, compute_order

_HEADER = 34
_FLOAT_DTYPES = {np.dtype(t).num: np.dtype(t) for t in ("float16", "float32", "float64")}


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

def send_array(communicator, array, dest):
    """Send ``array`` with a header of its dtype and shape, so the receiver can allocate it."""
    xp = backend.array_module()
    array = xp.ascontiguousarray(array)
    header = np.zeros(_HEADER, dtype=np.int64)
    header[:2] = (array.dtype.num, array.ndim)
    header[2:2 + array.ndim] = array.shape
    communicator.send(xp.asarray(header), dest)
    communicator.send(array, dest)


def recv_array(communicator, source):
    """The array ``send_array`` sent from ``source``."""
    xp = backend.array_module()
    header = xp.empty(_HEADER, dtype=np.int64)
    header = backend.to_numpy(communicator.recv(header, source))
    dtype, ndim = _FLOAT_DTYPES[int(header[0])], int(header[1])
    return communicator.recv(xp.empty(tuple(int(n) for n in header[2:2 + ndim]), dtype), source)


def elapsed(started):
    """Seconds since ``started``, once the device has finished what was queued."""
    backend.synchronize()
    return time.perf_counter() - started


# -- one step of one stage --------------------------------------------------------------------

class StageSchedule:
    """Every micro-batch's forward (and, when ``train``, backward) of this rank's stage in the
    order of ``schedule_mode``, with the messages to the neighbouring stages over
    ``communicator`` (the stages of this replica). Per micro-batch in flight it keeps the
    received input (a leaf whose gradient goes back), the root of its recorded graph (the
    stage's output, or the loss) and that root's gradient, until its backward frees them.

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
            x = Tensor(recv_array(self.comm, layout.stage - 1), stop_gradient=not self.train)
            if self.train:
                self.inputs[k] = x
        started = time.perf_counter()
        y = x
        for module in modules:
            y = module(y)
        root = y
        if layout.last and loss_fn is not None:
            root = loss_fn(y, ys[k])
            self.losses.append(as_array(root))
            if self.train:
                self.grads[k] = seed(root)
        elif loss_fn is None:
            self.outputs.append(y)
        if not layout.last:
            self.unsent[k] = y.data
        if self.train:
            self.roots[k] = root
        self.busy += elapsed(started)
        self.forwarded.add(k)
        self._flush()

    def _backward(self, k):
        layout = self.layout
        if not layout.last and k not in self.grads:
            self._flush(until=k)
        started = time.perf_counter()
        run_backward([self.roots.pop(k)], [self.grads.pop(k)])
        self.busy += elapsed(started)
        if not layout.first:
            received = self.inputs.pop(k)
            dx = received.grad.data if received.grad is not None else \
                backend.array_module().zeros_like(received.data)
            send_array(self.comm, dx, layout.stage - 1)
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
                send_array(self.comm, self.unsent.pop(k), following)
            elif until is None:
                return
            else:
                self.grads[k] = recv_array(self.comm, following)
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
        message[0], message[1] = loss, loss.dtype.num
    message = backend.to_numpy(communicator.broadcast(message, root=layout.stages - 1))
    if layout.last:
        return loss
    return xp.asarray(message[0], dtype=_FLOAT_DTYPES[int(message[1])])

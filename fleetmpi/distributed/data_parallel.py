"""Paddle's ``paddle.DataParallel``: a model whose parameters start equal on every rank and
whose gradients are averaged over the ranks by ``loss.backward()``, so that a plain optimizer
steps on the gradient of the mean loss over the global batch.

The start is ``fleet.distributed_model``'s (rank 0's parameters and buffers, one broadcast per
flat buffer). The averaging is one fused in-place allreduce of the flat gradient buffers
(``Communicator.allreduce_many``, ``op="mean"``) after the backward of a loss the model's
training forward fed; ``no_sync()`` leaves it out (gradients accumulate on each rank, as
Paddle's). Given to ``fleet.distributed_optimizer``, the model's steps are that optimizer's,
whose strategies average the gradients (bucket by bucket, overlapping backward): the wrapper
then averages nothing itself.
"""
import contextlib

from ..autograd import engine, is_grad_enabled, run_backward
from ..nn import Layer
from ..parallel import distributed_model, owner_of
from .group import resolve


class DataParallel(Layer):
    """``DataParallel(layers, strategy=None, comm_buffer_size=25, last_comm_buffer_size=1,
    find_unused_parameters=False, group=None)`` (module docstring). ``group``: the ranks that
    share the model (None: every rank). The buffer sizes and ``find_unused_parameters`` are
    Paddle's tuning of its reducer; here one fused allreduce covers the buffers, and a
    parameter backward did not reach has a zero gradient, averaged with the rest."""

    def __init__(self, layers, strategy=None, comm_buffer_size=25, last_comm_buffer_size=1,
                 find_unused_parameters=False, group=None):
        if not isinstance(layers, Layer):
            raise TypeError(f"DataParallel wraps a fleetmpi.nn.Layer, not "
                            f"{type(layers).__name__}")
        super().__init__()
        self._communicator, self._group = resolve(group)
        if not self._group.is_member():
            raise ValueError(f"DataParallel group {self._group.ranks} does not hold this rank")
        self._layers = distributed_model(layers, self._communicator)
        self._grad_need_sync = True

    def forward(self, *inputs, **kwargs):
        output = self._layers(*inputs, **kwargs)
        if (self.training and is_grad_enabled() and self._grad_need_sync
                and owner_of(self._layers) is None and self._communicator.size > 1):
            engine.set_step_driver(self._backward)
        return output

    def _backward(self, loss, grad):
        """``loss.backward(grad)``, then the flat gradient buffers averaged over the group."""
        engine.set_step_driver(None)
        run_backward([loss], [grad])
        for p in self._layers.parameters():
            p.settle_gradient()
        grads = [buffer.grad for buffer in self._layers.flat_buffers()]
        self._communicator.allreduce_many(grads, op="mean")

    @contextlib.contextmanager
    def no_sync(self):
        """Inside the block the backward of a loss averages no gradients."""
        previous, self._grad_need_sync = self._grad_need_sync, False
        try:
            yield
        finally:
            self._grad_need_sync = previous

    def state_dict(self):
        return self._layers.state_dict()

    def set_state_dict(self, state):
        return self._layers.set_state_dict(state)

    set_dict = load_dict = set_state_dict

"""One batch of a ``Model``: a training step, an evaluation or a prediction, as Paddle's
dygraph ``Model`` runs them, over the ranks of ``ranks.Ranks``.

A training step computes the outputs under ``auto_cast`` (the ``amp_configs`` of
``prepare``), the loss (the sum of the losses when the loss function returns several),
backward (through a ``GradScaler`` under amp), and with ``update`` the optimizer's step and
``clear_grad``; without ``update`` the gradients accumulate. The metrics then see the outputs
and labels of every rank (``Ranks.gather``), less the repeated samples at the end of a pass
(``ranks.Coverage``), through each metric's ``compute`` and ``update``.
"""
from ..autograd import Tensor, no_grad, to_tensor
from ..amp import GradScaler, auto_cast, distributed_scaler
from .amp_configs import AmpConfigs
from .ranks import Ranks, host


def to_list(value):
    """``value`` as a list: a list or tuple's items, ``[]`` for None, else ``[value]`` (Paddle's
    ``paddle.hapi.model.to_list``)."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def as_tensors(values):
    return [v if isinstance(v, Tensor) else to_tensor(v) for v in to_list(values)]


def _rows(values):
    return values[0].shape[0] if values and len(values[0].shape) else 1


class BatchSteps:
    """The batch work of a ``Model`` of ``network``: ``prepare`` sets ``optimizer``, ``loss``,
    ``metrics`` and ``amp``; ``coverage`` is the pass over a dataset in progress (None
    outside ``fit``, ``evaluate`` and ``predict``)."""

    def __init__(self, network):
        self.network = network
        self.ranks = Ranks(network)
        self.optimizer = self.loss = self.scaler = self.coverage = None
        self.metrics = []
        self.amp = AmpConfigs()

    def set_amp(self, amp):
        self.amp = amp
        self.scaler = None
        if amp.enabled:
            self.scaler = GradScaler(**amp.scaler)
            if self.ranks.nranks > 1:
                distributed_scaler(self.scaler)

    def train(self, inputs, labels=None, update=True):
        if self.optimizer is None or self.loss is None:
            raise RuntimeError("Model.train_batch needs an optimizer and a loss: call "
                               "model.prepare(optimizer, loss) first")
        network = self.ranks.train_network
        network.train()
        inputs, labels = as_tensors(inputs), as_tensors(labels)
        with auto_cast(enable=self.amp.enabled, level=self.amp.level, **self.amp.cast):
            outputs = to_list(network(*inputs))
        losses = to_list(self.loss(*(outputs + labels)))
        total = losses[0]
        for loss in losses[1:]:
            total = total + loss
        self._backward(total, update)
        losses = self.ranks.mean_losses([host(loss) for loss in losses], _rows(inputs))
        metrics = self._update_metrics(outputs, labels, _rows(inputs))
        return (losses, metrics) if self.metrics else losses

    def _backward(self, loss, update):
        if self.scaler is None:
            loss.backward()
            if update:
                self.optimizer.step()
                self.optimizer.clear_grad()
            return
        scaled = self.scaler.scale(loss)
        scaled.backward()
        if update:
            self.scaler.minimize(self.optimizer, scaled)
            self.optimizer.clear_grad()

    def evaluate(self, inputs, labels=None):
        self.network.eval()
        inputs, labels = as_tensors(inputs), as_tensors(labels)
        with no_grad():
            outputs = to_list(self.network(*inputs))
            losses = to_list(self.loss(*(outputs + labels))) if self.loss else []
        losses = self.ranks.mean_losses([host(loss) for loss in losses], _rows(inputs))
        metrics = self._update_metrics(outputs, labels, _rows(inputs))
        if self.loss is not None:
            return (losses, metrics) if self.metrics else losses
        return metrics

    def predict(self, inputs):
        self.network.eval()
        inputs = as_tensors(inputs)
        with no_grad():
            outputs = [host(o) for o in to_list(self.network(*inputs))]
        keep = self._kept(_rows(inputs))
        return [o[:keep] for o in self.ranks.gather(outputs)]

    def _kept(self, rows):
        """How many of the ranks' ``rows`` samples each (rank by rank) are this pass's."""
        rows *= self.ranks.nranks
        return rows if self.coverage is None else self.coverage.take(rows)

    def _update_metrics(self, outputs, labels, rows):
        keep = self._kept(rows)
        if not self.metrics:
            return []
        values = outputs + labels
        if self.ranks.nranks > 1:
            values = [to_tensor(v[:keep]) for v in self.ranks.gather([host(v) for v in values])]
        else:
            values = [v.detach()[:keep] if keep < rows else v.detach() for v in values]
        results = []
        for metric in self.metrics:
            computed = to_list(metric.compute(*values))
            results.append(metric.update(*[host(c) for c in computed]))
        return results

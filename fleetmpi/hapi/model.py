"""``fleetmpi.Model``: Paddle's high-level ``paddle.Model`` (``paddle.hapi``) in dygraph.

    model = fleetmpi.Model(net)
    model.prepare(optimizer.Adam(parameters=model.parameters()), nn.CrossEntropyLoss(),
                  metric.Accuracy())
    model.fit(train_dataset, eval_dataset, epochs=5, batch_size=32,
              callbacks=[callbacks.EarlyStopping("acc", patience=2)])
    model.evaluate(eval_dataset); model.predict(test_dataset); model.save("ckpt/final")

Given a ``fleetmpi.io.Dataset``, ``fit``, ``evaluate`` and ``predict`` read it in batches of
``batch_size`` per rank through a ``DistributedBatchSampler`` (the epoch's shuffle set by
``set_epoch``); any other iterable (a ``DataLoader``) is read as it is. Each batch is a list
whose first items are the network's inputs (as many as ``inputs`` names, else as the
network's ``forward`` takes) and the rest the labels. Launched on several ranks, the model
trains data parallel and every rank logs the job's numbers (``ranks.py``); the batch work is
``steps.py``'s, the files ``model_files.py``'s, the callbacks ``callbacks.py``'s.
"""
import inspect

import numpy as np

from ..io import DataLoader, Dataset, DistributedBatchSampler
from ..metric.metrics import Metric
from ..nn import Layer
from ..nn.summary import summary
from ..static import InputSpec
from .amp_configs import AmpConfigs
from .callbacks import config_callbacks
from .model_files import load_model, save_model
from .ranks import Coverage
from .steps import BatchSteps, to_list


def _specs(given, what):
    """The ``InputSpec`` list of Model's ``inputs`` or ``labels`` (None stays None)."""
    if given is None:
        return None
    specs = list(given.values()) if isinstance(given, dict) else to_list(given)
    for spec in specs:
        if not isinstance(spec, InputSpec):
            raise TypeError(f"Model {what} take fleetmpi.static.InputSpec objects (a list, "
                            f"tuple or dict of them), not {type(spec).__name__}")
    return specs


def _forward_arity(network):
    """How many inputs ``network.forward`` takes by position (one for ``*inputs``)."""
    kinds = [p.kind for p in inspect.signature(network.forward).parameters.values()]
    named = sum(k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                for k in kinds)
    return named or int(inspect.Parameter.VAR_POSITIONAL in kinds)


def _flatten(data):
    if isinstance(data, (list, tuple)):
        return [item for part in data for item in _flatten(part)]
    return [data]


def _dataset_size(loader):
    """The samples of one pass over ``loader`` where it reads a dataset of known length."""
    dataset = getattr(loader, "dataset", None) if isinstance(loader, DataLoader) else None
    try:
        return len(dataset) if dataset is not None else None
    except TypeError:
        return None


def _length(loader):
    try:
        return len(loader)
    except TypeError:
        return None


class Model:
    """Paddle's ``Model(network, inputs=None, labels=None)`` (module docstring): ``network``
    a ``fleetmpi.nn.Layer``; ``inputs`` / ``labels`` ``InputSpec`` objects (optional: they
    count the inputs and give ``summary`` its shapes)."""

    def __init__(self, network, inputs=None, labels=None):
        if not isinstance(network, Layer):
            raise TypeError(f"Model takes a fleetmpi.nn.Layer, not {type(network).__name__}")
        self.network = network
        self.mode = "train"
        self.stop_training = False
        self._inputs = _specs(inputs, "inputs")
        self._labels = _specs(labels, "labels")
        self._input_count = len(self._inputs) if self._inputs else _forward_arity(network)
        self._steps = BatchSteps(network)
        self._test_dataloader = None
        self._accumulate = 1
        self._iters_left = None

    # Paddle's names of what prepare set, which callbacks and scripts read.
    _optimizer = property(lambda self: self._steps.optimizer)
    _loss = property(lambda self: self._steps.loss)
    _metrics = property(lambda self: self._steps.metrics)
    _scaler = property(lambda self: self._steps.scaler)

    def prepare(self, optimizer=None, loss=None, metrics=None, amp_configs=None):
        """Set the optimizer (None to evaluate and predict only), the loss (a Layer or any
        callable of the outputs and labels; None: no loss), the metrics (a
        ``fleetmpi.metric.Metric`` or a list of them) and ``amp_configs``
        (``amp_configs.py``)."""
        if loss is not None and not callable(loss):
            raise TypeError(f"loss must be a fleetmpi.nn.Layer or a callable, not "
                            f"{type(loss).__name__}")
        metrics = to_list(metrics)
        for metric in metrics:
            if not isinstance(metric, Metric):
                raise TypeError(f"metrics take fleetmpi.metric.Metric objects, not "
                                f"{type(metric).__name__}")
        steps = self._steps
        steps.optimizer, steps.loss, steps.metrics = optimizer, loss, metrics
        steps.set_amp(AmpConfigs(amp_configs))

    # -- one batch --------------------------------------------------------------------------
    def train_batch(self, inputs, labels=None, update=True):
        """One training step on a batch (arrays or Tensors, or lists of them); ``update``
        False accumulates the gradients without stepping. Returns the list of losses (each
        the mean over every rank), with the metrics' values when there are metrics:
        ``(losses, metrics)``."""
        self.mode = "train"
        return self._steps.train(inputs, labels, update)

    def eval_batch(self, inputs, labels=None):
        """One evaluation on a batch, without gradients: ``(losses, metrics)``, the losses or
        the metrics, as ``prepare`` gave a loss and metrics."""
        self.mode = "eval"
        return self._steps.evaluate(inputs, labels)

    def predict_batch(self, inputs):
        """The network's outputs on a batch, as NumPy arrays (every rank's, joined)."""
        self.mode = "test"
        return self._steps.predict(inputs)

    # -- passes over data -------------------------------------------------------------------
    def _loader(self, data, batch_size, shuffle=False, drop_last=False, num_workers=0):
        if not isinstance(data, Dataset):
            return data
        sampler = DistributedBatchSampler(data, batch_size=batch_size, shuffle=shuffle,
                                          drop_last=drop_last)
        return DataLoader(data, batch_sampler=sampler, num_workers=num_workers)

    def _metrics_name(self):
        names = ["loss"] if self._loss is not None else []
        for metric in self._metrics:
            names.extend(to_list(metric.name()))
        return names

    def _reset_metrics(self):
        for metric in self._metrics:
            metric.reset()

    def fit(self, train_data=None, eval_data=None, batch_size=1, epochs=1, eval_freq=1,
            log_freq=10, save_dir=None, save_freq=1, verbose=2, drop_last=False, shuffle=True,
            num_workers=0, callbacks=None, accumulate_grad_batches=1, num_iters=None):
        """Train ``epochs`` epochs on ``train_data``, evaluating on ``eval_data`` every
        ``eval_freq`` epochs, with the callbacks (``callbacks.py``: a progress logger, a
        checkpoint to ``save_dir`` every ``save_freq`` epochs, the learning rate schedule
        stepped every step, unless given). ``accumulate_grad_batches``: steps whose gradients
        make one update; ``num_iters``: stop after that many steps in all."""
        if train_data is None:
            raise ValueError("Model.fit needs train_data (a Dataset or a DataLoader)")
        train_loader = self._loader(train_data, batch_size, shuffle, drop_last, num_workers)
        eval_loader = None if eval_data is None else self._loader(eval_data, batch_size,
                                                                  num_workers=num_workers)
        self._accumulate = accumulate_grad_batches
        steps = _length(train_loader)
        if num_iters is not None:
            if steps:
                epochs = num_iters // steps + 1
                steps = min(num_iters, steps)
        cbks = config_callbacks(callbacks, model=self, batch_size=batch_size, epochs=epochs,
                                steps=steps, log_freq=log_freq, save_freq=save_freq,
                                save_dir=save_dir, verbose=verbose,
                                metrics=self._metrics_name())
        self.stop_training = False
        self._iters_left = num_iters
        cbks.on_begin("train")
        logs = {}
        for epoch in range(epochs):
            sampler = getattr(train_loader, "batch_sampler", None)
            if isinstance(sampler, DistributedBatchSampler):
                sampler.set_epoch(epoch)
            cbks.on_epoch_begin(epoch)
            logs = self._run_one_epoch(train_loader, cbks, "train")
            cbks.on_epoch_end(epoch, logs)
            if eval_loader is not None and epoch % eval_freq == 0:
                self._evaluation(eval_loader, cbks)
            if self.stop_training:
                break
        cbks.on_end("train", logs)

    def _evaluation(self, loader, cbks):
        self._test_dataloader = loader
        cbks.on_begin("eval", {"steps": _length(loader), "metrics": self._metrics_name()})
        logs = self._run_one_epoch(loader, cbks, "eval")
        cbks.on_end("eval", logs)
        self._test_dataloader = None
        return logs

    def evaluate(self, eval_data, batch_size=1, log_freq=10, verbose=2, num_workers=0,
                 callbacks=None, num_iters=None):
        """Evaluate on ``eval_data``: ``{"loss": [...], <metric name>: value}``, the loss of
        the last batch and the metrics over all of it (every rank's samples, once each)."""
        loader = self._loader(eval_data, batch_size, num_workers=num_workers)
        cbks = config_callbacks(callbacks, model=self, log_freq=log_freq, verbose=verbose,
                                metrics=self._metrics_name())
        self._iters_left = num_iters
        logs = self._evaluation(loader, cbks)
        return {name: logs[name] for name in self._metrics_name() if name in logs}

    def predict(self, test_data, batch_size=1, num_workers=0, stack_outputs=False, verbose=1,
                callbacks=None):
        """The network's outputs on ``test_data``: one list per output, of a NumPy array per
        batch, or with ``stack_outputs`` one array of all the samples. On several ranks every
        rank gets the outputs of all the samples, in the order of one process."""
        loader = self._loader(test_data, batch_size, num_workers=num_workers)
        self._test_dataloader = loader
        cbks = config_callbacks(callbacks, model=self, verbose=verbose, mode="test")
        logs = {"steps": _length(loader)}
        cbks.on_begin("predict", logs)
        self._iters_left = None
        outputs = list(zip(*self._run_one_epoch(loader, cbks, "predict", outputs=[])))
        if stack_outputs:
            outputs = [np.vstack(batches) for batches in outputs]
        else:
            outputs = [list(batches) for batches in outputs]
        self._test_dataloader = None
        cbks.on_end("predict", logs)
        return outputs

    def _run_one_epoch(self, loader, cbks, mode, outputs=None):
        """One pass over ``loader`` in ``mode`` (``train``, ``eval``, ``predict``): the logs
        of its last step; in predict mode each batch's outputs are appended to ``outputs``,
        which is returned."""
        logs, total = {}, _dataset_size(loader)
        self._steps.coverage = None if total is None else Coverage(total)
        length = _length(loader)
        try:
            for step, data in enumerate(loader):
                data = _flatten(data)
                cbks.on_batch_begin(mode, step, logs)
                self._run_batch(data, mode, step, length, logs, outputs)
                logs["step"] = step
                coverage = self._steps.coverage
                logs["batch_size"] = (coverage.last if coverage is not None
                                      else data[0].shape[0] * self._steps.ranks.nranks)
                cbks.on_batch_end(mode, step, logs)
                if self._count_iteration():
                    break
        finally:
            self._steps.coverage = None
        self._reset_metrics()
        return outputs if mode == "predict" else logs

    def _run_batch(self, data, mode, step, length, logs, outputs):
        inputs = data[:self._input_count]
        if mode == "predict":
            outputs.append(self.predict_batch(inputs))
            return
        labels = data[self._input_count:]
        if mode == "train":
            update = (step + 1) % self._accumulate == 0 or step + 1 == length
            result = self.train_batch(inputs, labels, update)
        else:
            result = self.eval_batch(inputs, labels)
        values = []
        if self._loss is not None:
            losses = result[0] if self._metrics else result
            values.append([float(loss) for loss in losses])
        for metric in self._metrics:
            values.extend(to_list(metric.accumulate()))
        logs.update(zip(self._metrics_name(), values))

    def _count_iteration(self):
        """Count a step against ``num_iters``; True when none are left."""
        if self._iters_left is None:
            return False
        self._iters_left -= 1
        if self._iters_left > 0:
            return False
        self.stop_training = True
        self._iters_left = None
        return True

    # -- files, parameters, summary ---------------------------------------------------------
    def save(self, path, training=True):
        """Write ``path.pdparams`` and ``path.pdopt`` (``model_files.py``) on rank 0."""
        if not training:
            raise ValueError("Model.save(path, training=False) writes Paddle's inference "
                             "program (paddle.jit.save), a static graph fleetmpi does not "
                             "build; Model.save(path) writes the parameters for training and "
                             "inference alike")
        if self._steps.ranks.rank == 0:
            save_model(path, self.network, self._optimizer, self._scaler)

    def load(self, path, skip_mismatch=False, reset_optimizer=False):
        """Read ``path.pdparams`` (and ``path.pdopt`` unless ``reset_optimizer``) into the
        network and optimizer (``model_files.py``)."""
        load_model(path, self.network, self._optimizer, self._scaler, skip_mismatch,
                   reset_optimizer)

    def parameters(self, *args, **kwargs):
        return self.network.parameters(*args, **kwargs)

    def summary(self, input_size=None, dtype=None):
        """``fleetmpi.summary`` of the network on ``input_size`` (a shape, an ``InputSpec``
        or a list of them), by default the shapes of Model's ``inputs``."""
        given = self._inputs if input_size is None else input_size
        if given is None:
            raise ValueError("Model.summary needs input_size, or Model(network, inputs=...)")
        specs = given if isinstance(given, (list, tuple)) and given and all(
            isinstance(s, (InputSpec, list, tuple)) for s in given) else [given]
        sizes = [s.shape if isinstance(s, InputSpec) else tuple(s) for s in specs]
        if dtype is None and all(isinstance(s, InputSpec) for s in specs):
            dtype = [s.dtype for s in specs]
        return summary(self.network, sizes if len(sizes) > 1 else sizes[0], dtypes=dtype)

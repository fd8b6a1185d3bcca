"""Checkpoints of tensor-parallel models that load at another model-parallel degree.

``save`` writes the model's parameters as the serial model's: the ranks of each
model-parallel group gather the parts of every split parameter (``TensorParallelLayer.
split_index`` says where each rank's part lies) into the whole tensor, so every rank's file
holds the same serial state under the serial model's names. ``load`` takes the part this
rank's layout gives it from those whole tensors, so a checkpoint of mp_degree 2 loads into
mp_degree 1, 4 or 2 alike, and into a serial model. The files, manifest, digests and atomic
replacement are ``fleetmpi.training.checkpoint``'s.

The optimizer's state moves the same way, parameter by parameter (each split parameter's
state gathered whole, and cut to the loading layout's part), so training goes on at another
degree as it would have. Sharding's optimizer holds a shard of the parameter space rather than
whole parameters; its state loads only at the model-parallel degree that saved it (another is
refused: load with ``optimizer=None`` to start the optimizer afresh). Strategies' own state
(amp's loss scale, step counters) is carried as it is.
"""
import numpy as np

from ..core import backend
from . import checkpoint
from ..nn.tensor_parallel import TensorParallelLayer

DEGREE_KEY = "tensor_parallel.mp_degree"


def _split_parameters(model):
    """``[(name, layer, attr), ...]``: the parameters of tensor-parallel layers split over a
    group of more than one rank."""
    found = []
    for layer_name, layer in model.named_sublayers():
        if isinstance(layer, TensorParallelLayer) and layer.mp_group is not None:
            for attr in ("weight", "bias"):
                if getattr(layer, attr, None) is not None and \
                        layer.split_index(attr, 0) is not None:
                    found.append((f"{layer_name}.{attr}", layer, attr))
    return found


def _degree(model):
    degrees = {layer.mp_size for _, layer, _ in _split_parameters(model)}
    return degrees.pop() if degrees else 1


def merged_state_dict(model):
    """``model.state_dict()`` with every split parameter gathered whole from its group (the
    serial model's state); every rank of the group must call it."""
    state = model.state_dict()
    for name, layer, attr in _split_parameters(model):
        state[name] = _whole(state[name], layer, attr)
    return state


def split_state_dict(model, state):
    """``state`` (a serial model's, or one ``merged_state_dict`` made) with every parameter
    ``model`` splits cut to this rank's part."""
    state = dict(state)
    for name, layer, attr in _split_parameters(model):
        if name in state:
            state[name] = np.asarray(state[name])[layer.split_index(attr, layer.mp_rank)]
    return state


def _whole(part, layer, attr):
    """A split parameter's (or its state's) ``part`` joined whole over the layer's group."""
    parts = backend.to_numpy(layer.mp_group.allgather(
        backend.asarray(np.ascontiguousarray(part)), stack=True))
    shape = layer.full_weight_shape if attr == "weight" else (layer.full_weight_shape[1],)
    whole = np.empty(shape, dtype=parts.dtype)
    for rank in range(layer.mp_size):
        whole[layer.split_index(attr, rank)] = parts[rank]
    return whole


_PARAMETER_STATE = "parameter."


class _SerialView:
    """What ``fleetmpi.training.checkpoint`` sees of a tensor-parallel model: the serial state, with
    the model-parallel degree that wrote it; loading cuts it to this rank's parts."""

    saves_whole = True

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def named_parameters(self):
        return self.model.named_parameters()

    def state_dict(self):
        state = merged_state_dict(self.model)
        state[DEGREE_KEY] = np.array(_degree(self.model))
        return state

    def set_state_dict(self, state):
        state = dict(state)
        saved = int(state.pop(DEGREE_KEY, 1))
        degree = _degree(self.model)
        if self.optimizer is not None and _sharded(self.optimizer):
            _check_sharded_degree(saved, degree)
        self.model.set_state_dict(split_state_dict(self.model, state))


def _check_sharded_degree(saved, degree):
    if saved != degree:
        raise ValueError(f"the checkpoint was saved at mp_degree {saved}; this model runs at "
                         f"mp_degree {degree}, and a sharded optimizer's state is laid out "
                         f"over a rank's own parameter space: load with optimizer=None to "
                         f"start the optimizer afresh from the loaded parameters")


def _inner(optimizer):
    return getattr(optimizer, "inner", optimizer)


def _sharded(optimizer):
    inner = _inner(optimizer)
    return tuple(inner.shard_range) != (0, inner.space_size)


class _SerialOptimizer:
    """What ``fleetmpi.training.checkpoint`` sees of an optimizer over a tensor-parallel model: its
    state per parameter of the serial model (``parameter.<state>.<name>``, split parameters'
    gathered whole) besides its step counters and strategies' state."""

    def __init__(self, optimizer, model):
        self.optimizer, self.model = optimizer, model
        self.inner = _inner(optimizer)
        self.split = {name: (layer, attr) for name, layer, attr in _split_parameters(model)}
        self.run_keys = {f"{state}.{index}" for state in self.inner.state_names
                         for index in range(len(self.inner.flat_runs()))}

    def _owned(self):
        return [(name, p) for name, p in self.model.named_parameters() if self.inner.owns(p)]

    def state_dict(self):
        state = {k: v for k, v in self.optimizer.state_dict().items() if k not in self.run_keys}
        for name, parameter in self._owned():
            for key, value in self.inner.parameter_state(parameter).items():
                value = backend.to_numpy(value)
                if name in self.split:
                    value = _whole(value, *self.split[name])
                state[f"{_PARAMETER_STATE}{key}.{name}"] = np.array(value)
        return state

    def set_state_dict(self, state):
        per_parameter = {k: v for k, v in state.items() if k.startswith(_PARAMETER_STATE)}
        current = self.optimizer.state_dict()
        current.update({k: v for k, v in state.items() if not k.startswith(_PARAMETER_STATE)
                        and k not in self.run_keys})
        writes = []
        for name, parameter in self._owned():
            for key, view in self.inner.parameter_state(parameter).items():
                stored = per_parameter.get(f"{_PARAMETER_STATE}{key}.{name}")
                if stored is None:
                    raise KeyError(f"the checkpoint holds no optimizer state {key!r} for "
                                   f"parameter {name!r}")
                if name in self.split:
                    layer, attr = self.split[name]
                    stored = np.asarray(stored)[layer.split_index(attr, layer.mp_rank)]
                if tuple(stored.shape) != tuple(view.shape):
                    raise ValueError(f"optimizer state {key!r} of {name!r} has shape "
                                     f"{tuple(stored.shape)} in the checkpoint; this "
                                     f"parameter's is {tuple(view.shape)}")
                writes.append((view, stored))
        self.optimizer.set_state_dict(current)
        for view, stored in writes:
            view[...] = backend.asarray(stored)


def save(directory, model, optimizer, step, extra=None):
    """``fleetmpi.training.checkpoint.save`` with the model's parameters, and an unsharded
    optimizer's
    state, stored as the serial model's (module docstring); every rank must call it."""
    return checkpoint.save(directory, _SerialView(model, optimizer), _portable(optimizer, model),
                           step, extra)


def load(directory, model, optimizer=None):
    """Restore ``model`` (at any model-parallel degree, or serial) and ``optimizer`` (at any
    degree unless sharded) from a checkpoint ``save`` wrote. Every rank's file holds the
    whole model, and the whole state of every parameter its optimizer updates, so a job of
    another size loads it too (rank ``r`` reads file ``r % saved``) unless the optimizer is
    sharded or holds one pipeline stage (``fleetmpi.training.checkpoint.load``'s rules then
    apply)."""
    if optimizer is not None and _sharded(optimizer):
        saved = checkpoint.saved_model_value(directory, DEGREE_KEY)
        _check_sharded_degree(1 if saved is None else int(saved), _degree(model))
    portable = _portable(optimizer, model)
    whole = optimizer is None or (portable is not optimizer and all(
        _inner(optimizer).owns(p) for p in model.parameters()))
    return checkpoint.load(directory, _SerialView(model, optimizer), portable,
                           replicated=whole)


def _portable(optimizer, model):
    if optimizer is None or _sharded(optimizer):
        return optimizer
    return _SerialOptimizer(optimizer, model)

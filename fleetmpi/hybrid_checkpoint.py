"""Checkpoints of tensor-parallel models that load at another model-parallel degree.

``save`` writes the model's parameters as the serial model's: the ranks of each
model-parallel group gather the parts of every split parameter (``TensorParallelLayer.
split_index`` says where each rank's part lies) into the whole tensor, so every rank's file
holds the same serial state under the serial model's names. ``load`` takes the part this
rank's layout gives it from those whole tensors, so a checkpoint of mp_degree 2 loads into
mp_degree 1, 4 or 2 alike, and into a serial model. The files, manifest, digests and atomic
replacement are ``fleetmpi.checkpoint``'s.

The optimizer state is laid out over a rank's own parameters, so it loads only at the
model-parallel degree that saved it: ``load`` refuses an optimizer when the degrees differ
(pass ``optimizer=None`` and the optimizer starts afresh from the loaded parameters).
"""
import numpy as np

from . import backend, checkpoint
from .nn.tensor_parallel import TensorParallelLayer

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
        part = np.ascontiguousarray(state[name])
        parts = backend.to_numpy(layer.mp_group.allgather(backend.asarray(part), stack=True))
        shape = layer.full_weight_shape if attr == "weight" else (layer.full_weight_shape[1],)
        whole = np.empty(shape, dtype=part.dtype)
        for rank in range(layer.mp_size):
            whole[layer.split_index(attr, rank)] = parts[rank]
        state[name] = whole
    return state


def split_state_dict(model, state):
    """``state`` (a serial model's, or one ``merged_state_dict`` made) with every parameter
    ``model`` splits cut to this rank's part."""
    state = dict(state)
    for name, layer, attr in _split_parameters(model):
        if name in state:
            state[name] = np.asarray(state[name])[layer.split_index(attr, layer.mp_rank)]
    return state


class _SerialView:
    """What ``fleetmpi.checkpoint`` sees of a tensor-parallel model: the serial state, with
    the model-parallel degree that wrote it; loading cuts it to this rank's parts."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        state = merged_state_dict(self.model)
        state[DEGREE_KEY] = np.array(_degree(self.model))
        return state

    def set_state_dict(self, state):
        state = dict(state)
        saved = int(state.pop(DEGREE_KEY, 1))
        degree = _degree(self.model)
        if self.optimizer is not None and saved != degree:
            raise ValueError(f"the checkpoint was saved at mp_degree {saved}; this model runs "
                             f"at mp_degree {degree}, and optimizer state is laid out over a "
                             f"rank's own parameters: load with optimizer=None to start the "
                             f"optimizer afresh from the loaded parameters")
        self.model.set_state_dict(split_state_dict(self.model, state))


def save(directory, model, optimizer, step, extra=None):
    """``fleetmpi.checkpoint.save`` with the model's parameters stored whole (module
    docstring); every rank must call it."""
    return checkpoint.save(directory, _SerialView(model, optimizer), optimizer, step, extra)


def load(directory, model, optimizer=None):
    """Restore ``model`` (at any model-parallel degree, or serial) and, when the degree is the
    one that saved, ``optimizer`` from a checkpoint ``save`` wrote. Every rank's file holds
    the whole model, so without an optimizer a job of another size loads it too (rank ``r``
    reads file ``r % saved``); with one, ``fleetmpi.checkpoint.load``'s rules apply."""
    return checkpoint.load(directory, _SerialView(model, optimizer), optimizer,
                           replicated=optimizer is None)

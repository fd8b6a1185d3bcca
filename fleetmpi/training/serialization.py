"""``fleetmpi.save`` / ``fleetmpi.load``: Paddle's ``paddle.save`` / ``paddle.load`` for
state dicts, in the safetensors format (through the ``safetensors`` package's NumPy API), which
PaddlePaddle, PyTorch and other tools read, and which holds no pickle.

What is saved: a dict whose values are Tensors or arrays (the tensors of the file, under their
keys: a model's ``state_dict()`` keeps Paddle's names, ``Linear`` weights in Paddle's
``(in, out)`` layout), numbers, strings, None, or dicts of these (an optimizer's
``state_dict()``: its ``step_count`` and schedule); nested dicts of tensors are stored with
their keys joined by ``/``. Everything that is not a tensor travels as JSON in the file's
metadata, under ``fleetmpi.values``. The file is written beside its name and renamed into
place (``fleetmpi.core.files``): never through a symbolic link, never half written.
"""
import json
import numbers
import os

import numpy as np

from ..core import files
from ..core.extras import MissingExtra
from ..autograd.tensor import Tensor, to_tensor

SEPARATOR = "/"
VALUES_KEY = "fleetmpi.values"


def _safetensors():
    try:
        import safetensors.numpy
    except ImportError:
        raise MissingExtra("fleetmpi.save and fleetmpi.load (the safetensors format)",
                           "safetensors", "safetensors") from None
    return safetensors


def _is_value(value):
    return value is None or isinstance(value, (str, bool, numbers.Number))


def _split(obj, prefix, tensors, values):
    for key, value in obj.items():
        if not isinstance(key, str) or SEPARATOR in key or not key:
            raise ValueError(f"fleetmpi.save takes string keys without {SEPARATOR!r}, not "
                             f"{key!r}")
        name = prefix + key
        if isinstance(value, Tensor):
            value = value.numpy()
        elif hasattr(value, "get") and not isinstance(value, (np.ndarray, dict)):
            value = value.get()  # a CuPy array
        if isinstance(value, np.ndarray):
            tensors[name] = np.ascontiguousarray(value)
        elif isinstance(value, dict) and value and all(
                not _is_value(v) for v in value.values()):
            _split(value, name + SEPARATOR, tensors, values)
        elif _is_value(value) or isinstance(value, dict):
            values[name] = _checked_value(name, value)
        else:
            raise TypeError(f"fleetmpi.save cannot store {name!r}: a {type(value).__name__}; "
                            "it takes Tensors, arrays, numbers, strings, None and dicts of them")


def _checked_value(name, value):
    try:
        json.dumps(value, allow_nan=True)
    except TypeError:
        raise TypeError(f"fleetmpi.save cannot store {name!r}: {value!r} is neither a tensor "
                        "nor numbers, strings, None and dicts of them") from None
    return value


def save(obj, path):
    """Write the dict ``obj`` (module docstring) to ``path`` in the safetensors format."""
    if not isinstance(obj, dict):
        raise TypeError(f"fleetmpi.save takes a dict such as a state_dict, not "
                        f"{type(obj).__name__}")
    tensors, values = {}, {}
    _split(obj, "", tensors, values)
    data = _safetensors().numpy.save(tensors, metadata={VALUES_KEY: json.dumps(values)})
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot save to {path}: the folder {folder} does not exist")
    files.write_atomically(path, lambda f: f.write(data))


def _nest(flat):
    nested = {}
    for name, value in flat.items():
        *outer, last = name.split(SEPARATOR)
        level = nested
        for key in outer:
            level = level.setdefault(key, {})
        level[last] = value
    return nested


def load(path, return_numpy=False):
    """The dict ``save`` wrote to ``path``: its tensors as Tensors on the backend's device (or
    NumPy arrays with ``return_numpy``), its other values as they were. A safetensors file
    written by another tool loads too (its tensors alone)."""
    safetensors = _safetensors()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no file to load at {path}")
    try:
        with safetensors.safe_open(path, framework="numpy") as f:
            metadata = f.metadata() or {}
            flat = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, ValueError, safetensors.SafetensorError) as error:
        raise ValueError(f"{path} is not a readable safetensors file: {error}") from None
    values = _stored_values(path, metadata, flat)
    if not return_numpy:
        flat = {name: to_tensor(array) for name, array in flat.items()}
    flat.update(values)
    return _nest(flat)


def _stored_values(path, metadata, tensors):
    """The values of the file's ``VALUES_KEY`` metadata; a ValueError naming ``path`` where
    they are not a JSON object, or where one would take the place of a tensor (the same name,
    or a name that one of them nests under), which ``save`` never writes."""
    try:
        values = json.loads(metadata.get(VALUES_KEY, "{}"))
    except ValueError as error:
        raise ValueError(f"{path}: its {VALUES_KEY} metadata is not JSON ({error})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: its {VALUES_KEY} metadata is a {type(values).__name__}, "
                         "not a JSON object")
    for name in values:
        clash = [t for t in tensors if t == name or t.startswith(name + SEPARATOR)
                 or name.startswith(t + SEPARATOR)]
        if clash:
            raise ValueError(f"{path}: its {VALUES_KEY} metadata holds {name!r}, which would "
                             f"take the place of the tensor {clash[0]!r}; fleetmpi.save never "
                             "writes such a file, so it is not loaded")
    return values

"""``fleetmpi.save`` / ``fleetmpi.load``: Paddle's ``paddle.save`` / ``paddle.load`` for
state dicts. To a name Paddle gives its checkpoints (``PADDLE_SUFFIXES``: ``.pdparams``,
``.pdopt``, ``.pdscaler`` (a ``GradScaler``'s, which ``paddle.Model.save`` writes under amp),
and ``.pdmodel``, the model file of its ``save_group_sharded_model``) ``save``
writes Paddle's own format (``paddle_pickle``), which ``paddle.load`` reads; to any other name
the safetensors format (through the ``safetensors`` package's NumPy API), which PaddlePaddle,
PyTorch and other tools read, and which holds no pickle. ``load`` tells the two apart by the
file's first bytes, whatever its name (a ``.pdparams`` an older fleetmpi wrote is
safetensors), reads Paddle's through a restricted unpickler that runs nothing from the file,
and refuses a file that is neither, naming the format its name calls for.

What is saved in the safetensors format: a dict whose values are Tensors or arrays (the
tensors of the file, under their keys: a model's ``state_dict()`` keeps Paddle's names,
``Linear`` weights in Paddle's ``(in, out)`` layout), numbers, strings, None, or dicts of these
(an optimizer's ``state_dict()``: its ``step_count`` and schedule); nested dicts of tensors are
stored with their keys joined by ``/``. Everything that is not a tensor travels as JSON in the file's
metadata, under ``fleetmpi.values``. The file is written beside its name and renamed into
place (``fleetmpi.core.files``): never through a symbolic link, never half written.
"""
import functools
import json
import numbers
import os
import pickle

import numpy as np

from ..core import files
from ..core.extras import MissingExtra
from ..autograd.tensor import Tensor, to_tensor
from . import paddle_pickle

SEPARATOR = "/"
VALUES_KEY = "fleetmpi.values"
PADDLE_SUFFIXES = (".pdparams", ".pdopt", ".pdscaler", ".pdmodel")


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


def _is_paddle_name(path):
    return str(path).endswith(PADDLE_SUFFIXES)


def save(obj, path):
    """Write the dict ``obj`` (module docstring) to ``path``: in Paddle's format to a name of
    ``PADDLE_SUFFIXES``, else in the safetensors format."""
    if not isinstance(obj, dict):
        raise TypeError(f"fleetmpi.save takes a dict such as a state_dict, not "
                        f"{type(obj).__name__}")
    if _is_paddle_name(path):
        write = functools.partial(paddle_pickle.dump, obj)
    else:
        tensors, values = {}, {}
        _split(obj, "", tensors, values)
        data = _safetensors().numpy.save(tensors, metadata={VALUES_KEY: json.dumps(values)})

        def write(f):
            f.write(data)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot save to {path}: the folder {folder} does not exist")
    files.write_atomically(path, write)


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
    NumPy arrays with ``return_numpy``), its other values as they were. A checkpoint Paddle
    wrote, and a safetensors file written by another tool (its tensors alone), load too."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no file to load at {path}")
    with open(path, "rb") as f:
        if paddle_pickle.is_pickle(f.read(2)):
            f.seek(0)
            return _paddle_checkpoint(path, f, return_numpy)
    safetensors = _safetensors()
    try:
        with safetensors.safe_open(path, framework="numpy") as f:
            metadata = f.metadata() or {}
            flat = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, ValueError, safetensors.SafetensorError) as error:
        if _is_paddle_name(path):
            raise ValueError(f"{path} is not a Paddle checkpoint (the pickle paddle.save "
                             f"writes, which its name calls for), nor a readable safetensors "
                             f"file: {error}") from None
        raise ValueError(f"{path} is not a readable safetensors file (what fleetmpi.save "
                         f"writes to this name), nor a Paddle checkpoint (a pickle): "
                         f"{error}") from None
    values = _stored_values(path, metadata, flat)
    if not return_numpy:
        flat = {name: to_tensor(array) for name, array in flat.items()}
    flat.update(values)
    return _nest(flat)


def _paddle_checkpoint(path, file, return_numpy):
    """The Paddle checkpoint in ``file`` (``path``), its arrays as Tensors unless
    ``return_numpy``; a ValueError naming ``path`` and what is not admitted."""
    try:
        loaded = paddle_pickle.load(file)
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError,
            IndexError) as error:
        raise ValueError(f"{path} is not loaded as a Paddle checkpoint: {error}") from None
    return loaded if return_numpy else _as_tensors(loaded)


def _as_tensors(value):
    if isinstance(value, np.ndarray):
        return to_tensor(value)
    if isinstance(value, dict):
        return {key: _as_tensors(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_as_tensors(item) for item in value)
    return value


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

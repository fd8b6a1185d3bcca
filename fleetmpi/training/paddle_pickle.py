"""Paddle's checkpoint files (``.pdparams``, ``.pdopt``, and ``model.pdmodel`` of its
``save_group_sharded_model``): what Paddle 2.x's ``paddle.save`` writes, written and read.

The layout (Paddle's ``python/paddle/framework/io.py``): a pickled dict, pickle protocol 4,
whose tensors are NumPy arrays, keyed by their structured names, and whose other values
(numbers, strings, nested dicts such as an optimizer's ``LR_Scheduler``) are themselves;
beside them ``"StructuredToParameterName@@"`` maps each tensor's key to the tensor's name,
which ``paddle.load`` reads to know which values to make Tensors and then drops. A file Paddle
wrote with protocol 2 or 3 cuts each array over 2**30 bytes into flat slices named
``<key>@@.<i>`` and lists them, with the original shape, under
``"UnpackBigParamInfor@@"``; reading joins them back.

Reading never runs code from the file: a ``pickle.Unpickler`` whose ``find_class`` admits
NumPy's array and scalar reconstruction, ``numpy.ndarray`` and ``numpy.dtype`` (not of Python
objects), ``collections.OrderedDict``, the built-in containers, strings and numbers, and
``_codecs.encode`` to latin-1 (how protocol 2 stores bytes); anything else, such as a
``__reduce__`` naming ``os.system``, is refused before it is called.
"""
import _codecs
import builtins
import collections
import pickle

import numpy as np

from ..autograd.tensor import Tensor

PROTOCOL = 4
NAME_TABLE_KEY = "StructuredToParameterName@@"
SLICES_KEY = "UnpackBigParamInfor@@"

# NumPy's own reconstruction functions, whichever module spells them (numpy.core before NumPy
# 2, numpy._core since): taken from what NumPy pickles, without importing either name.
_RECONSTRUCT = np.ndarray((0,)).__reduce__()[0]
_SCALAR = np.float64(0).__reduce__()[0]


def _dtype(*args):
    """``numpy.dtype`` as a pickle calls it, for dtypes that hold no Python objects."""
    dtype = np.dtype(*args)
    if dtype.hasobject or dtype.kind == "V":
        raise pickle.UnpicklingError(f"the file holds an array of dtype {dtype}; a Paddle "
                                     "checkpoint holds arrays of numbers only")
    return dtype


def _latin1(text, encoding="latin1"):
    """``_codecs.encode`` as protocol 2 pickles bytes: latin-1 alone."""
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError(f"the file calls _codecs.encode with {encoding!r}; only "
                                     "latin-1 bytes are read")
    return _codecs.encode(text, "latin1")


_ADMITTED = {
    **{(module, "_reconstruct"): _RECONSTRUCT
       for module in ("numpy.core.multiarray", "numpy._core.multiarray")},
    **{(module, "scalar"): _SCALAR
       for module in ("numpy.core.multiarray", "numpy._core.multiarray")},
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): _dtype,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("_codecs", "encode"): _latin1,
    **{("builtins", name): getattr(builtins, name)
       for name in ("dict", "list", "tuple", "str", "bytes", "int", "float", "complex",
                    "bool")},
}


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that finds only the names of ``_ADMITTED`` (module docstring)."""

    def find_class(self, module, name):
        found = _ADMITTED.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(
                f"it refers to {module}.{name}, which a Paddle checkpoint never holds (only "
                f"NumPy arrays, dicts, lists, tuples, strings and numbers are read), so it is "
                f"not loaded and nothing in it runs")
        return found


def is_pickle(head):
    """Whether the first bytes of a file are a pickle's of protocol 2 or later."""
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= pickle.HIGHEST_PROTOCOL


def _host(value, where):
    """``value`` with its tensors as host NumPy arrays, checked to hold only what the layout
    holds."""
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise TypeError(f"fleetmpi.save cannot store the key {key!r} under {where!r} "
                                "in Paddle's format: keys are strings")
        return {key: _host(item, f"{where}/{key}" if where else key)
                for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_host(item, where) for item in value)
    if isinstance(value, Tensor):
        return np.asarray(value.numpy())
    if hasattr(value, "get") and hasattr(value, "dtype"):  # a CuPy array
        return value.get()
    if isinstance(value, (np.ndarray, np.generic, str, bytes, int, float, complex, bool)) \
            or value is None:
        return value
    raise TypeError(f"fleetmpi.save cannot store {where!r}: a {type(value).__name__}; Paddle's "
                    "format takes Tensors, arrays, numbers, strings, None and dicts, lists "
                    "and tuples of them")


def dump(obj, file):
    """Write the dict ``obj`` to the binary ``file`` as ``paddle.save`` does (module
    docstring); a tensor's name is its ``name`` where it has one, else its key."""
    saved = _host(obj, "")
    saved[NAME_TABLE_KEY] = {key: getattr(value, "name", None) or key
                             for key, value in obj.items()
                             if isinstance(saved[key], np.ndarray)}
    pickle.dump(saved, file, protocol=PROTOCOL)


def _joined(loaded):
    """``loaded`` with the slices of ``SLICES_KEY`` joined back and the name table dropped."""
    if not isinstance(loaded, dict):
        return loaded
    loaded = dict(loaded)
    loaded.pop(NAME_TABLE_KEY, None)
    for key, info in loaded.pop(SLICES_KEY, {}).items():
        loaded[key] = np.concatenate([loaded.pop(part) for part in info["slices"]]).reshape(
            info["OriginShape"])
    return loaded


def load(file):
    """What the Paddle checkpoint in the binary ``file`` holds, read by
    ``RestrictedUnpickler``."""
    return _joined(RestrictedUnpickler(file, encoding="latin1").load())

"""Reduction ops and element types the collectives accept, and their local arithmetic.

The arithmetic works on NumPy and CuPy arrays alike: every function dispatches on the array's
own module, so the algorithms never import CuPy themselves.
"""
import numpy as np

OPS = ("sum", "mean", "max", "min")
DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64),
          np.dtype(np.int32), np.dtype(np.int64))


def array_module(a):
    """``numpy`` for host arrays, ``cupy`` for device arrays."""
    if a.__class__ is not np.ndarray and type(a).__module__.startswith("cupy"):
        import cupy
        return cupy
    return np


def is_device_array(a):
    return a.__class__ is not np.ndarray and type(a).__module__.startswith("cupy")


def check_op(op):
    if op not in OPS:
        raise ValueError(f"op={op!r} is not a reduction this communicator knows; "
                         f"allowed: {', '.join(OPS)}")
    return op


def check_dtype(dtype):
    dtype = np.dtype(dtype)
    if dtype not in DTYPES:
        raise TypeError(f"dtype {dtype} cannot be reduced; allowed: "
                        f"{', '.join(str(d) for d in DTYPES)}")
    return dtype


_UFUNCS = {"sum": "add", "mean": "add", "max": "maximum", "min": "minimum"}


def reducer(xp, op):
    """The ufunc of ``xp`` (NumPy or CuPy) that combines two partial results of ``op``
    elementwise; ``mean`` accumulates as ``sum``."""
    return getattr(xp, _UFUNCS[op])


def reduce_into(acc, other, op):
    """``acc = op(acc, other)`` elementwise, in place."""
    reducer(array_module(acc), op)(acc, other, out=acc, casting="unsafe")


def finish_mean(buf, op, size):
    """Turn a sum into a mean over ``size`` ranks, in place.

    Integer means use floor division (``sum // size``) so the dtype is kept.
    """
    if op != "mean" or size == 1:
        return
    xp = array_module(buf)
    if buf.dtype.kind == "f":
        xp.divide(buf, size, out=buf, casting="unsafe")
    else:
        xp.floor_divide(buf, size, out=buf)

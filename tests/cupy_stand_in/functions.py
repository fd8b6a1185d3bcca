"""The CuPy functions whose behaviour is not "NumPy's function as a device operation":
creation (what launches a kernel and what only allocates), copies between host and device
(and their refusals while a stream captures), and ``copyto``'s rules for host sources.
"""
import numpy as np

from . import arrays
from .arrays import call, empty, from_host, ndarray, unsupported


def _runtime():
    return arrays.current_runtime()


def empty_like(a, dtype=None, order="K", subok=None, shape=None):
    return empty(a.shape if shape is None else shape, a.dtype if dtype is None else dtype,
                 "F" if order == "F" else "C")


def _memset(out):
    _runtime().enqueue("memset", lambda: out._array.fill(0))
    return out


def zeros(shape, dtype=float, order="C"):
    """New memory set to zero by a memset queued on the current stream (``cupy.zeros``)."""
    return _memset(empty(shape, dtype, order))


def zeros_like(a, dtype=None, order="K", subok=None, shape=None):
    return _memset(empty_like(a, dtype, order, shape=shape))


def full(shape, fill_value, dtype=None, order="C"):
    dtype = np.result_type(fill_value) if dtype is None else dtype
    out = empty(shape, dtype, order)
    out.fill(fill_value)
    return out


def full_like(a, fill_value, dtype=None, order="K", subok=None, shape=None):
    out = empty_like(a, dtype, order, shape=shape)
    out.fill(fill_value)
    return out


def ones(shape, dtype=float, order="C"):
    return full(shape, 1, dtype, order)


def ones_like(a, dtype=None, order="K", subok=None, shape=None):
    return full_like(a, 1, dtype, order, shape=shape)


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, blocking=False):
    """``obj`` on the device: a device array copied (or itself, where ``copy`` allows), host
    data copied from the host."""
    if isinstance(obj, ndarray):
        if copy or (dtype is not None and np.dtype(dtype) != obj.dtype):
            return call("copy", lambda: np.array(obj._array, dtype=dtype, order=order,
                                                  ndmin=ndmin))
        return obj
    out = from_host(obj, dtype, ndmin, "F" if order == "F" else "C")
    if blocking:
        _runtime().current_stream().synchronize()
    return out


def asarray(a, dtype=None, order=None, blocking=False):
    return array(a, dtype, copy=False, order=order or "K", blocking=blocking)


def ascontiguousarray(a, dtype=None):
    """CuPy's takes device arrays only (``_core.ascontiguousarray`` is typed)."""
    if not isinstance(a, ndarray):
        raise TypeError(f"Argument 'a' has incorrect type (expected "
                        f"cupy._core.core._ndarray_base, got {type(a).__name__})")
    if a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    return call("ascontiguousarray", lambda: np.ascontiguousarray(a._array, dtype=dtype))


def asnumpy(a, stream=None, order="C", out=None, blocking=True):
    if isinstance(a, ndarray):
        return a.get(stream, order, out, blocking)
    return np.asarray(a, order=order)


def copyto(dst, src, casting="same_kind", where=None):
    """CuPy's rules for the source: a Python or NumPy scalar, a one-element NumPy array
    (taken as its value), or a device array."""
    if isinstance(src, np.ndarray):
        if src.size != 1:
            raise ValueError("non-scalar numpy.ndarray cannot be used for copyto")
        src = src.squeeze()[()]
    if not isinstance(dst, ndarray):
        raise TypeError(f"Argument 'dst' has incorrect type (expected cupy.ndarray, got "
                        f"{type(dst).__name__})")
    np_src, np_where = arrays.unwrap(src), arrays.unwrap(where)
    kwargs = {} if where is None else {"where": np_where}
    _runtime().enqueue("copyto", lambda: np.copyto(dst._array, np_src, casting=casting,
                                                   **kwargs))


def as_strided(x, shape=None, strides=None):
    """``cupy.lib.stride_tricks.as_strided``: a view."""
    if not isinstance(x, ndarray):
        raise unsupported(x)
    return call("as_strided", lambda: np.lib.stride_tricks.as_strided(x._array, shape, strides))

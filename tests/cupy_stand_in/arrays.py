"""Device arrays of the CuPy stand-in and the operations over them.

An ``ndarray`` is a NumPy array in pool memory (``runtime.MemoryPool``) behind CuPy's
interface, not a NumPy subclass, so that what CuPy refuses of a device array is refused here
too: ``numpy.asarray(x)`` raises CuPy's ``TypeError`` (read with ``get()``), a NumPy array
given to an elementwise operation or a kernel raises ``TypeError: Unsupported type`` (CuPy
takes Python and NumPy scalars only), and ``isinstance(x, numpy.ndarray)`` is False.

Each operation is a kernel queued through ``Runtime.enqueue``:

* one that makes new arrays runs NumPy's function on the inputs' memory, puts the result in
  memory from the current allocator, and queues the same computation into that memory: run
  now (already done) or recorded by a capture, so a graph's replay recomputes it from what
  its inputs hold then. Inside a capture the result is thus computed once when the operation
  is recorded, from what the inputs held then; a GPU leaves it unwritten until a replay. Only
  a host read could tell, and reads are refused while capturing;
* one that writes existing arrays (``out=``, ``a[...] = b``, ``+=``, ``fill``, ``copyto``,
  ``ufunc.at``, a RawKernel) is queued as it is: run now, or only recorded;
* a view (a slice, a reshape NumPy does without copying, a transpose) launches nothing and
  shares its base's memory; reductions and element indexing give 0-d arrays, as CuPy's do.
"""
import weakref

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from .runtime import Device, MemoryPointer

_runtime = None  # the Runtime of the installed stand-in (``install`` sets it)
# NumPy's functions that CuPy runs in a library, not as a kernel: {function: route(args,
# kwargs)}, filled by ``products`` (cuBLAS), and taken by the ufunc and function protocols.
LIBRARY_ROUTES = {}
_memories = weakref.WeakValueDictionary()  # id(owning array) -> the Memory living on it now


def current_runtime():
    return _runtime


def unsupported(value):
    """What CuPy's kernels raise for an argument that is neither a device array nor a
    scalar (``cupy/_core/_scalar.pyx``)."""
    return TypeError(f"Unsupported type {type(value)}")


def unwrap(value):
    """The NumPy arrays behind device arrays in ``value`` (recursing into lists, tuples and
    dicts); a NumPy array raises what CuPy raises for one."""
    if isinstance(value, ndarray):
        return value._array
    if isinstance(value, np.ndarray):
        raise unsupported(value)
    if type(value) in (list, tuple):
        return type(value)(unwrap(v) for v in value)
    if type(value) is dict:
        return {key: unwrap(v) for key, v in value.items()}
    return value


def device_arrays(value):
    """The device arrays in ``value`` (lists, tuples and dicts searched)."""
    if isinstance(value, ndarray):
        return [value]
    if type(value) in (list, tuple):
        return [a for v in value for a in device_arrays(v)]
    if type(value) is dict:
        return device_arrays(list(value.values()))
    return []


def _owning(array):
    """The NumPy array that owns ``array``'s memory: NumPy points every view's ``base`` there
    (a pool block is itself a view, aligned within a larger allocation)."""
    while array.base is not None:
        array = array.base
    return array


def _owner(array):
    """The ``Memory`` that ``array`` (a NumPy array) is a view of, or None for fresh memory."""
    base = array
    while base is not None:
        memory = _memories.get(id(base))
        if memory is not None and _owning(memory.buffer) is base:
            return memory
        base = getattr(base, "base", None)
    return None


def empty(shape, dtype=float, order="C"):
    """A new device array from the current allocator (``cupy.empty``): no kernel, and its
    memory holds what the pool's block held."""
    return ndarray(shape, dtype, order=order)


def _view(array, memory):
    view = ndarray.__new__(ndarray)
    view._array, view._memory = array, memory
    return view


def _fresh(result):
    """A device array holding ``result`` (a new NumPy array), in allocator memory."""
    order = "F" if result.flags.f_contiguous and not result.flags.c_contiguous else "C"
    out = empty(result.shape, result.dtype, order)
    out._array[...] = result
    return out


def wrap(result, inputs, recompute, name, library=None):
    """Device arrays for what a NumPy function returned (``result``: an array, a scalar, a
    tuple or list of them, or host values such as a shape) over the device arrays
    ``inputs``: an input itself, a view of an input's memory, or new arrays, for which the
    kernel ``name`` (``recompute()``, the same call; ``library``'s call where given) is
    queued (module docstring)."""
    many = isinstance(result, (tuple, list))
    results = list(result) if many else [result]
    made = []
    for index, value in enumerate(results):
        if isinstance(value, np.generic):
            value = np.asarray(value)
        if not isinstance(value, np.ndarray):
            continue
        same = next((a for a in inputs if a._array is value), None)
        memory = None if same is not None else _owner(value)
        if same is not None:
            results[index] = same
        elif memory is not None:
            results[index] = _view(value, memory)
        else:
            results[index] = _fresh(value)
            made.append((index, results[index]._array))
    if made:
        def run():
            again = recompute()
            again = list(again) if many else [again]
            for index, target in made:
                target[...] = again[index]
        _runtime.enqueue(name, run, done=True, library=library)
    return type(result)(results) if many else results[0]


def call(name, func, args=(), kwargs=None, library=None):
    """``func(*args, **kwargs)`` (a NumPy function or method) as a device operation: with
    ``out=`` a kernel writing it, else ``wrap``'s. ``library``: the call is a library's
    (counted as its call, not as a launch)."""
    kwargs = kwargs or {}
    inputs = device_arrays([args, kwargs])
    np_args, np_kwargs = unwrap(tuple(args)), unwrap(dict(kwargs))

    def recompute():
        return func(*np_args, **np_kwargs)
    out = kwargs.get("out")
    if out is not None:
        _runtime.enqueue(name, recompute, library=library)
        return out[0] if isinstance(out, tuple) and len(out) == 1 else out
    return wrap(recompute(), inputs, recompute, name, library)


class ufunc:
    """A CuPy ufunc over NumPy's of the same name (its ``reduce``, ``at``... are NumPy's,
    which hand device arrays back to ``ndarray.__array_ufunc__``)."""

    def __init__(self, numpy_ufunc):
        self._ufunc = numpy_ufunc
        self.__name__ = numpy_ufunc.__name__

    def __repr__(self):
        return f"<stand-in ufunc '{self.__name__}'>"

    def __getattr__(self, name):
        return getattr(self._ufunc, name)

    def __call__(self, *inputs, **kwargs):
        return ufunc_call(self._ufunc, "__call__", inputs, kwargs)


def ufunc_call(numpy_ufunc, method, inputs, kwargs):
    """NumPy's ufunc protocol on device arrays: a kernel (a matrix product: its
    ``LIBRARY_ROUTES`` entry)."""
    if numpy_ufunc in LIBRARY_ROUTES and method == "__call__":
        return LIBRARY_ROUTES[numpy_ufunc](inputs, kwargs)
    func = numpy_ufunc if method == "__call__" else getattr(numpy_ufunc, method)
    name = numpy_ufunc.__name__ if method == "__call__" else f"{numpy_ufunc.__name__}.{method}"
    if method == "at":
        np_inputs = unwrap(tuple(inputs))
        _runtime.enqueue(name, lambda: func(*np_inputs))
        return None
    if kwargs.get("out") is not None and not isinstance(kwargs["out"], tuple):
        kwargs = dict(kwargs, out=(kwargs["out"],))
    return call(name, func, inputs, kwargs)


class ndarray(NDArrayOperatorsMixin):
    """``cupy.ndarray(shape, dtype=float, memptr=None, strides=None, order='C')``: new
    memory from the current allocator, or the memory at ``memptr``."""

    __module__ = "cupy"  # what CuPy's arrays say, and how comm.ops tells device arrays

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(s) for s in shape)
        dtype = np.dtype(dtype)
        if memptr is None:
            memptr = _runtime.alloc(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        buffer = memptr.mem.buffer
        self._array = np.ndarray(shape, dtype, buffer=buffer, offset=memptr.offset,
                                 strides=strides, order=order)
        self._memory = memptr.mem
        _memories[id(_owning(buffer))] = memptr.mem

    # -- what CuPy's arrays have -------------------------------------------------------------
    shape = property(lambda self: self._array.shape)
    dtype = property(lambda self: self._array.dtype)
    ndim = property(lambda self: self._array.ndim)
    size = property(lambda self: self._array.size)
    nbytes = property(lambda self: self._array.nbytes)
    itemsize = property(lambda self: self._array.itemsize)
    strides = property(lambda self: self._array.strides)
    flags = property(lambda self: self._array.flags)
    T = property(lambda self: _view(self._array.T, self._memory))

    @property
    def data(self):
        """The ``MemoryPointer`` of the first element: ``.ptr`` is its (host) address."""
        return MemoryPointer(self._memory, self._array.ctypes.data - self._memory.ptr)

    @property
    def device(self):
        return Device(_runtime, self._memory.device_id)

    def __repr__(self):  # CuPy's repr copies to the host; this one reads nothing
        return f"<stand-in cupy.ndarray shape={self.shape} dtype={self.dtype}>"

    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use "
                        "`.get()` to construct a NumPy array explicitly.")

    def __array_ufunc__(self, numpy_ufunc, method, *inputs, **kwargs):
        return ufunc_call(numpy_ufunc, method, inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        if func in LIBRARY_ROUTES:
            return LIBRARY_ROUTES[func](args, kwargs)
        return call(func.__name__, func, args, kwargs)

    def __getattr__(self, name):
        """CuPy's methods that are NumPy's of the same name, as device operations."""
        if name not in _METHODS:
            raise AttributeError(f"'cupy.ndarray' object has no attribute '{name}'")
        method = getattr(self._array, name)
        return lambda *args, **kwargs: call(name, method, args, kwargs)

    real = property(lambda self: call("real", lambda: self._array.real))
    imag = property(lambda self: call("imag", lambda: self._array.imag))

    # -- host reads and writes -----------------------------------------------------------------
    def get(self, stream=None, order="C", out=None, blocking=True):
        """A host copy: a wait for the device (CuPy's D2H copy, refused while capturing)."""
        if self.size == 0:
            return np.ndarray(self.shape, self.dtype)
        _runtime.check_transfer("D2H")
        if blocking:
            _runtime.synchronized()
        if out is None:
            return np.array(self._array, order=order)
        out[...] = self._array
        return out

    def item(self):
        if self.size != 1:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        return self.get().item()

    def tolist(self):
        return self.get().tolist()

    def __float__(self):
        return float(self.get())

    def __int__(self):
        return int(self.get())

    def __bool__(self):
        if self.size != 1:
            raise ValueError("The truth value of an array with more than one element is "
                             "ambiguous. Use a.any() or a.all()")
        return bool(self.get())

    def __len__(self):
        if self.ndim == 0:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[index] for index in range(self.shape[0]))

    # -- indexing ------------------------------------------------------------------------------
    def __getitem__(self, key):
        """A view for basic indexing (0-d views for single elements, as CuPy's), a gather
        kernel for indexing by arrays; indexing by a boolean mask first reads how many
        elements it selects, a wait for the device as in CuPy."""
        np_key = index_key(key)
        if _has_mask(key):
            _runtime.check_transfer("D2H")
            _runtime.synchronized()
        parts = np_key if isinstance(np_key, tuple) else (np_key,)
        if _basic(parts) and not any(part is Ellipsis for part in parts):
            np_key = parts + (Ellipsis,)
        return call("getitem", lambda: self._array[np_key])

    def __setitem__(self, key, value):
        np_key = index_key(key)
        np_value = unwrap(from_host(value) if isinstance(value, np.ndarray) else value)

        def run():
            self._array[np_key] = np_value
        _runtime.enqueue("setitem", run)

    def fill(self, value):
        _runtime.enqueue("fill", lambda: self._array.fill(value))

    def copy(self, order="C"):
        return call("copy", lambda: np.array(self._array, order=order))

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return call("astype", lambda: self._array.astype(dtype, order=order))

    def dot(self, b, out=None):
        return LIBRARY_ROUTES[np.dot]((self, b), {} if out is None else {"out": out})

    def __copy__(self):
        return self.copy()

    def __deepcopy__(self, memo):
        return self.copy()


def host_to_device(target, host):
    """Copy the host array ``host`` into ``target`` (a NumPy array in device memory): a 0-d
    value is a fill kernel, which a capture records; anything else is CuPy's asynchronous
    copy from the host, refused while the current stream captures (``core.pyx``'s
    ``_array_default``)."""
    if host.ndim == 0:
        value = host[()]
        _runtime.enqueue("fill", lambda: target.fill(value))
        return
    _runtime.check_transfer("H2D")
    _runtime.count("host_to_device")
    target[...] = host


def from_host(obj, dtype=None, ndmin=0, order="C"):
    """A new device array holding host data ``obj`` (``host_to_device``)."""
    host = np.array(obj, dtype=dtype, ndmin=ndmin)
    out = empty(host.shape, host.dtype, order)
    host_to_device(out._array, host)
    return out


def index_key(key):
    """``key`` with device arrays unwrapped; NumPy arrays and lists in it are copied to the
    device first, as CuPy's indexing does (``_prepare_slice_list``)."""
    parts = key if isinstance(key, tuple) else (key,)
    parts = tuple(unwrap(from_host(part)) if isinstance(part, (np.ndarray, list))
                  else unwrap(part) for part in parts)
    return parts if isinstance(key, tuple) else parts[0]


# The methods of cupy.ndarray that compute as NumPy's of the same name do.
_METHODS = frozenset((
    "all", "any", "argmax", "argmin", "argpartition", "argsort", "clip", "compress", "conj",
    "conjugate", "cumprod", "cumsum", "diagonal", "flatten", "max", "mean", "min", "prod",
    "ptp", "ravel", "repeat", "reshape", "round", "squeeze", "std", "sum", "swapaxes", "take",
    "trace", "transpose", "var", "view"))


def _basic(key):
    """Whether ``key`` (unwrapped) indexes basically: integers, slices, None, Ellipsis."""
    parts = key if isinstance(key, tuple) else (key,)
    return all(part is None or part is Ellipsis or isinstance(part, (slice, int, np.integer))
               for part in parts)


def _has_mask(key):
    parts = key if isinstance(key, tuple) else (key,)
    return any(isinstance(part, ndarray) and part.dtype == np.bool_ for part in parts)

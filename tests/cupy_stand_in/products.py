"""Matrix products through CuPy's cuBLAS wrappers: ``matmul`` (and ``@``), ``dot``,
``tensordot`` and the ``einsum`` that contract two operands.

Each is one cuBLAS call (``library_calls["cublas"]``), refused while the current stream
captures with CuPy 14's ``NotImplementedError`` (``Runtime.check_cublas``): the failure of
every captured step on the H200. Half-precision operands multiply as cuBLAS does for CuPy, to
a float16 unit: their products summed exactly (in float64) and rounded to the operands' dtype
once, the bits of the NumPy branch's product (``fleetmpi/kernels/products.py``).
"""
import numpy as np

from . import arrays


def _summed_exactly(func, dtype):
    def product(*operands, out=None, **kwargs):
        wide = [a.astype(np.float64) if isinstance(a, np.ndarray) else a for a in operands]
        result = func(*wide, **kwargs).astype(dtype)
        if out is None:
            return result
        out[...] = result
        return out
    return product


def product(name, func, operands, kwargs):
    """``func(*operands, **kwargs)`` as one cuBLAS call."""
    arrays.current_runtime().check_cublas()
    dtypes = {a.dtype for a in arrays.device_arrays(list(operands))}
    if len(dtypes) == 1:
        dtype = dtypes.pop()
        if dtype.itemsize == 2 and dtype.kind in "fV":
            func = _summed_exactly(func, dtype)
    return arrays.call(name, func, operands, kwargs, library="cublas")


def matmul(a, b, out=None, **kwargs):
    return product("matmul", np.matmul, (a, b), kwargs if out is None else dict(kwargs, out=out))


def dot(a, b, out=None):
    return product("dot", np.dot, (a, b), {} if out is None else {"out": out})


def tensordot(a, b, axes=2):
    return product("tensordot", np.tensordot, (a, b), {"axes": axes})


def _contracts(subscripts, count):
    """Whether an einsum of ``count`` operands sums over an index that two of them share
    (CuPy then multiplies them through cuBLAS), rather than only reducing or broadcasting."""
    if count < 2:
        return False
    inputs, _, output = subscripts.replace(" ", "").partition("->")
    terms = inputs.split(",")
    if not output and "->" not in subscripts:
        letters = "".join(terms)
        output = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    shared = {c for c in set("".join(terms)) if sum(c in term for term in terms) >= 2}
    return any(c not in output for c in shared if c.isalpha())


def einsum(subscripts, *operands, **kwargs):
    if _contracts(subscripts, len(operands)):
        return product("einsum", lambda *ops, **kw: np.einsum(subscripts, *ops, **kw),
                       operands, kwargs)
    return arrays.call("einsum", lambda *ops, **kw: np.einsum(subscripts, *ops, **kw),
                       operands, kwargs)


# ``a @ b``, ``a.dot(b)`` and NumPy's functions on device arrays come here, as CuPy's do.
arrays.LIBRARY_ROUTES.update({
    numpy_function: lambda args, kwargs, function=function: function(*args, **kwargs)
    for numpy_function, function in ((np.matmul, matmul), (np.dot, dot),
                                     (np.tensordot, tensordot), (np.einsum, einsum))})

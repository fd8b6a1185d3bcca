"""The one matrix product of the trainer: ``matmul_arrays(a, b, out=None)``, ``a @ b`` over the
last two axes with the leading axes broadcast, as NumPy's ``@``. Every product of the trainer
(``MatMul``, ``Linear`` forward and gradients, attention, im2col convolution, the tied head of
GPT, the tensor-parallel layers through ``Linear``) calls it.

On NumPy it is ``a @ b``, except that float16 and bfloat16 operands of one dtype multiply as a
GPU's matrix product in that dtype does: products summed in at least float32 and rounded to the
operands' dtype once. On the host the sums run in float64 (NumPy has no BLAS for float16, its
own loop is hundreds of times slower, and ml_dtypes' bfloat16 product returns float32). A
product of two float16 values is exact in float64, and so is the sum of a row of a thousand of
them spanning up to 2**20 in magnitude (beyond that its error is some 2**-30 of a float16
unit), so the one rounding gives the same bits whatever order the BLAS kernel sums in. Float32
sums did not: OpenBLAS picks its kernel by CPU (``OPENBLAS_CORETYPE``: Haswell, SkylakeX, Zen),
each sums in its own order, and a float32 sum that lands on the other side of a float16
rounding boundary changes an output by a float16 unit. An amp step carries such a unit on:
ResNet-20's amp gradients differed by up to 40% of a layer's largest between the Haswell and
SkylakeX kernels (``tests/test_amp_numerics.py`` says why a unit can move a gradient that far);
in float64 they are the same bits. It costs the host 1.1 to 1.4 times a float32 product's time.

On CuPy it runs through cuBLASLt (``cublaslt.py``): CuPy 14's own cuBLAS wrapper refuses any
call while its stream captures a CUDA graph, so a step with a product could not be captured.
There float16 and bfloat16 compute in float32 (``CUBLAS_COMPUTE_32F``), as do float32
operands, which are never rounded to TF32; float64 computes in float64.
"""
import numpy as np

from ..core import backend
from . import cublaslt


def _product_shape(a, b):
    """The shape of ``a @ b`` (the broadcast leading axes, then the rows of ``a`` and the
    columns of ``b``), or a ValueError naming the shapes."""
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"matmul_arrays needs operands of at least 2 dimensions, got shapes "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    (m, k), (k2, n) = a.shape[-2:], b.shape[-2:]
    lead_a, lead_b = tuple(a.shape[:-2]), tuple(b.shape[:-2])
    try:
        lead = lead_a if lead_a == lead_b or not lead_b else (
            lead_b if not lead_a else np.broadcast_shapes(lead_a, lead_b))
    except ValueError:
        lead = None
    if k != k2 or lead is None:
        raise ValueError(f"matmul_arrays cannot multiply shapes {tuple(a.shape)} and "
                         f"{tuple(b.shape)}: the last axis of the first must equal the "
                         f"second-to-last of the second, and the leading axes must broadcast")
    return tuple(lead) + (m, n)


def _rounds_once(a, b):
    """Whether ``a @ b`` is a 16-bit floating product summed wider and rounded once."""
    return a.dtype == b.dtype and a.dtype.itemsize == 2 and backend.is_floating(a.dtype)


def _product_dtype(a, b):
    """The dtype of ``a @ b``: the operands' where they share one, else NumPy's promotion."""
    return a.dtype if a.dtype == b.dtype else np.result_type(a.dtype, b.dtype)


def _check_out(out, shape, dtype):
    if tuple(out.shape) != shape or out.dtype != dtype:
        raise ValueError(f"matmul_arrays out= of shape {tuple(out.shape)} and dtype {out.dtype} "
                         f"cannot hold the product, of shape {shape} and dtype {dtype}")


def _host_product(a, b, out):
    if _rounds_once(a, b):
        product = np.matmul(a.astype(np.float64), b.astype(np.float64))
        if out is None:
            return product.astype(a.dtype)
        out[...] = product
        return out
    return np.matmul(a, b, out=out)


def matmul_arrays(a, b, out=None, bias=None):
    """``a @ b`` over the last two axes of backend arrays of at least 2 dimensions (leading axes
    broadcast), written into ``out`` when given (an array of the product's shape and dtype,
    such as a parameter's gradient memory), else into a new array (module docstring); then
    ``+= bias`` where given (a vector of the product's columns, as a Linear layer's). On a GPU
    operands that are views (``w.T``, ``x.swapaxes(-1, -2)``, slices) are read where they lie
    (``cublaslt.py`` says which layouts it copies), and the bias is added by cuBLASLt's
    epilogue where it can be."""
    shape, dtype = _product_shape(a, b), _product_dtype(a, b)
    if out is not None:
        _check_out(out, shape, dtype)
    if backend.on_gpu():
        return cublaslt.matmul(a, b, shape, dtype, out, bias)
    product = _host_product(a, b, out)
    if bias is not None:
        product += bias
    return product

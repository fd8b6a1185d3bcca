"""Matrix products on a GPU through cuBLASLt, by NVIDIA's ``nvmath-python`` (its low-level
binding, ``nvmath.bindings.cublasLt``). CuPy 14's cuBLAS wrapper refuses every call while its
stream captures (``NotImplementedError: calling cuBLAS API during stream capture is currently
unsupported``), and all of CuPy's ``matmul``, ``@`` and ``tensordot`` go through it, so no step
with a product could be captured as a CUDA graph; cuBLASLt itself runs inside a capture when it
is handed its workspace.

A product is described to cuBLASLt as ``cublaslt_layouts.py`` says (column-major, ``C^T = B^T
A^T``). Its plan is made once per key (device; dtype, compute and scale type; each operand's
op, rows, columns, leading dimension and batch stride; the batch count; the alignment of each
pointer; whether the ``BIAS`` epilogue adds a bias) and kept for the process: the matmul
descriptor, the layouts of ``A``, ``B`` and ``D`` (``C`` is ``D``, with ``beta = 0``), the
preference (the workspace cuBLASLt may use, the pointers' alignment) and the one algorithm
its heuristic returned. A bias (a ``Linear`` layer's) is added by that epilogue, with no
launch of its own, where ``_bias_pointer`` allows; the bias's address is set on the
descriptor before each product. Each device has one handle and one workspace of
``WORKSPACE_BYTES`` (what cuBLAS asks for on Hopper), made with its first plan. Executing a
plan is one ``cublasLtMatmul`` on CuPy's current stream, ``alpha`` and ``beta`` host scalars
of the scale type: nothing is allocated besides the output, nothing waits on the host.

Making a plan is host work a CUDA graph would not replay, and the first plan also allocates the
workspace; so inside a capture (``fleetmpi.core.capture_checks.current``) a product whose plan
does not exist yet is refused with a ``CaptureError`` naming its shapes: the eager warm-up
steps before a capture (``fleetmpi.graphed_step``) make every plan the step needs. The one
workspace per device serves every stream in turn: products on two streams at once would need
one each, and the trainer queues its products on one stream at a time.

Float16 and bfloat16 products compute in float32 (``CUBLAS_COMPUTE_32F``) and round to the
operands' dtype once, as the CPU path does. Float32 products compute in float32 as well, never
in TF32 (Paddle's TF32 switch for cuBLAS is not read: the CPU path has no TF32 to match).
Products of other dtypes (integers) run CuPy's own kernel, which is not cuBLAS.

The seams a test replaces to run this module on the host (``tests/cublaslt_stand_in.py``):
``_binding`` (the binding module), ``_device_pointer`` (an array's address), ``_current_stream``
(the stream's handle), ``_device_id`` and ``_allocate_workspace``.
"""
import numpy as np

from ..core import backend, capture_checks
from .cublaslt_layouts import OP_N, describe, fold

WORKSPACE_BYTES = 32 * 2**20
# cudaDataType_t (library_types.h) and cublasComputeType_t (cublas_api.h) values.
CUDA_R_32F, CUDA_R_64F, CUDA_R_16F, CUDA_R_16BF = 0, 1, 2, 14
COMPUTE_32F, COMPUTE_64F = 68, 70
# dtype name -> (the operands' and result's data type, compute type, scale type)
TYPES = {"float16": (CUDA_R_16F, COMPUTE_32F, CUDA_R_32F),
         "bfloat16": (CUDA_R_16BF, COMPUTE_32F, CUDA_R_32F),
         "float32": (CUDA_R_32F, COMPUTE_32F, CUDA_R_32F),
         "float64": (CUDA_R_64F, COMPUTE_64F, CUDA_R_64F)}
SCALES = {CUDA_R_32F: np.float32, CUDA_R_64F: np.float64}
NEEDS_PLAN = ("its cuBLASLt plan is made on first use (on a device's first product its handle "
              "and workspace too), host work that a graph does not replay; run the step "
              "eagerly first (fleetmpi.graphed_step's warm-up steps do) so that every product "
              "it makes is planned before the capture")

_handles = {}  # device -> cuBLASLt handle
_workspaces = {}  # device -> the workspace array (kept alive with the process)
_plans = {}  # key (module docstring) -> Plan


def _binding():
    """The cuBLASLt binding module."""
    try:
        from nvmath.bindings import cublasLt
    except ImportError as error:
        raise ImportError(f"matrix products on a GPU run through cuBLASLt by nvmath-python, "
                          f"which does not import ({error}); pip install 'fleetmpi[gpu]' (CUDA "
                          f"12) or 'fleetmpi[gpu-cuda13]' installs it") from None
    return cublasLt


def _device_pointer(array):
    return array.data.ptr


def _current_stream():
    return backend.array_module().cuda.get_current_stream().ptr


def _device_id():
    return backend.array_module().cuda.Device().id


def _allocate_workspace(nbytes):
    return backend.array_module().empty(nbytes, dtype=np.uint8)


def _alignment(pointer):
    """The largest power of two up to 256 that divides ``pointer`` (cuBLASLt's preference)."""
    return min(256, pointer & -pointer) if pointer else 256


def _set(setter, dtype_of, target, attribute, value):
    """Set ``attribute`` of the descriptor ``target`` to ``value``, in the type the binding
    says the attribute has."""
    buffer = np.array([value], dtype=dtype_of(attribute))
    setter(target, attribute, buffer.ctypes.data, buffer.itemsize)


def _layout(lt, data_type, matrix, count):
    layout = lt.matrix_layout_create(data_type, matrix.rows, matrix.cols, matrix.ld)
    if count > 1:
        attributes = lt.MatrixLayoutAttribute
        for attribute, value in ((attributes.BATCH_COUNT, count),
                                 (attributes.STRIDED_BATCH_OFFSET, matrix.batch_stride)):
            _set(lt.matrix_layout_set_attribute, lt.get_matrix_layout_attribute_dtype, layout,
                 attribute, value)
    return layout


def _preference(lt, alignments):
    preference = lt.matmul_preference_create()
    names = lt.MatmulPreferenceAttribute
    values = [(names.MAX_WORKSPACE_BYTES, WORKSPACE_BYTES)] + list(zip(
        (names.MIN_ALIGNMENT_A_BYTES, names.MIN_ALIGNMENT_B_BYTES, names.MIN_ALIGNMENT_C_BYTES,
         names.MIN_ALIGNMENT_D_BYTES), alignments))
    for attribute, value in values:
        _set(lt.matmul_preference_set_attribute, lt.get_matmul_preference_attribute_dtype,
             preference, attribute, value)
    return preference


class Plan:
    """The cuBLASLt objects of one key (module docstring), made once."""

    def __init__(self, lt, handle, key, shapes, bias):
        _, data_type, compute, scale, first, second, result, count, alignments, fused = key
        self.desc = lt.matmul_desc_create(compute, scale)
        names = lt.MatmulDescAttribute
        self.bias = fused
        for attribute, value in ((names.TRANSA, first.op), (names.TRANSB, second.op)) + (
                ((names.EPILOGUE, lt.Epilogue.BIAS), (names.BIAS_POINTER, bias)) if fused
                else ()):
            self._set(lt, attribute, value)
        self.layouts = [_layout(lt, data_type, m, count) for m in (first, second, result)]
        self.preference = _preference(lt, alignments)
        self.heuristic = np.zeros(1, dtype=lt.matmul_heuristic_result_dtype)
        found = np.zeros(1, dtype=np.int32)
        lt.matmul_algo_get_heuristic(handle, self.desc, self.layouts[0], self.layouts[1],
                                     self.layouts[2], self.layouts[2], self.preference, 1,
                                     self.heuristic.ctypes.data, found.ctypes.data)
        if found[0] < 1:
            raise RuntimeError(f"cuBLASLt has no algorithm for the product {shapes} "
                               f"(cuBLASLt's A {first}, B {second}, D {result}, batch {count})")
        self.algorithm = self.heuristic.ctypes.data + self.heuristic.dtype.fields["algo"][1]
        self.alpha, self.beta = np.ones(1, SCALES[scale]), np.zeros(1, SCALES[scale])

    def _set(self, lt, attribute, value):
        _set(lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype, self.desc,
             attribute, value)

    def run(self, lt, handle, pointers, workspace, stream, bias=None):
        """``D = A B`` (``+ bias``, with the bias epilogue) on ``stream``; ``pointers``:
        cuBLASLt's ``A``, ``B`` and ``D``."""
        if self.bias:
            self._set(lt, lt.MatmulDescAttribute.BIAS_POINTER, bias)
        first, second, result = pointers
        a_layout, b_layout, d_layout = self.layouts
        lt.matmul(handle, self.desc, self.alpha.ctypes.data, first, a_layout, second, b_layout,
                  self.beta.ctypes.data, result, d_layout, result, d_layout, self.algorithm,
                  workspace, WORKSPACE_BYTES, stream)


def _handle(lt, device):
    """The device's handle, made (with its workspace) on its first plan."""
    if device not in _handles:
        _workspaces[device] = _allocate_workspace(WORKSPACE_BYTES)
        _handles[device] = lt.create()
    return _handles[device]


def _plan(key, shapes, bias):
    """The ``Plan`` of ``key``, made on first use; inside a capture a missing one is refused."""
    plan = _plans.get(key)
    if plan is None:
        capture_checks.refuse(f"planning the matrix product {shapes}", NEEDS_PLAN)
        lt = _binding()
        plan = _plans[key] = Plan(lt, _handle(lt, key[0]), key, shapes, bias)
    return plan


def _bias_pointer(bias, count, shape, dtype):
    """The address of ``bias`` where cuBLASLt's ``BIAS`` epilogue can add it, else None: one
    matrix (not a batch), a contiguous vector of the product's columns in its dtype, 16-byte
    aligned (the epilogue's kernels may load the bias 16 bytes at a time, and no alignment
    preference covers it: a parameter's view into a flat buffer need not be)."""
    if (bias is None or count != 1 or bias.shape != shape[-1:] or bias.dtype != dtype
            or bias.strides[0] != dtype.itemsize):
        return None
    pointer = _device_pointer(bias)
    return pointer if pointer % 16 == 0 else None


def _operand(array, lead, xp):
    """``(array, Matrix)``: ``array`` where it lies when cuBLASLt can read it so, else a copy
    (``cublaslt_layouts.py``)."""
    matrix = describe(array, lead)
    if matrix is None:
        array = xp.ascontiguousarray(array)
        matrix = describe(array, lead)
    if matrix is None:
        array = xp.ascontiguousarray(xp.broadcast_to(array, lead + array.shape[-2:]))
        matrix = describe(array, lead)
    return array, matrix


def _target(out, shape, dtype, xp):
    """``(array, Matrix, batch count)`` of what cuBLASLt writes the product into: ``out`` (or a
    new array) where it is row-major with its batch members apart, else a new array the caller
    copies into ``out``."""
    target = out if out is not None else xp.empty(shape, dtype)
    matrix = describe(target, shape[:-2])
    count = int(np.prod(shape[:-2], dtype=np.int64))
    if (matrix is None or matrix.op != OP_N
            or (count > 1 and matrix.batch_stride < matrix.ld * shape[-2])):
        target = xp.empty(shape, dtype)
        matrix = describe(target, shape[:-2])
    return target, matrix, count


def matmul(a, b, shape, dtype, out=None, bias=None):
    """``a @ b`` (``+ bias``) of CuPy arrays (``shape`` and ``dtype`` of the product, as
    ``products.matmul_arrays`` found them) into ``out`` or a new array (module docstring); the
    bias by the epilogue where ``_bias_pointer`` allows, else added after."""
    xp = backend.array_module()
    if dtype.name not in TYPES:
        result = xp.matmul(a, b, out=out)
        if bias is not None:
            result += bias
        return result
    described = f"{tuple(a.shape)} @ {tuple(b.shape)} ({dtype.name})"
    a, b = (x if x.dtype == dtype else x.astype(dtype) for x in (a, b))
    target, d, count = _target(out, shape, dtype, xp)
    fused = None
    if target.size == 0 or a.shape[-1] == 0:
        target[...] = 0
    else:
        lead, m = shape[:-2], shape[-2]
        (a, a_matrix), (b, b_matrix) = _operand(a, lead, xp), _operand(b, lead, xp)
        a_matrix, b_matrix, d, count = fold(a_matrix, b_matrix, d, count, m)
        pointers = tuple(_device_pointer(x) for x in (b, a, target))
        device = _device_id()
        fused = _bias_pointer(bias, count, shape, dtype)
        key = (device, *TYPES[dtype.name], b_matrix, a_matrix, d, count,
               tuple(_alignment(p) for p in pointers + pointers[-1:]), fused is not None)
        plan = _plan(key, described, fused)
        plan.run(_binding(), _handles[device], pointers, _device_pointer(_workspaces[device]),
                 _current_stream(), fused)
    if bias is not None and fused is None:
        target += bias
    if out is None or target is out:
        return target
    out[...] = target
    return out

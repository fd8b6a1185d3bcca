"""The trainer's one matrix product, ``fleetmpi.kernels.products.matmul_arrays``.

On NumPy it is NumPy's product, bit for bit, with and without ``out=``, except float16 and
bfloat16: the exact sum of their products rounded once, so the same bits in any order of the
sums and under each of OpenBLAS's kernels. Its GPU branch (``fleetmpi/kernels/cublaslt.py``)
runs here on the host against ``cublaslt_stand_in.py``, a stand-in for
``nvmath.bindings.cublasLt`` that reads and writes the operands at the addresses it is handed,
as the layouts declare: the branch must give NumPy's product for every transpose of either
operand, batches with broadcast, strided views and ``out=`` into a gradient buffer, hand views
over without copying them, make one plan per key and one workspace, run on the current stream,
add an aligned bias by the epilogue (another after), and, inside a CUDA graph capture, run what
was planned and refuse a product first met there, naming its shapes. The stand-in's names and
types are checked against nvmath-python's binding where it imports, and no module of the package
multiplies matrices behind ``matmul_arrays``'s back. ``TestOnTheGPU`` runs the real cuBLASLt on
a GPU.
"""
import ast
import inspect
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from fleetmpi import nn
from fleetmpi import kernels
from fleetmpi.core import backend, capture_checks
from fleetmpi.kernels import cublaslt
from fleetmpi.kernels.cublaslt_layouts import OP_N, OP_T
from fleetmpi.kernels.products import matmul_arrays

from cublaslt_stand_in import (INVALID_VALUE, NOT_SUPPORTED, STREAM, StandIn, cuBLASLtError,
                               install)


def _host_reference(a, b):
    """``a @ b`` as the host computes it: NumPy's product, except float16 and bfloat16, whose
    products are summed exactly (float64 holds these sums) and rounded once; here they are
    summed over the reversed inner axis, in another order than BLAS's."""
    if (a.dtype == b.dtype and a.dtype.itemsize == 2 and backend.is_floating(a.dtype)):
        terms = a.astype(np.float64)[..., :, ::-1, None] * b.astype(np.float64)[..., None, ::-1, :]
        return terms.sum(axis=-2).astype(a.dtype)
    return a @ b


def _dtypes():
    return [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16),
            backend.bfloat16()]


def _random(rng, shape, dtype, transposed=False):
    """A ``shape`` array of ``dtype``; ``transposed``: a view of a row-major array with its last
    two axes swapped (its columns contiguous)."""
    if transposed:
        shape = shape[:-2] + shape[:-3:-1]
    array = rng.standard_normal(shape).astype(dtype)
    return array.swapaxes(-1, -2) if transposed else array


SHAPES = [((5, 7), (7, 3)), ((2, 5, 7), (2, 7, 3)), ((4, 5, 7), (7, 3)), ((5, 7), (2, 7, 3)),
          ((2, 1, 5, 7), (3, 7, 3))]
TRANSPOSES = [(False, False), (True, False), (False, True), (True, True)]


@pytest.mark.parametrize("dtype", _dtypes(), ids=lambda d: d.name)
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
@pytest.mark.parametrize("transposes", TRANSPOSES, ids=str)
def test_the_host_product_is_the_reference_bit_for_bit(dtype, shapes, transposes):
    rng = np.random.default_rng(0)
    a, b = (_random(rng, s, dtype, t) for s, t in zip(shapes, transposes))
    want = _host_reference(a, b)
    got = matmul_arrays(a, b)
    assert got.dtype == want.dtype and np.array_equal(got, want)
    out = np.full(want.shape, np.nan, dtype=want.dtype)
    assert matmul_arrays(a, b, out=out) is out and np.array_equal(out, want)


# ``digests()``: hashes of float16 products of one ResNet-20 convolution step's shapes (im2col
# columns times the weight), each summed in float32 and then by ``matmul_arrays``.
KERNEL_CHECK = """
import hashlib, numpy as np
from fleetmpi.kernels.products import matmul_arrays

def digests():
    rng, found = np.random.default_rng(0), []
    for shape in ((2, 1024, 144, 16), (2, 64, 576, 64)):
        a = rng.standard_normal(shape[:3]).astype(np.float16)
        b = rng.standard_normal(shape[2:]).astype(np.float16)
        in_float32 = (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16)
        for product in (in_float32, matmul_arrays(a, b)):
            found.append(hashlib.sha256(product.tobytes()).hexdigest())
    return found
"""


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((set(line.split(":", 1)[1].split()) for line in cpuinfo
                         if line.startswith("flags")), set())
    except OSError:
        return set()


def test_a_half_precision_product_has_the_same_bits_under_each_openblas_kernel():
    """A float32 sum of float16 products depends on the order the CPU's OpenBLAS kernel (and
    its threads) sum in, and its float16 rounding with it; the host's product does not
    (``products.py``). This process's kernel (SkylakeX where the CPU has AVX-512) against
    Haswell's, forced in another process (``OPENBLAS_CORETYPE`` is read when OpenBLAS
    loads)."""
    if "avx2" not in _cpu_flags():
        pytest.skip("OpenBLAS's Haswell kernel needs AVX2")
    namespace = {}
    exec(KERNEL_CHECK, namespace)
    here = namespace["digests"]()
    env = dict(os.environ, OPENBLAS_CORETYPE="Haswell", FLEETMPI_DEVICE="cpu")
    haswell = subprocess.run([sys.executable, "-c", KERNEL_CHECK + "print(*digests())"],
                             env=env, check=True, capture_output=True, text=True).stdout.split()
    if here[0::2] == haswell[0::2]:
        pytest.skip("OpenBLAS sums these float32 products alike in both processes")
    assert here[1::2] == haswell[1::2]


def test_out_must_hold_the_product():
    a, b = np.ones((2, 3), np.float32), np.ones((3, 4), np.float32)
    with pytest.raises(ValueError, match=r"shape \(4, 2\) and dtype float32 cannot hold"):
        matmul_arrays(a, b, out=np.empty((4, 2), np.float32))
    with pytest.raises(ValueError, match="cannot multiply shapes"):
        matmul_arrays(a, a)


@pytest.fixture
def stand_in(monkeypatch):
    """The backend's GPU branch over NumPy with the stand-in cuBLASLt (``install``)."""
    monkeypatch.setattr(backend, "_xp", AlignedNumPy("numpy"))
    monkeypatch.setattr(backend, "on_gpu", lambda: True)
    monkeypatch.setattr(kernels, "_use_kernel", lambda *groups: None)
    return install(monkeypatch)


class AlignedNumPy(types.ModuleType):
    """NumPy whose ``empty`` is 256-byte aligned, as every allocation from CuPy's memory pool
    is (512): a plan is keyed by its pointers' alignment, which the host's ``malloc`` varies."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def empty(shape, dtype=float):
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        raw = np.empty(nbytes + 256, np.uint8)
        start = -raw.ctypes.data % 256
        return raw[start:start + nbytes].view(dtype).reshape(shape)


def _assert_product(got, a, b):
    """``got`` is ``a @ b`` as a GPU computes it: float32 sums, rounded once to the dtype."""
    dtype = got.dtype
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    tolerance = {"float64": 1e-12, "float32": 1e-5}.get(dtype.name, 1e-2)
    assert got.shape == want.shape
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tolerance, atol=tolerance)
    if dtype.itemsize == 2:  # a GPU sums in float32: the host's product to a float16 unit
        np.testing.assert_allclose(got.astype(np.float32),
                                   _host_reference(a, b).astype(np.float32), rtol=4e-3, atol=4e-3)


@pytest.mark.parametrize("dtype", _dtypes(), ids=lambda d: d.name)
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
@pytest.mark.parametrize("transposes", TRANSPOSES, ids=str)
def test_the_gpu_branch_gives_the_product_for_every_transpose_and_batch(stand_in, dtype, shapes,
                                                                        transposes):
    rng = np.random.default_rng(1)
    a, b = (_random(rng, s, dtype, t) for s, t in zip(shapes, transposes))
    got = matmul_arrays(a, b)
    assert got.dtype == dtype
    _assert_product(got, a, b)
    if dtype.itemsize == 2:  # the stand-in, too, rounds the exact sum
        assert np.array_equal(got, _host_reference(a, b))
    assert stand_in.count("matmul") == 1


@pytest.mark.parametrize("transposes", TRANSPOSES, ids=str)
def test_views_are_handed_over_where_they_lie(stand_in, transposes):
    """A transposed view is read in place with the transpose op: the stand-in gets the
    addresses of the arrays themselves (cuBLASLt's A is our b, its B our a)."""
    rng = np.random.default_rng(2)
    a, b = (_random(rng, s, np.float32, t) for s, t in zip(((6, 4), (4, 5)), transposes))
    got = matmul_arrays(a, b)
    _assert_product(got, a, b)
    execution, = stand_in.executions
    assert execution["pointers"] == (b.ctypes.data, a.ctypes.data, got.ctypes.data)
    desc = stand_in.objects[execution["desc"]][1]
    names = cublaslt._binding().MatmulDescAttribute
    assert (desc[names.TRANSA], desc[names.TRANSB]) == (int(transposes[1]), int(transposes[0]))


def test_strided_views_are_read_in_place_and_the_others_copied(stand_in):
    rng = np.random.default_rng(3)
    whole = rng.standard_normal((4, 10, 8)).astype(np.float32)
    key = whole[:, 2:7, :]           # rows 8 apart, members 80 apart: in place
    every_other = whole[0, ::2, :]   # rows 16 apart: in place
    stepped = whole[0, :, ::2]       # columns 2 apart: copied
    query = rng.standard_normal((4, 3, 8)).astype(np.float32)
    _assert_product(matmul_arrays(query, key.swapaxes(-1, -2)), query, key.swapaxes(-1, -2))
    _assert_product(matmul_arrays(every_other, query[0].T), every_other, query[0].T)
    _assert_product(matmul_arrays(stepped.T, stepped), stepped.T, stepped)
    pointers = [e["pointers"] for e in stand_in.executions]
    assert pointers[0][0] == key.ctypes.data and pointers[1][1] == every_other.ctypes.data
    assert stepped.ctypes.data not in pointers[2][:2]


def test_a_batch_times_one_weight_is_one_product(stand_in):
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((3, 4, 5)).astype(np.float32), rng.standard_normal((5, 6))
    got = matmul_arrays(x, w.astype(np.float32))
    _assert_product(got, x, w.astype(np.float32))
    assert [e["shape"] for e in stand_in.executions] == [(1, 6, 12)]


def test_out_is_written_in_place_as_a_gradient_buffer(stand_in):
    rng = np.random.default_rng(5)
    x, dz = rng.standard_normal((16, 5)).astype(np.float32), rng.standard_normal((16, 3))
    dz = dz.astype(np.float32)
    grad = np.zeros((5, 3), np.float32)
    assert matmul_arrays(x.T, dz, out=grad) is grad
    _assert_product(grad, x.T, dz)
    assert stand_in.executions[0]["pointers"][2] == grad.ctypes.data
    column_major = np.zeros((3, 5), np.float32).T   # not row-major: written through a copy
    assert matmul_arrays(x.T, dz, out=column_major) is column_major
    np.testing.assert_array_equal(column_major, grad)


def test_a_plan_is_made_once_per_key_and_the_workspace_once(stand_in):
    rng = np.random.default_rng(6)
    a, b = rng.standard_normal((6, 4)).astype(np.float32), rng.standard_normal((4, 5))
    b = b.astype(np.float32)
    for _ in range(3):
        _assert_product(matmul_arrays(a, b), a, b)
    assert (stand_in.count("matmul_desc_create"), stand_in.count("matmul")) == (1, 3)
    assert stand_in.count("matmul_algo_get_heuristic") == 1
    _assert_product(matmul_arrays(b.T, a.T), b.T, a.T)  # another key
    assert (stand_in.count("matmul_desc_create"), stand_in.count("matmul")) == (2, 4)
    assert stand_in.count("create") == 1
    workspace, = stand_in.workspaces
    assert workspace.nbytes == cublaslt.WORKSPACE_BYTES
    assert {e["workspace"] for e in stand_in.executions} == {
        (workspace.ctypes.data, cublaslt.WORKSPACE_BYTES)}


def test_each_product_runs_on_the_current_stream(stand_in, monkeypatch):
    a = np.ones((2, 3), np.float32)
    matmul_arrays(a, a.T)
    monkeypatch.setattr(cublaslt, "_current_stream", lambda: STREAM + 1)
    matmul_arrays(a, a.T)
    assert [e["stream"] for e in stand_in.executions] == [STREAM, STREAM + 1]
    assert stand_in.count("matmul_desc_create") == 1


def test_inside_a_capture_a_planned_product_runs_and_a_new_one_is_refused(stand_in):
    a, b = np.ones((3, 4), np.float32), np.ones((4, 5), np.float32)
    matmul_arrays(a, b)
    with capture_checks.capturing(object()):
        np.testing.assert_array_equal(matmul_arrays(a, b), np.full((3, 5), 4, np.float32))
        with pytest.raises(capture_checks.CaptureError,
                           match=r"planning the matrix product \(4, 5\) @ \(5, 4\) \(float32\) "
                                 r"cannot run inside a CUDA graph capture.*warm-up"):
            matmul_arrays(b, b.T)
    assert stand_in.count("matmul") == 2 and stand_in.count("matmul_desc_create") == 1


def test_the_first_product_inside_a_capture_allocates_nothing(stand_in):
    with capture_checks.capturing(object()):
        with pytest.raises(capture_checks.CaptureError):
            matmul_arrays(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32))
    assert stand_in.workspaces == [] and stand_in.calls == []


def test_a_model_trains_on_the_gpu_branch_as_on_the_host(stand_in, monkeypatch):
    """Linear's forward, its input gradient and its weight gradient into the parameter's
    gradient memory all run through cuBLASLt, and give the host's values."""
    from fleetmpi.autograd import Tensor

    def step():
        backend.manual_seed(7)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        x = Tensor(np.random.default_rng(8).standard_normal((2, 4, 6)).astype(np.float32))
        (model(x) ** 2).sum().backward()
        return [np.array(p.grad) for p in model.parameters()]
    on_gpu = step()
    products_run = stand_in.count("matmul")
    with monkeypatch.context() as host:
        host.setattr(backend, "on_gpu", lambda: False)
        on_host = step()
    assert products_run == 5 and stand_in.count("matmul") == 5
    for got, want in zip(on_gpu, on_host):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _layout(module, data_type, rows, cols, ld):
    return module.matrix_layout_create(data_type, rows, cols, ld)


def _heuristic(module, handle, desc, layouts, preference):
    results = np.zeros(1, module.matmul_heuristic_result_dtype)
    found = np.zeros(1, np.int32)
    module.matmul_algo_get_heuristic(handle, desc, *layouts, layouts[-1], preference, 1,
                                     results.ctypes.data, found.ctypes.data)
    return results, found[0]


def _set(setter, types_of, target, attribute, value):
    buffer = np.array([value], dtype=types_of(attribute))
    setter(target, attribute, buffer.ctypes.data, buffer.itemsize)


def _preference(module, alignment):
    """A preference for the product's workspace and pointers aligned to ``alignment`` bytes
    (None: the default, 256)."""
    preference = module.matmul_preference_create()
    names = module.MatmulPreferenceAttribute
    values = [(names.MAX_WORKSPACE_BYTES, cublaslt.WORKSPACE_BYTES)]
    if alignment is not None:
        values += [(getattr(names, f"MIN_ALIGNMENT_{x}_BYTES"), alignment) for x in "ABCD"]
    for attribute, value in values:
        _set(module.matmul_preference_set_attribute,
             module.get_matmul_preference_attribute_dtype, preference, attribute, value)
    return preference


def _product(module, a, b, ld, workspace_size=cublaslt.WORKSPACE_BYTES):
    """``a @ b`` (row-major float32) through the stand-in directly, as C^T = B^T A^T with the
    leading dimension ``ld`` declared for ``a`` and a workspace of ``workspace_size`` bytes."""
    m, (k, n) = a.shape[0], b.shape
    handle, desc = module.create(), module.matmul_desc_create(68, 0)
    layouts = [_layout(module, 0, n, k, n), _layout(module, 0, k, m, ld),
               _layout(module, 0, n, m, n)]
    results, found = _heuristic(module, handle, desc, layouts, _preference(module, 4))
    assert found == 1
    d = np.zeros((m, n), np.float32)
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    workspace = np.empty(workspace_size, np.uint8)
    module.matmul(handle, desc, one.ctypes.data, b.ctypes.data, layouts[0], a.ctypes.data,
                  layouts[1], zero.ctypes.data, d.ctypes.data, layouts[2], d.ctypes.data,
                  layouts[2], results.ctypes.data, workspace.ctypes.data, workspace.nbytes, 0)
    return d


def test_the_stand_in_reads_the_declared_layout():
    """A leading dimension one off reads other elements (a wrong product); one below the rows
    is refused, as cuBLASLt refuses it."""
    module = StandIn(algorithm_workspace=1024).module()
    a = np.arange(1, 13, dtype=np.float32).reshape(3, 4)
    b = np.arange(1, 9, dtype=np.float32).reshape(4, 2)
    np.testing.assert_array_equal(_product(module, a, b, ld=4), a @ b)
    wide = np.zeros((3, 5), np.float32)
    wide[:, :4] = a
    assert not np.array_equal(_product(module, wide, b, ld=4), a @ b)
    np.testing.assert_array_equal(_product(module, wide, b, ld=5), a @ b)
    with pytest.raises(cuBLASLtError, match="leading dimension 3 < rows 4") as refused:
        _product(module, a, b, ld=3)
    assert refused.value.status == INVALID_VALUE


def test_the_stand_in_refuses_what_cublaslt_refuses():
    library = StandIn(algorithm_workspace=1024)
    module = library.module()
    a, b = np.ones((3, 4), np.float32), np.ones((4, 2), np.float32)
    desc = module.matmul_desc_create(68, 0)
    wrong_size = np.array([1], np.int64)
    with pytest.raises(cuBLASLtError, match="takes 4 bytes, got 8"):
        module.matmul_desc_set_attribute(desc, module.MatmulDescAttribute.TRANSA,
                                         wrong_size.ctypes.data, 8)
    conjugate = np.array([2], np.int32)
    with pytest.raises(cuBLASLtError, match="is not a value it takes"):
        module.matmul_desc_set_attribute(desc, module.MatmulDescAttribute.TRANSB,
                                         conjugate.ctypes.data, 4)
    for bad in (lambda: module.matmul_desc_create(77 + 1, 0),
                lambda: module.matrix_layout_create(99, 2, 2, 2)):
        with pytest.raises(cuBLASLtError) as refused:
            bad()
        assert refused.value.status == INVALID_VALUE
    with pytest.raises(cuBLASLtError, match="the algorithm asked for 1024") as refused:
        _product(module, a, b, ld=4, workspace_size=512)
    assert refused.value.status == INVALID_VALUE
    with pytest.raises(cuBLASLtError, match="less aligned") as refused:
        _misaligned_product(module)
    assert refused.value.status == NOT_SUPPORTED


def _misaligned_product(module):
    """A product whose A pointer is 4 bytes past the 256 the preference promised by default."""
    handle, desc = module.create(), module.matmul_desc_create(68, 0)
    layouts = [_layout(module, 0, 2, 2, 2) for _ in range(3)]
    results, _ = _heuristic(module, handle, desc, layouts, _preference(module, None))
    memory = AlignedNumPy("numpy").empty(64, np.float32)
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    workspace = np.empty(1 << 20, np.uint8)
    pointer = memory.ctypes.data
    module.matmul(handle, desc, one.ctypes.data, pointer + 4, layouts[0], pointer + 256,
                  layouts[1], zero.ctypes.data, pointer + 512, layouts[2], pointer + 512,
                  layouts[2], results.ctypes.data, workspace.ctypes.data, workspace.nbytes, 0)


# The files that may multiply matrices themselves, and why; every other product calls
# matmul_arrays, which a CUDA graph can capture on a GPU.
OWN_PRODUCTS = {
    "fleetmpi/kernels/products.py": "matmul_arrays itself: the host product",
    "fleetmpi/kernels/cublaslt.py": "the cuBLASLt call, and CuPy's own kernel for integers",
    "fleetmpi/kernels/reference.py": "the non-finite probe, on host arrays only",
    "fleetmpi/nn/functional/norm.py": "channel_dot's einsum, on the host branch only",
    "fleetmpi/plan/calibrate.py": "the planner's least-squares fits, on the host",
}
PRODUCT_CALLS = {"matmul", "tensordot", "einsum", "dot", "vdot", "inner"}


def _own_products(path):
    """``[(line, what)]`` of each product ``path`` computes itself: ``@`` or a call of a
    ``matmul``/``tensordot``/``einsum``/``dot``/``vdot``/``inner`` attribute."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.BinOp, ast.AugAssign)) and isinstance(node.op, ast.MatMult):
            found.append((node.lineno, "@"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in PRODUCT_CALLS):
            found.append((node.lineno, ast.unparse(node.func)))
    return found


def test_every_product_of_the_package_calls_matmul_arrays():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    wrong = []
    for folder in ("fleetmpi", "comm", "strategies"):
        for directory, _, files in os.walk(os.path.join(root, folder)):
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(directory, name)
                relative = os.path.relpath(path, root).replace(os.sep, "/")
                if relative not in OWN_PRODUCTS:
                    wrong += [f"{relative}:{line} {what}" for line, what in _own_products(path)]
    assert not wrong, "products that bypass matmul_arrays:\n" + "\n".join(wrong)
    # the scan sees the products it is meant to: the allowed ones are found
    assert _own_products(os.path.join(root, "fleetmpi/kernels/reference.py"))


STAND_IN_CALLS = ("create", "matmul_desc_create", "matmul_desc_set_attribute",
                  "matrix_layout_create", "matrix_layout_set_attribute",
                  "matmul_preference_create", "matmul_preference_set_attribute",
                  "matmul_algo_get_heuristic", "matmul")


def test_the_stand_in_and_the_codes_are_the_bindings():
    """Where nvmath-python imports (it does without a GPU), the stand-in's enums, attribute
    types, heuristic record and argument counts are the real binding's, and the type codes
    ``cublaslt.py`` hands over are nvmath's."""
    real = pytest.importorskip("nvmath.bindings.cublasLt")
    import nvmath
    from nvmath.bindings import cublas
    stand_in = StandIn().module()
    for name, types_of in (("MatrixLayoutAttribute", "get_matrix_layout_attribute_dtype"),
                           ("MatmulDescAttribute", "get_matmul_desc_attribute_dtype"),
                           ("MatmulPreferenceAttribute", "get_matmul_preference_attribute_dtype"),
                           ("Epilogue", None)):
        for member in getattr(stand_in, name):
            assert int(getattr(getattr(real, name), member.name)) == int(member), member
            if types_of is not None:
                assert (np.dtype(getattr(real, types_of)(member))
                        == np.dtype(getattr(stand_in, types_of)(member))), member
    assert real.matmul_heuristic_result_dtype == stand_in.matmul_heuristic_result_dtype
    for name in STAND_IN_CALLS:
        want = len(inspect.signature(getattr(real, name)).parameters)
        assert len(inspect.signature(getattr(StandIn, name)).parameters) - 1 == want, name
    codes = nvmath.CudaDataType
    assert ((cublaslt.CUDA_R_32F, cublaslt.CUDA_R_64F, cublaslt.CUDA_R_16F, cublaslt.CUDA_R_16BF)
            == (codes.CUDA_R_32F, codes.CUDA_R_64F, codes.CUDA_R_16F, codes.CUDA_R_16BF))
    assert (cublaslt.COMPUTE_32F, cublaslt.COMPUTE_64F) == (cublas.ComputeType.COMPUTE_32F,
                                                           cublas.ComputeType.COMPUTE_64F)
    assert (OP_N, OP_T) == (cublas.Operation.N, cublas.Operation.T)


def _on_device(cupy, host):
    """``host`` on the device, a transposed view staying one (of a row-major copy)."""
    if host.flags.c_contiguous:
        return cupy.asarray(host)
    return cupy.asarray(np.ascontiguousarray(host.swapaxes(-1, -2))).swapaxes(-1, -2)


@pytest.mark.skipif(not backend.on_gpu(), reason="needs CuPy, a CUDA device and nvmath-python "
                                                  "(FLEETMPI_DEVICE=gpu)")
class TestOnTheGPU:
    """The real cuBLASLt (the prepared GPU command, ``benchmarks/gpu_check.py``, runs this file
    with ``FLEETMPI_DEVICE=gpu``)."""

    @pytest.mark.parametrize("dtype", _dtypes(), ids=lambda d: d.name)
    @pytest.mark.parametrize("shapes", SHAPES, ids=str)
    @pytest.mark.parametrize("transposes", TRANSPOSES, ids=str)
    def test_products_equal_the_host_product(self, dtype, shapes, transposes):
        cupy = backend.array_module()
        rng = np.random.default_rng(9)
        hosts = [_random(rng, s, dtype, t) for s, t in zip(shapes, transposes)]
        got = matmul_arrays(*(_on_device(cupy, h) for h in hosts))
        _assert_product(backend.to_numpy(got), *hosts)

    def test_a_planned_product_is_captured_and_replays_on_new_inputs(self):
        from fleetmpi.device.cuda.graphs import CUDAGraph

        cupy = backend.array_module()
        rng = np.random.default_rng(10)
        a, b = (rng.standard_normal(s).astype(np.float32) for s in ((64, 32), (48, 32)))
        x, w = cupy.asarray(a), cupy.asarray(b)
        matmul_arrays(x, w.T)  # the warm-up makes the plan
        graph = CUDAGraph()
        graph.capture_begin()
        try:
            y = matmul_arrays(x, w.T)
            with pytest.raises(capture_checks.CaptureError, match=r"\(64, 32\) @ \(32, 64\)"):
                matmul_arrays(x, x.T)
        finally:
            graph.capture_end()
        a = rng.standard_normal(a.shape).astype(np.float32)
        x[...] = cupy.asarray(a)
        graph.replay()
        _assert_product(backend.to_numpy(y), a, b.T)


@pytest.mark.parametrize("dtype", _dtypes(), ids=lambda d: d.name)
def test_a_bias_is_added_as_linear_added_it(dtype):
    rng = np.random.default_rng(11)
    x, w, bias = (rng.standard_normal(s).astype(dtype) for s in ((2, 5, 7), (7, 3), (3,)))
    want = _host_reference(x, w)
    want += bias
    got = matmul_arrays(x, w, bias=bias)
    assert got.dtype == want.dtype and np.array_equal(got, want)


def test_an_aligned_bias_is_added_by_the_epilogue_and_another_after(stand_in):
    rng = np.random.default_rng(12)
    x, w = rng.standard_normal((2, 5, 7)).astype(np.float32), rng.standard_normal((7, 3))
    w = w.astype(np.float32)
    memory = AlignedNumPy("numpy").empty(8, np.float32)
    memory[:] = rng.standard_normal(8)
    aligned, misaligned = memory[:3], memory[1:4]
    for bias in (aligned, misaligned):
        got = matmul_arrays(x, w, bias=bias)
        np.testing.assert_allclose(got, x @ w + bias, rtol=1e-5, atol=1e-5)
    plans = stand_in.count("matmul_desc_create")
    other = AlignedNumPy("numpy").empty(3, np.float32)
    other[:] = -aligned
    np.testing.assert_allclose(matmul_arrays(x, w, bias=other), x @ w - aligned, rtol=1e-5,
                               atol=1e-5)
    assert stand_in.count("matmul_desc_create") == plans  # the bias's plan, another bias
    batched = matmul_arrays(x.swapaxes(-1, -2).copy().swapaxes(-1, -2), w, bias=aligned)
    np.testing.assert_allclose(batched, x @ w + aligned, rtol=1e-5, atol=1e-5)
    names = cublaslt._binding()
    epilogues = [stand_in.objects[e["desc"]][1][names.MatmulDescAttribute.EPILOGUE]
                 for e in stand_in.executions]
    assert epilogues == [names.Epilogue.BIAS, names.Epilogue.DEFAULT, names.Epilogue.BIAS,
                         names.Epilogue.DEFAULT]

"""A stand-in for NVIDIA's cuBLASLt binding (``nvmath.bindings.cublasLt`` of nvmath-python 1.0)
in NumPy, for the tests of ``fleetmpi/kernels/cublaslt.py`` on the host.

``StandIn().module()`` has the binding's names, enums and argument orders for the calls fleetmpi
makes: ``create``; ``matmul_desc_create(compute_type, scale_type)``;
``matrix_layout_create(type, rows, cols, ld)``; ``matmul_preference_create()``; the
``*_set_attribute(target, attribute, buffer address, size)`` of all three with the
``get_*_attribute_dtype`` helpers; ``matmul_algo_get_heuristic`` writing
``matmul_heuristic_result_dtype`` records; and ``matmul(handle, desc, alpha, A, Adesc, B,
Bdesc, beta, C, Cdesc, D, Ddesc, algo, workspace, workspace size, stream)``. Attribute values,
``alpha``, ``beta`` and the algorithm are read from the addresses handed over.

It interprets the descriptors as cuBLASLt does: each layout is a column-major matrix of
``rows x cols`` with leading dimension ``ld`` (element ``(i, j)`` at ``i + j * ld``), a batch
of ``BATCH_COUNT`` of them ``STRIDED_BATCH_OFFSET`` elements apart; ``TRANSA``/``TRANSB``
transpose ``A``/``B`` before ``D = alpha op(A) op(B) + beta C``; the operands are read from
their raw addresses (host memory here) as those layouts declare and the result is written at
``D``'s. Float16 and bfloat16 operands are summed exactly (in float64) and rounded once: what
``CUBLAS_COMPUTE_32F``'s float32 sums give to a float16 unit, in the bits of the host's product
(``fleetmpi/kernels/products.py``), whatever order either sums in; float32 is summed in float32,
float64 in float64. So a wrong layout, leading dimension or op gives a wrong product.

It refuses, raising ``cuBLASLtError`` with cuBLAS's status, what the library refuses: an
attribute value of the wrong size, an unknown enum, a layout whose leading dimension is less
than its rows, operands whose shapes, types or batch counts do not fit together, an algorithm
used for a problem it was not found for, a workspace smaller than the algorithm asked, a
pointer less aligned than the preference promised. ``calls`` records every call by name,
``executions`` each product run with the stream it ran on.
"""
import ctypes
import enum
import itertools
import types

import numpy as np

try:
    import ml_dtypes
except ImportError:  # bfloat16 products are then not run
    ml_dtypes = None

INVALID_VALUE, NOT_SUPPORTED = 7, 15  # cublasStatus_t
STATUS_NAMES = {INVALID_VALUE: "CUBLAS_STATUS_INVALID_VALUE",
                NOT_SUPPORTED: "CUBLAS_STATUS_NOT_SUPPORTED"}
# cudaDataType_t -> NumPy dtype
DATA_TYPES = {0: np.dtype(np.float32), 1: np.dtype(np.float64), 2: np.dtype(np.float16)}
if ml_dtypes is not None:
    DATA_TYPES[14] = np.dtype(ml_dtypes.bfloat16)
COMPUTE_32F, COMPUTE_64F = 68, 70
# (compute type, scale type) -> the data type of A, B, C and D it computes, and in what
COMBINATIONS = {(COMPUTE_32F, 0): ({0, 2, 14}, np.float32), (COMPUTE_64F, 1): ({1}, np.float64)}
OP_N, OP_T = 0, 1


class cuBLASLtError(Exception):
    def __init__(self, status, why):
        self.status = status
        super().__init__(f"{STATUS_NAMES[status]} ({status}): {why}")


class MatrixLayoutAttribute(enum.IntEnum):
    TYPE, ORDER, ROWS, COLS, LD, BATCH_COUNT, STRIDED_BATCH_OFFSET = range(7)


class MatmulDescAttribute(enum.IntEnum):
    COMPUTE_TYPE, SCALE_TYPE, POINTER_MODE, TRANSA, TRANSB, TRANSC = range(6)
    EPILOGUE, BIAS_POINTER, BIAS_DATA_TYPE = 7, 8, 26


class MatmulPreferenceAttribute(enum.IntEnum):
    SEARCH_MODE, MAX_WORKSPACE_BYTES = 0, 1
    MIN_ALIGNMENT_A_BYTES, MIN_ALIGNMENT_B_BYTES = 5, 6
    MIN_ALIGNMENT_C_BYTES, MIN_ALIGNMENT_D_BYTES = 7, 8


class Epilogue(enum.IntEnum):
    DEFAULT, BIAS = 1, 4


LAYOUT_TYPES = {MatrixLayoutAttribute.TYPE: np.uint32, MatrixLayoutAttribute.ORDER: np.int32,
                MatrixLayoutAttribute.ROWS: np.uint64, MatrixLayoutAttribute.COLS: np.uint64,
                MatrixLayoutAttribute.LD: np.int64, MatrixLayoutAttribute.BATCH_COUNT: np.int32,
                MatrixLayoutAttribute.STRIDED_BATCH_OFFSET: np.int64}
DESC_TYPES = {MatmulDescAttribute.COMPUTE_TYPE: np.int32,
              MatmulDescAttribute.SCALE_TYPE: np.int32,
              MatmulDescAttribute.POINTER_MODE: np.int32, MatmulDescAttribute.TRANSA: np.int32,
              MatmulDescAttribute.TRANSB: np.int32, MatmulDescAttribute.TRANSC: np.int32,
              MatmulDescAttribute.EPILOGUE: np.uint32,
              MatmulDescAttribute.BIAS_POINTER: np.intp,
              MatmulDescAttribute.BIAS_DATA_TYPE: np.int32}
PREFERENCE_TYPES = {MatmulPreferenceAttribute.SEARCH_MODE: np.uint32,
                    MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES: np.uint64,
                    **{a: np.uint32 for a in list(MatmulPreferenceAttribute)[2:]}}
# cublasLtMatmulHeuristicResult_t
HEURISTIC_RESULT = np.dtype([("algo", [("data_", np.uint64, (8,))]), ("workspace_size", np.uint64),
                             ("state", np.int32), ("waves_count", np.float32),
                             ("reserved", np.int32, (4,))])
ALGO_MAGIC = 0x5354414e44494e  # marks the algorithms this stand-in handed out


def _check(condition, status, why):
    if not condition:
        raise cuBLASLtError(status, why)


def _read(address, dtype, count=1):
    """``count`` values of ``dtype`` at the host ``address``."""
    size = np.dtype(dtype).itemsize * count
    return np.frombuffer((ctypes.c_char * size).from_address(address), dtype=dtype, count=count)


def _alignment(pointer):
    return min(256, pointer & -pointer) if pointer else 256


class Layout:
    """A ``cublasLtMatrixLayout_t``: column-major, one matrix unless a batch is set."""

    def __init__(self, data_type, rows, cols, ld):
        _check(data_type in DATA_TYPES, INVALID_VALUE, f"unknown cudaDataType {data_type}")
        self.values = {MatrixLayoutAttribute.TYPE: data_type, MatrixLayoutAttribute.ORDER: 0,
                       MatrixLayoutAttribute.ROWS: rows, MatrixLayoutAttribute.COLS: cols,
                       MatrixLayoutAttribute.LD: ld, MatrixLayoutAttribute.BATCH_COUNT: 1,
                       MatrixLayoutAttribute.STRIDED_BATCH_OFFSET: 0}

    def __getattr__(self, name):
        return self.__dict__["values"][MatrixLayoutAttribute[name.upper()]]

    def check(self, what):
        _check(self.order == 0, NOT_SUPPORTED, f"{what}: only column-major order is interpreted")
        _check(self.ld >= max(1, self.rows), INVALID_VALUE,
               f"{what}: leading dimension {self.ld} < rows {self.rows}")
        _check(self.batch_count >= 1, INVALID_VALUE, f"{what}: batch count {self.batch_count}")

    def matrices(self, address):
        """The batch at ``address`` as a ``(count, rows, cols)`` view (writable)."""
        item = DATA_TYPES[self.type].itemsize
        stride = self.strided_batch_offset if self.batch_count > 1 else 0
        span = ((self.batch_count - 1) * stride + (self.cols - 1) * self.ld + self.rows) * item
        memory = (ctypes.c_char * span).from_address(address)
        view = np.ndarray((self.batch_count, self.cols, self.rows), DATA_TYPES[self.type],
                          memory, strides=(stride * item, self.ld * item, item))
        return view.transpose(0, 2, 1)


class Desc:
    """A ``cublasLtMatmulDesc_t``."""

    def __init__(self, compute_type, scale_type):
        _check((compute_type, scale_type) in COMBINATIONS, INVALID_VALUE,
               f"compute type {compute_type} with scale type {scale_type}")
        self.values = {MatmulDescAttribute.COMPUTE_TYPE: compute_type,
                       MatmulDescAttribute.SCALE_TYPE: scale_type,
                       MatmulDescAttribute.POINTER_MODE: 0, MatmulDescAttribute.TRANSA: OP_N,
                       MatmulDescAttribute.TRANSB: OP_N, MatmulDescAttribute.TRANSC: OP_N,
                       MatmulDescAttribute.EPILOGUE: Epilogue.DEFAULT,
                       MatmulDescAttribute.BIAS_POINTER: 0,
                       MatmulDescAttribute.BIAS_DATA_TYPE: -1}

    def __getitem__(self, attribute):
        return self.values[attribute]


def _set_attribute(table, target, attribute, buffer, size, allowed=None):
    _check(attribute in table, INVALID_VALUE, f"unknown attribute {attribute}")
    expected = np.dtype(table[attribute]).itemsize
    _check(size == expected, INVALID_VALUE,
           f"attribute {table_name(table)}.{attribute} takes {expected} bytes, got {size}")
    value = _read(buffer, table[attribute])[0].item()
    if allowed is not None:
        _check(value in allowed.get(attribute, (value,)), INVALID_VALUE,
               f"{attribute} = {value} is not a value it takes")
    target.values[type(next(iter(table)))(attribute)] = value


def table_name(table):
    return type(next(iter(table))).__name__


def _op(matrices, op):
    return matrices if op == OP_N else matrices.swapaxes(-1, -2)


class StandIn:
    """The stand-in library's state: its objects by handle, what it records, and the workspace
    each algorithm asks for (``algorithm_workspace`` bytes)."""

    def __init__(self, algorithm_workspace=4 << 20):
        self.algorithm_workspace = algorithm_workspace
        self.objects, self.algorithms = {}, []
        self.calls, self.executions = [], []
        self._ids = itertools.count(0x1000, 0x10)

    def _new(self, kind, value):
        handle = next(self._ids)
        self.objects[handle] = (kind, value)
        return handle

    def _get(self, kind, handle):
        entry = self.objects.get(handle)
        _check(entry is not None and entry[0] == kind, INVALID_VALUE,
               f"{handle:#x} is not a {kind}")
        return entry[1]

    def count(self, name):
        return sum(1 for call in self.calls if call[0] == name)

    def module(self):
        """The stand-in as the module ``nvmath.bindings.cublasLt``."""
        module = types.ModuleType("nvmath.bindings.cublasLt")
        module.cuBLASLtError = cuBLASLtError
        module.MatrixLayoutAttribute = MatrixLayoutAttribute
        module.MatmulDescAttribute = MatmulDescAttribute
        module.MatmulPreferenceAttribute = MatmulPreferenceAttribute
        module.Epilogue = Epilogue
        module.matmul_heuristic_result_dtype = HEURISTIC_RESULT
        module.get_matrix_layout_attribute_dtype = LAYOUT_TYPES.__getitem__
        module.get_matmul_desc_attribute_dtype = DESC_TYPES.__getitem__
        module.get_matmul_preference_attribute_dtype = PREFERENCE_TYPES.__getitem__
        for name in ("create", "matmul_desc_create", "matmul_desc_set_attribute",
                     "matrix_layout_create", "matrix_layout_set_attribute",
                     "matmul_preference_create", "matmul_preference_set_attribute",
                     "matmul_algo_get_heuristic", "matmul"):
            setattr(module, name, self._recorded(name))
        return module

    def _recorded(self, name):
        def call(*args):
            self.calls.append((name,) + args)
            return getattr(self, name)(*args)
        call.__name__ = name
        return call

    def create(self):
        return self._new("handle", None)

    def matmul_desc_create(self, compute_type, scale_type):
        return self._new("desc", Desc(compute_type, scale_type))

    def matmul_desc_set_attribute(self, desc, attribute, buffer, size):
        names = MatmulDescAttribute
        allowed = {names.TRANSA: (OP_N, OP_T), names.TRANSB: (OP_N, OP_T), names.TRANSC: (OP_N,),
                   names.POINTER_MODE: (0,), names.EPILOGUE: tuple(Epilogue)}
        _set_attribute(DESC_TYPES, self._get("desc", desc), attribute, buffer, size, allowed)

    def matrix_layout_create(self, data_type, rows, cols, ld):
        return self._new("layout", Layout(data_type, rows, cols, ld))

    def matrix_layout_set_attribute(self, layout, attribute, buffer, size):
        _set_attribute(LAYOUT_TYPES, self._get("layout", layout), attribute, buffer, size,
                       {MatrixLayoutAttribute.ORDER: (0, 1), MatrixLayoutAttribute.TYPE:
                        tuple(DATA_TYPES)})

    def matmul_preference_create(self):
        preference = types.SimpleNamespace(values={a: 0 for a in MatmulPreferenceAttribute})
        preference.values.update({a: 256 for a in list(MatmulPreferenceAttribute)[2:]})
        return self._new("preference", preference)

    def matmul_preference_set_attribute(self, preference, attribute, buffer, size):
        _set_attribute(PREFERENCE_TYPES, self._get("preference", preference), attribute,
                       buffer, size)

    def _problem(self, desc, layouts):
        """The compute dtype of ``D = op(A) op(B) + C`` with these descriptors, or the refusal
        of a problem that does not fit together."""
        for name, layout in zip("ABCD", layouts):
            layout.check(name)
        a, b, c, d = layouts
        accepted, compute = COMBINATIONS[(desc[MatmulDescAttribute.COMPUTE_TYPE],
                                          desc[MatmulDescAttribute.SCALE_TYPE])]
        kinds = {layout.type for layout in layouts}
        _check(len(kinds) == 1 and kinds <= accepted, NOT_SUPPORTED,
               f"data types {sorted(kinds)} with compute type "
               f"{desc[MatmulDescAttribute.COMPUTE_TYPE]}")
        _check(desc[MatmulDescAttribute.EPILOGUE] == Epilogue.DEFAULT or (
            desc[MatmulDescAttribute.BIAS_DATA_TYPE] == -1 and d.batch_count == 1),
            NOT_SUPPORTED, "this stand-in interprets the bias epilogue of one matrix, its bias "
            "of D's type")
        m, k = (a.rows, a.cols) if desc[MatmulDescAttribute.TRANSA] == OP_N else (a.cols, a.rows)
        k2, n = (b.rows, b.cols) if desc[MatmulDescAttribute.TRANSB] == OP_N else (b.cols, b.rows)
        _check(k == k2, INVALID_VALUE, f"op(A) is {m}x{k} but op(B) is {k2}x{n}")
        for name, layout in (("C", c), ("D", d)):
            _check((layout.rows, layout.cols) == (m, n), INVALID_VALUE,
                   f"{name} is {layout.rows}x{layout.cols}, the product {m}x{n}")
        counts = {layout.batch_count for layout in layouts}
        _check(len(counts) == 1, INVALID_VALUE, f"batch counts {sorted(counts)} differ")
        _check(d.batch_count == 1 or d.strided_batch_offset >= d.ld * d.cols, INVALID_VALUE,
               f"D's batch members overlap (stride {d.strided_batch_offset})")
        return compute

    def matmul_algo_get_heuristic(self, handle, desc, adesc, bdesc, cdesc, ddesc, preference,
                                  requested, results, count):
        self._get("handle", handle)
        layouts = [self._get("layout", x) for x in (adesc, bdesc, cdesc, ddesc)]
        self._problem(self._get("desc", desc), layouts)
        values = self._get("preference", preference).values
        _check(requested >= 1, INVALID_VALUE, f"requested {requested} algorithms")
        found = _writable(count, np.int32, 1)
        if values[MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES] < self.algorithm_workspace:
            found[0] = 0
            return
        record = _writable(results, HEURISTIC_RESULT, 1)
        record[0] = np.zeros((), HEURISTIC_RESULT)
        record["algo"]["data_"][0, :2] = (ALGO_MAGIC, len(self.algorithms))
        record["workspace_size"][0] = self.algorithm_workspace
        self.algorithms.append({"problem": (desc, adesc, bdesc, cdesc, ddesc),
                                "workspace": self.algorithm_workspace,
                                "alignments": [values[a] for a in list(
                                    MatmulPreferenceAttribute)[2:]]})
        found[0] = 1

    def _algorithm(self, algo, problem, workspace, workspace_size, pointers):
        """The algorithm at the address ``algo``, checked against how it is used."""
        words = _read(algo, np.uint64, 8)
        _check(words[0] == ALGO_MAGIC and words[1] < len(self.algorithms), INVALID_VALUE,
               "not an algorithm the heuristic returned")
        found = self.algorithms[int(words[1])]
        _check(found["problem"] == problem, INVALID_VALUE,
               "the algorithm was found for another problem")
        _check(workspace_size >= found["workspace"] and (workspace or not found["workspace"]),
               INVALID_VALUE, f"a workspace of {workspace_size} bytes at {workspace:#x}; the "
               f"algorithm asked for {found['workspace']}")
        for name, pointer, needed in zip("ABCD", pointers, found["alignments"]):
            _check(_alignment(pointer) >= needed, NOT_SUPPORTED,
                   f"{name} at {pointer:#x} is less aligned than the {needed} bytes promised")
        return int(words[1])

    def matmul(self, handle, desc, alpha, a, adesc, b, bdesc, beta, c, cdesc, d, ddesc, algo,
               workspace, workspace_size, stream):
        self._get("handle", handle)
        description = self._get("desc", desc)
        layouts = [self._get("layout", x) for x in (adesc, bdesc, cdesc, ddesc)]
        compute = self._problem(description, layouts)
        index = self._algorithm(algo, (desc, adesc, bdesc, cdesc, ddesc), workspace,
                                workspace_size, (a, b, c, d))
        _check(c != d or cdesc == ddesc, INVALID_VALUE, "C is D but Cdesc is not Ddesc")
        scale = COMBINATIONS[(description[MatmulDescAttribute.COMPUTE_TYPE],
                              description[MatmulDescAttribute.SCALE_TYPE])][1]
        alpha, beta = _read(alpha, scale)[0], _read(beta, scale)[0]
        first = _op(layouts[0].matrices(a), description[MatmulDescAttribute.TRANSA])
        second = _op(layouts[1].matrices(b), description[MatmulDescAttribute.TRANSB])
        exact = np.float64 if first.dtype.itemsize == 2 else compute
        result = alpha * np.matmul(first.astype(exact), second.astype(exact))
        if beta != 0:
            result += beta * layouts[2].matrices(c).astype(compute)
        if description[MatmulDescAttribute.EPILOGUE] == Epilogue.BIAS:
            result += _bias(description, layouts[3]).astype(compute)[:, None]
        target = layouts[3].matrices(d)
        target[...] = result.astype(target.dtype)
        self.executions.append({"desc": desc, "algorithm": index, "stream": stream,
                                "shape": tuple(result.shape), "pointers": (a, b, d),
                                "workspace": (workspace, workspace_size)})


def _bias(desc, layout):
    """The bias vector of the ``BIAS`` epilogue: one value of D's type per row of D, at the
    descriptor's ``BIAS_POINTER``. cuBLASLt's kernels may load it 16 bytes at a time, and a
    less aligned bias faults there ("misaligned address"), which no alignment preference
    covers; the stand-in refuses it."""
    pointer = desc[MatmulDescAttribute.BIAS_POINTER]
    _check(pointer != 0, INVALID_VALUE, "the BIAS epilogue without a BIAS_POINTER")
    _check(pointer % 16 == 0, NOT_SUPPORTED, f"misaligned address: a bias at {pointer:#x}")
    return _read(pointer, DATA_TYPES[layout.type], layout.rows)


def _writable(address, dtype, count):
    size = np.dtype(dtype).itemsize * count
    return np.ndarray(count, dtype, (ctypes.c_char * size).from_address(address))


STREAM = 0x5EED  # the handle of the stream products run on, by default


def install(monkeypatch, library=None):
    """Route ``fleetmpi/kernels/cublaslt.py`` to ``library`` (a new ``StandIn`` by default)
    through its seams: the binding, host addresses for device pointers, the stream ``STREAM``,
    device 0, workspaces from NumPy (listed in ``library.workspaces``), and no plan, handle or
    workspace made yet. Returns the library."""
    from fleetmpi.kernels import cublaslt

    library = StandIn() if library is None else library
    module = library.module()
    library.workspaces = []

    def allocate(nbytes):
        library.workspaces.append(np.empty(nbytes, np.uint8))
        return library.workspaces[-1]
    for name, value in (("_binding", lambda: module),
                        ("_device_pointer", lambda array: array.ctypes.data),
                        ("_current_stream", lambda: STREAM), ("_device_id", lambda: 0),
                        ("_allocate_workspace", allocate), ("_plans", {}), ("_handles", {}),
                        ("_workspaces", {})):
        monkeypatch.setattr(cublaslt, name, value)
    return library


def install_on_cupy_stand_in(monkeypatch, library=None):
    """Route ``fleetmpi/kernels/cublaslt.py`` to ``library`` (a new ``StandIn`` by default)
    where the CuPy stand-in (``tests/cupy_stand_in``) is the array module: the module's own
    seams then read the stand-in's device addresses, current stream and device, and take the
    workspace from its pool; each ``cublasLtMatmul`` is queued on the current stream
    (``cupy_stand_in.library_call``) with its descriptor's attributes as they were at the call,
    so that a capture records it and its graph replays it, as a GPU does. Returns the
    library."""
    from cupy_stand_in import library_call
    from fleetmpi.kernels import cublaslt

    library = StandIn() if library is None else library
    module = library.module()
    run = module.matmul

    def queued(*args):
        # cuBLASLt reads the descriptor's attributes (the bias pointer) when it is called: a
        # capture keeps them, whatever later calls set on the descriptor of the same plan
        desc = library._get("desc", args[1])
        values = dict(desc.values)

        def run_as_called():
            current, desc.values = desc.values, values
            try:
                run(*args)
            finally:
                desc.values = current
        library_call("cublasLt", "matmul", run_as_called)
    module.matmul = queued
    for name, value in (("_binding", lambda: module), ("_plans", {}), ("_handles", {}),
                        ("_workspaces", {})):
        monkeypatch.setattr(cublaslt, name, value)
    return library

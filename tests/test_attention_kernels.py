"""Attention without the ``(seq, seq)`` scores in memory (``fleetmpi/kernels/attention.cu``,
its reference ``attention_reference.py``, ``fleetmpi/nn/functional/kernel_attention.py``): the
kernels run on the host through their GPU branch against the reference (``kernel_harness``);
the reference against ``ScaledDotProductAttention``, which stays the CPU path; the order in
which a GPU tries cuDNN's fused attention, the kernels and that operation; and, on a GPU only,
the real kernels against the host reference. (The file's signatures and device compilation:
``test_kernels_host.py``.)"""
import numpy as np
import pytest

import fleetmpi.nn.functional as F
from fleetmpi import Tensor, kernels
from fleetmpi.core import backend
from fleetmpi.kernels import attention_reference as reference
from fleetmpi.kernels import loader
from fleetmpi.nn.functional import cudnn
from fleetmpi.nn.functional.attention import ScaledDotProductAttention
from fleetmpi.nn.gradcheck import check_gradients

from kernel_harness import close, gpu_geometries, gpu_path, host_launch, random  # noqa: F401
from test_cudnn_frontend import gpu_branch, stand_in  # noqa: F401

KERNELS = ["attention_forward", "attention_backward"]
USE_KERNEL = kernels._use_kernel
# Kernel against reference, both in the compute dtype. float64 and float32: the kernel sums a
# row's products in order and rescales key by key, the reference multiplies blocks through
# BLAS: they differ by a few rounding units of the terms (float32: 1.1e-6 relative at most on
# the host, the rest is room for a GPU's exp). float16: both compute in float32 and round once,
# so they differ by at most one float16 rounding unit (2**-10 relative at most) where the
# float32 values straddle a rounding point.
DTYPES = [("float64", 1e-12), ("float32", 2e-5), ("float16", 2e-3)]
# Against ScaledDotProductAttention. float16: the operation forms D = rowsum(dO * O) from its
# float32 probabilities, the reference (as FlashAttention does) from the float16 output, which
# adds a float16 rounding of O to D.
AGAINST_THE_OPERATION = [("float64", 1e-12), ("float32", 2e-5), ("float16", 4e-3)]


def _boolean_mask(shape):
    def make(rng):
        mask = rng.random(shape) > 0.3
        mask[..., 1, :] = False  # a query row with every key masked
        return mask
    return make


def _float_mask(shape, masked_row=None):
    def make(rng):
        mask = rng.standard_normal(shape)
        mask[..., ::4] = -np.inf
        if masked_row is not None:
            mask[..., masked_row, :] = -np.inf
        return mask
    return make


# name: (query, key, value shapes, mask, is_causal). The first cases have more query rows and
# more key rows than every geometry of kernel_harness has threads, so each thread walks several.
CASES = {
    "plain": (((2, 3, 23, 8), (2, 3, 29, 8), (2, 3, 29, 5)), None, False),
    "causal_more_queries": (((2, 3, 29, 8), (2, 3, 23, 8), (2, 3, 23, 8)), None, True),
    "causal_more_keys": (((3, 2, 19, 6), (3, 2, 31, 6), (3, 2, 31, 6)), None, True),
    "boolean_along_heads": (((2, 4, 17, 8), (2, 4, 21, 8), (2, 4, 21, 8)),
                            _boolean_mask((2, 1, 17, 21)), False),
    "boolean_causal": (((2, 2, 9, 4),) * 3, _boolean_mask((9, 9)), True),
    "float_along_keys": (((4, 2, 7, 16), (4, 2, 11, 16), (4, 2, 11, 3)), _float_mask((11,)),
                         False),
    "float_rows_of_heads": (((2, 3, 6, 8),) * 3, _float_mask((3, 6, 1), masked_row=2), True),
    "folded_leading_axes": (((2, 2, 3, 5, 8), (2, 2, 3, 7, 8), (2, 2, 3, 7, 8)),
                            _boolean_mask((2, 1, 3, 5, 7)), False),
    "one_row": (((1, 1, 1, 4),) * 3, None, False),
    "largest_head": (((1, 2, 3, 256), (1, 2, 5, 256), (1, 2, 5, 256)), None, True),
}


def _inputs(case, dtype):
    """``(query, key, value, mask, is_causal)`` of ``CASES[case]`` in ``dtype``."""
    shapes, make_mask, is_causal = CASES[case]
    rng = np.random.default_rng([len(case), shapes[0][-2], shapes[1][-2]])
    query, key, value = (random(rng, shape, dtype) for shape in shapes)
    return query, key, value, None if make_mask is None else make_mask(rng), is_causal


def test_the_largest_head_is_the_kernels_and_the_cases_reach_it():
    assert loader.constant("attention.cu", "MAX_HEAD_DIM") == 256
    assert max(shapes[0][-1] for shapes, _, _ in CASES.values()) == 256


# -- the kernels against the reference ---------------------------------------------------------

@gpu_geometries
@pytest.mark.parametrize("dtype, tolerance", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernels_match_the_reference(gpu_path, case, dtype, tolerance):
    query, key, value, mask, is_causal = _inputs(case, dtype)
    out, lse = kernels.attention_forward(query, key, value, mask, is_causal)
    want_out, want_lse = reference.attention_forward(query, key, value, mask, is_causal, np)
    close(out, want_out, tolerance)
    close(lse, want_lse, tolerance)  # +inf, equal, where a row has no key to attend

    dout = random(np.random.default_rng(len(case)), out.shape, dtype)
    grads = kernels.attention_backward(dout, query, key, value, want_out, want_lse, mask,
                                       is_causal)
    want = reference.attention_backward(dout, query, key, value, want_out, want_lse, mask,
                                         is_causal, np)
    for got, expected in zip(grads, want):
        close(got, expected, tolerance)
    assert gpu_path == KERNELS


@pytest.mark.parametrize("gpu_path", [None], indirect=True)
def test_without_an_instance_or_beyond_the_largest_head_the_reference_runs(gpu_path):
    rng = np.random.default_rng(2)
    for dtypes, head in ((("float32", "float16", "float32"), 8), (("float32",) * 3, 257)):
        query, key, value = (random(rng, (2, 3, head), d) for d in dtypes)
        assert not kernels.attention_runs_kernel([a.dtype for a in (query, key, value)], head,
                                                 head)
        out, lse = kernels.attention_forward(query, key, value, None, False)
        np.testing.assert_array_equal(
            out, reference.attention_forward(query, key, value, None, False, np)[0])
    assert gpu_path == []


# -- the reference against ScaledDotProductAttention (the CPU path) ----------------------------

def _operation(query, key, value, mask, is_causal, dout):
    """Output and query, key and value gradients of ``ScaledDotProductAttention`` on the
    CPU."""
    with pytest.MonkeyPatch.context() as host:
        host.setattr(backend, "on_gpu", lambda: False)
        host.setattr(backend, "array_module", lambda: np)
        tensors = [Tensor(a, stop_gradient=False) for a in (query, key, value)]
        out = ScaledDotProductAttention.apply(*tensors, mask, is_causal=is_causal)
        out.backward(Tensor(dout))
        return [out.numpy()] + [t.grad for t in tensors]


@pytest.mark.parametrize("key_block", [1, 4, reference.KEY_BLOCK])
@pytest.mark.parametrize("dtype, tolerance", AGAINST_THE_OPERATION)
@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_equals_the_operation(case, dtype, tolerance, key_block):
    query, key, value, mask, is_causal = _inputs(case, dtype)
    out, lse = reference.attention_forward(query, key, value, mask, is_causal, np, key_block)
    dout = random(np.random.default_rng(len(case)), out.shape, dtype)
    grads = reference.attention_backward(dout, query, key, value, out, lse, mask, is_causal,
                                         np, key_block)
    want = _operation(query, key, value, mask, is_causal, dout)
    for got, expected in zip((out,) + grads, want):
        close(got, expected, tolerance)
    if mask is not None and mask.dtype == np.bool_:
        assert (out[..., 1, :] == 0).all() and (grads[0][..., 1, :] == 0).all()
        attends = np.broadcast_to(mask, lse.shape + key.shape[-2:-1])
        if is_causal:
            attends = attends & np.tri(*attends.shape[-2:], dtype=bool)
        np.testing.assert_array_equal(np.isinf(lse), ~attends.any(axis=-1))


# -- the operation through the kernels ---------------------------------------------------------

@pytest.fixture
def kernels_without_cudnn(gpu_path, monkeypatch):
    """``gpu_path`` on the loader's geometry with cuDNN off: attention takes the kernels."""
    monkeypatch.setattr(cudnn, "_unusable", "the kernels run on the host in this test")
    return gpu_path


def _attention(query, key, value, mask=None, is_causal=False, dropout_p=0.0):
    return F.scaled_dot_product_attention(query, key, value, mask, dropout_p, is_causal)


@pytest.mark.parametrize("gpu_path", [None], indirect=True)
@pytest.mark.parametrize("case", ["plain", "boolean_causal", "float_rows_of_heads",
                                  "folded_leading_axes"])
def test_attention_through_the_kernels_equals_the_cpu_operation(kernels_without_cudnn, case):
    query, key, value, mask, is_causal = _inputs(case, "float64")
    dout = random(np.random.default_rng(5), query.shape[:-1] + value.shape[-1:], "float64")
    tensors = [Tensor(a, stop_gradient=False) for a in (query, key, value)]
    out = _attention(*tensors, mask, is_causal)
    out.backward(Tensor(dout))
    assert kernels_without_cudnn == KERNELS
    on_device = [out.numpy()] + [t.grad for t in tensors]
    for got, want in zip(on_device, _operation(query, key, value, mask, is_causal, dout)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)


# name: (query, key, value shapes, mask, is_causal), small: every element is differenced
FINITE_DIFFERENCES = {
    "plain": (((1, 2, 5, 4), (1, 2, 6, 4), (1, 2, 6, 3)), None, False),
    "causal_more_keys": (((2, 1, 4, 3), (2, 1, 6, 3), (2, 1, 6, 3)), None, True),
    "boolean_along_heads": (((2, 2, 4, 3), (2, 2, 5, 3), (2, 2, 5, 3)),
                            _boolean_mask((2, 1, 4, 5)), False),
    "float_causal": (((1, 2, 4, 3), (1, 2, 5, 3), (1, 2, 5, 3)),
                     _float_mask((2, 4, 1), masked_row=2), True),
}


@pytest.mark.parametrize("gpu_path", [(2, 3)], indirect=True)
@pytest.mark.parametrize("case", sorted(FINITE_DIFFERENCES))
def test_kernel_gradients_match_finite_differences(kernels_without_cudnn, case):
    shapes, make_mask, is_causal = FINITE_DIFFERENCES[case]
    rng = np.random.default_rng(len(case))
    mask = None if make_mask is None else make_mask(rng)
    errors = check_gradients(lambda q, k, v: _attention(q, k, v, mask, is_causal),
                             *(rng.standard_normal(s) for s in shapes))
    assert set(errors) == {"input0", "input1", "input2"}
    assert max(errors.values()) < 1e-7, errors
    assert set(kernels_without_cudnn) == set(KERNELS)


def test_the_cpu_path_is_the_operation_bit_for_bit(monkeypatch):
    monkeypatch.setattr(backend, "on_gpu", lambda: False)
    monkeypatch.setattr(backend, "array_module", lambda: np)
    monkeypatch.setattr(kernels, "launch", lambda *args: pytest.fail("a kernel on the CPU"))
    for case in ("boolean_causal", "float_rows_of_heads", "plain"):
        query, key, value, mask, is_causal = _inputs(case, "float32")
        dout = random(np.random.default_rng(6), query.shape[:-1] + value.shape[-1:], "float32")
        tensors = [Tensor(a, stop_gradient=False) for a in (query, key, value)]
        out = _attention(*tensors, mask, is_causal)
        out.backward(Tensor(dout))
        got = [out.numpy()] + [t.grad for t in tensors]
        for a, b in zip(got, _operation(query, key, value, mask, is_causal, dout)):
            np.testing.assert_array_equal(a, b)


# -- which path a GPU takes ----------------------------------------------------------------------

@pytest.fixture
def cudnn_and_kernels(stand_in, monkeypatch):
    """The GPU branch with the stand-in cuDNN frontend (``test_cudnn_frontend.py``) and
    ``attention.cu`` run on the host; the value: the stand-in and the kernels launched."""
    launched = []
    monkeypatch.setattr(kernels, "_use_kernel", USE_KERNEL)
    monkeypatch.setattr(kernels, "launch", host_launch(None, launched))
    return stand_in, launched


def _one_attention(dtype, head_dim=8, mask=None, mask_gradient=False, **options):
    """Output and gradients of one attention of (2, 2, 6, head_dim) operands."""
    rng = np.random.default_rng(head_dim)
    tensors = [Tensor(random(rng, (2, 2, 6, head_dim), dtype), stop_gradient=False)
               for _ in range(3)]
    if mask is not None:
        mask = Tensor(mask, stop_gradient=not mask_gradient)
    out = _attention(*tensors, mask, **options)
    out.backward(Tensor(np.ones(out.shape, dtype)))
    return [out.numpy()] + [t.grad for t in tensors]


BOOLEAN = np.tril(np.ones((6, 6), bool))
FLOAT = np.linspace(-1, 1, 36).reshape(6, 6)
# name: (dtype, _one_attention's options, what cuDNN declines, the path taken)
DISPATCH = {
    "float16": ("float16", {}, set(), "cudnn"),
    "float16_causal": ("float16", {"is_causal": True}, set(), "cudnn"),
    "float16_cudnn_declines": ("float16", {"is_causal": True}, {"sdpa"}, "kernels"),
    "float16_cudnn_declines_backward": ("float16", {}, {"sdpa_backward"}, "kernels"),
    "float32": ("float32", {}, set(), "kernels"),
    "float64_causal": ("float64", {"is_causal": True}, set(), "kernels"),
    "float16_boolean_mask": ("float16", {"mask": BOOLEAN}, set(), "kernels"),
    "float32_float_mask": ("float32", {"mask": FLOAT}, set(), "kernels"),
    "float_mask_with_a_gradient": ("float32", {"mask": FLOAT, "mask_gradient": True}, set(),
                                   "operation"),
    "float16_dropout": ("float16", {"dropout_p": 0.3}, set(), "operation"),
    "float32_dropout": ("float32", {"dropout_p": 0.3}, set(), "operation"),
    "float32_head_beyond_the_largest": ("float32", {"head_dim": 264}, set(), "operation"),
    "float16_head_beyond_the_largest_cudnn_declines": ("float16", {"head_dim": 264},
                                                       {"sdpa"}, "operation"),
}


@pytest.mark.parametrize("name", sorted(DISPATCH))
def test_a_gpu_tries_cudnn_then_the_kernels_then_the_operation(cudnn_and_kernels, monkeypatch,
                                                               name):
    stand_in, launched = cudnn_and_kernels
    dtype, options, declined, path = DISPATCH[name]
    stand_in.declined = declined
    got = _one_attention(dtype, **options)
    executed = [op for op, _ in stand_in.executions]
    assert executed == (["sdpa", "sdpa_backward"] if path == "cudnn" else [])
    assert launched == (KERNELS if path == "kernels" else [])
    if options.get("dropout_p"):
        return
    with monkeypatch.context() as host:
        host.setattr(backend, "on_gpu", lambda: False)
        want = _one_attention(dtype, **options)
    for a, b in zip(got, want):
        close(a, b, dict(AGAINST_THE_OPERATION)[dtype])


@pytest.mark.parametrize("gpu_path", [None], indirect=True)
def test_with_cudnn_unusable_float16_attention_takes_the_kernels(kernels_without_cudnn):
    _one_attention("float16", is_causal=True)
    assert kernels_without_cudnn == KERNELS


# -- on a GPU ------------------------------------------------------------------------------------

@pytest.mark.skipif(not backend.on_gpu(),
                    reason="needs a CUDA GPU through CuPy (FLEETMPI_DEVICE=gpu)")
@pytest.mark.parametrize("dtype, tolerance", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_kernels_on_the_gpu_match_the_host_reference(case, dtype, tolerance):
    """The real kernels, compiled by NVRTC, against the NumPy reference on the host."""
    query, key, value, mask, is_causal = _inputs(case, dtype)
    assert kernels.attention_runs_kernel([query.dtype] * 3, query.shape[-1], value.shape[-1])
    device = [backend.asarray(a) for a in (query, key, value)]
    device_mask = None if mask is None else backend.asarray(mask)
    out, lse = kernels.attention_forward(*device, device_mask, is_causal)
    want_out, want_lse = reference.attention_forward(query, key, value, mask, is_causal, np)
    close(backend.to_numpy(out), want_out, tolerance)
    close(backend.to_numpy(lse), want_lse, tolerance)
    dout = random(np.random.default_rng(len(case)), want_out.shape, dtype)
    grads = kernels.attention_backward(backend.asarray(dout), *device, out, lse, device_mask,
                                       is_causal)
    want = reference.attention_backward(dout, query, key, value, backend.to_numpy(out),
                                         backend.to_numpy(lse), mask, is_causal, np)
    for got, expected in zip(grads, want):
        close(backend.to_numpy(got), expected, tolerance)


@pytest.mark.skipif(not backend.on_gpu(),
                    reason="needs a CUDA GPU through CuPy (FLEETMPI_DEVICE=gpu)")
def test_on_the_gpu_no_score_matrix_is_allocated():
    """Forward and backward of 2 causal heads of 4096 positions in float32 under a CuPy memory
    pool limit of 32 MiB above what the inputs hold, half of one head's float32 (seq, seq)
    scores; the first head against the host reference. Sums of 4096 terms in order: 1e-4."""
    import cupy

    rng = np.random.default_rng(11)
    query, key, value, dout = (random(rng, (1, 2, 4096, 64), "float32") for _ in range(4))
    device = [backend.asarray(a) for a in (query, key, value, dout)]
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    pool.set_limit(size=pool.used_bytes() + (32 << 20))
    try:
        out, lse = kernels.attention_forward(*device[:3], None, True)
        grads = kernels.attention_backward(device[3], *device[:3], out, lse, None, True)
        backend.synchronize()
    finally:
        pool.set_limit(size=0)
    head = (slice(None), slice(0, 1))
    want_out, want_lse = reference.attention_forward(query[head], key[head], value[head], None,
                                                     True, np)
    close(backend.to_numpy(out)[head], want_out, 1e-4)
    want = reference.attention_backward(dout[head], query[head], key[head], value[head],
                                         want_out, want_lse, None, True, np)
    for got, expected in zip(grads, want):
        close(backend.to_numpy(got)[head], expected, 1e-4)

"""The fusion pack/unpack kernels: compiled by nvcc, and run on the host against the NumPy reference."""
import numpy as np
import pytest

from fleetmpi.comm import pack

from cuda_host import compile_for_device, load_on_host


def test_pack_kernels_compile_for_the_device():
    ptx = compile_for_device(pack.SOURCE)
    text = open(ptx).read()
    assert ".entry pack_arrays" in text and ".entry unpack_arrays" in text


def _table(arrays):
    ptrs = np.array([a.ctypes.data for a in arrays], dtype=np.uint64)
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([a.size for a in arrays], out=offsets[1:])
    return ptrs, offsets


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.int64])
@pytest.mark.parametrize("grid,block", [(1, 1), (2, 3), (64, 128)])
def test_pack_and_unpack_match_the_reference(dtype, grid, block):
    kernels = load_on_host(pack.SOURCE)
    rng = np.random.default_rng(np.dtype(dtype).num)
    sizes = [5, 0, 1, 17, 0, 3]
    arrays = [(rng.standard_normal(n) * 100).astype(dtype) for n in sizes]
    ptrs, offsets = _table(arrays)
    flat = np.zeros(sum(sizes), dtype)
    kernels.launch("pack_arrays", grid, block, ptrs, offsets, np.int32(len(arrays)), flat,
                   np.int32(flat.itemsize))
    want = np.zeros_like(flat)
    pack.pack_reference(arrays, want)
    np.testing.assert_array_equal(flat.view(np.uint8), want.view(np.uint8))

    flat = (rng.standard_normal(flat.size) * 100).astype(dtype)
    got = [np.zeros_like(a) for a in arrays]
    ptrs, offsets = _table(got)
    kernels.launch("unpack_arrays", grid, block, ptrs, offsets, np.int32(len(got)), flat,
                   np.int32(flat.itemsize))
    want = [np.zeros_like(a) for a in arrays]
    pack.unpack_reference(flat, want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))


def test_host_launcher_refuses_untyped_scalars():
    kernels = load_on_host(pack.SOURCE)
    with pytest.raises(TypeError, match="NumPy arrays or NumPy scalars, not float"):
        kernels.launch("pack_arrays", 1, 1, 1.5)

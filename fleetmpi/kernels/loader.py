"""Compile the ``.cu`` files of this package with CuPy (once per file) and launch their kernels.

Every kernel is a grid-stride loop over ``n`` elements, with one ``extern "C"`` instance per
dtype named ``<kernel>_<dtype>``.
"""
import functools
import os

KERNEL_DTYPES = ("float32", "float64")
THREADS_PER_BLOCK = 256
MAX_BLOCKS = 4096
HERE = os.path.dirname(os.path.abspath(__file__))


def source_path(filename):
    return os.path.join(HERE, filename)


def read_source(filename):
    with open(source_path(filename), encoding="utf-8") as f:
        return f.read()


@functools.lru_cache(maxsize=None)
def _module(filename):
    import cupy

    return cupy.RawModule(code=read_source(filename), options=("--std=c++14",))


def launch(filename, kernel, dtype, n, args):
    """Run ``<kernel>_<dtype>`` of ``filename`` over ``n`` elements."""
    function = _module(filename).get_function(f"{kernel}_{dtype.name}")
    blocks = max(1, min(MAX_BLOCKS, (int(n) + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK))
    function((blocks,), (THREADS_PER_BLOCK,), args)

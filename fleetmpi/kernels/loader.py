"""Launch the kernels of the ``.cu`` files of this package (compiled once each by
``fleetmpi.cuda_source``).

Every kernel is a grid-stride loop over ``n`` elements, with one ``extern "C"`` instance per
dtype named ``<kernel>_<dtype>``.
"""
import os

from ..cuda_source import raw_kernel

KERNEL_DTYPES = ("float32", "float64")
THREADS_PER_BLOCK = 256
MAX_BLOCKS = 4096
HERE = os.path.dirname(os.path.abspath(__file__))


def source_path(filename):
    return os.path.join(HERE, filename)


def launch(filename, kernel, dtype, n, args):
    """Run ``<kernel>_<dtype>`` of ``filename`` over ``n`` elements."""
    function = raw_kernel(source_path(filename), f"{kernel}_{dtype.name}")
    blocks = max(1, min(MAX_BLOCKS, (int(n) + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK))
    function((blocks,), (THREADS_PER_BLOCK,), args)

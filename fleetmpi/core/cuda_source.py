"""Load CUDA kernels kept as ``.cu`` files next to the Python module that uses them.

Kernel sources are real files so tests can compile them with ``nvcc`` and run their bodies on
the host (``tests/cuda_host.py``). CuPy is imported only when a kernel is first asked for.
"""
import functools
import os


def source_path(module_file, filename):
    """The path of ``filename`` beside the module whose ``__file__`` is ``module_file``."""
    return os.path.join(os.path.dirname(os.path.abspath(module_file)), filename)


@functools.lru_cache(maxsize=None)
def _module(path, options):
    import cupy

    with open(path) as f:
        return cupy.RawModule(code=f.read(), options=options)


def raw_kernel(path, name, options=("--std=c++17",)):
    """The ``cupy.RawKernel`` ``name`` compiled (once per process) from the ``.cu`` file at ``path``."""
    return _module(path, tuple(options)).get_function(name)

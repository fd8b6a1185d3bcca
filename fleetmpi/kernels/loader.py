"""Launch the kernels of the ``.cu`` files of this package (compiled once each by
``fleetmpi.core.cuda_source``).

Every kernel is a grid-stride loop over ``n`` work items (elements, or rows). A file's
``DEFINE_*(types..., SUFFIX)`` lines instantiate its kernels once per combination of dtypes, as
the ``extern "C"`` kernels ``<kernel>_<SUFFIX>``; the suffix names the dtypes of the macro's type
parameters in order, each once (``float32``; ``float16_float32`` for float16 values with
float32 statistics). Those lines are the one list of what each file instantiates.
"""
import functools
import os
import re

import numpy as np

from ..core.cuda_source import raw_kernel

THREADS_PER_BLOCK = 256
MAX_BLOCKS = 4096
HERE = os.path.dirname(os.path.abspath(__file__))
# NVRTC compiles a file's text, not the file: -I lets it find precision.cuh beside the kernels.
OPTIONS = ("--std=c++17", f"-I{HERE}")
_INSTANCE = re.compile(r"^DEFINE_\w+\([^)]*?(\w+)\)\s*$", re.M)


def source_path(filename):
    return os.path.join(HERE, filename)


@functools.lru_cache(maxsize=None)
def instances(filename):
    """The suffixes of the instances ``filename`` defines."""
    with open(source_path(filename)) as f:
        return frozenset(_INSTANCE.findall(f.read()))


@functools.lru_cache(maxsize=None)
def constant(filename, name):
    """The integer ``constexpr`` ``name`` that ``filename`` defines (a size its kernels are
    compiled with, which the launching code checks its arguments against)."""
    with open(source_path(filename)) as f:
        match = re.search(rf"^constexpr \w+ {name} = (\d+);", f.read(), re.M)
    if match is None:
        raise LookupError(f"{filename} defines no constexpr {name}")
    return int(match.group(1))


def instance_suffix(*dtypes):
    """The suffix of the instance whose type parameters take ``dtypes``, in order."""
    names = []
    for dtype in dtypes:
        name = np.dtype(dtype).name
        if name not in names:
            names.append(name)
    return "_".join(names)


def launch(filename, kernel, suffix, n, args):
    """Run ``<kernel>_<suffix>`` of ``filename`` over ``n`` work items."""
    function = raw_kernel(source_path(filename), f"{kernel}_{suffix}", OPTIONS)
    blocks = max(1, min(MAX_BLOCKS, (int(n) + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK))
    function((blocks,), (THREADS_PER_BLOCK,), args)

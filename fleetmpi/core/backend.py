"""The array backend: CuPy on a usable CUDA device, NumPy otherwise, and the random generators.

``FLEETMPI_DEVICE=cpu|gpu`` forces one; unset, a GPU is used when CuPy imports and sees a device.
One rank drives one device, ``local_rank % device_count``. On CPU the ranks of a node share its
cores: each limits its BLAS to ``cores // ranks on the node`` threads (``FLEETMPI_NUM_THREADS``
overrides; ``OMP_NUM_THREADS``/``OPENBLAS_NUM_THREADS``/``MKL_NUM_THREADS`` set by the user are
left alone), since oversubscribed BLAS threads make every rank many times slower.

Randomness comes in two kinds. Initial weights must be the same on every rank, so they are drawn
on the host from ``shared_rng`` (seeded by the seed alone; the same on CPU and GPU). Dropout masks
must differ between ranks, so they come from ``rank_rng`` (seeded by the seed and the rank's
model-parallel group; ``fleetmpi.core.rng_tracker`` holds the generators of split activations). Data
order is split between ranks by the sampler from one shared permutation per epoch.
"""
import contextlib
import os

import numpy as np

from . import job
from .capture_checks import check_host_read
from .host_memory import keep_freed_memory
from .knobs import DEVICE, NUM_THREADS
from .launcher_env import LOCAL_RANKS, RANKS_ON_NODE, launcher_number
from .paddle_flags import memory_fraction

_USER_THREAD_ENVS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

_xp = None
_thread_limit = None
_seed = 0
_model_parallel_degree = 1
_shared_rng = None
_rank_rng = None


def requested_device():
    """The device asked for by ``FLEETMPI_DEVICE``: ``"cpu"``, ``"gpu"`` or None (automatic)."""
    return DEVICE.value()


def _local_rank():
    """This rank's index on its node: the job's, or before ``fleet.init()`` the launcher's, so
    that ranks which choose the backend early still drive a device each."""
    return job.local_rank() if job.joined() else launcher_number(LOCAL_RANKS, 0)


def _import_cupy(required):
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CuPy missing, or no driver/device: both mean "no GPU here"
        if required:
            raise RuntimeError(f"{DEVICE.name}=gpu but no CUDA device is usable through CuPy "
                               f"({type(exc).__name__}: {exc})") from None
        return None
    if count == 0:
        if required:
            raise RuntimeError(f"{DEVICE.name}=gpu but CuPy sees no CUDA device")
        return None
    cupy.cuda.Device(_local_rank() % count).use()
    fraction = memory_fraction()
    if fraction is not None:
        cupy.get_default_memory_pool().set_limit(fraction=fraction)
    return cupy


def _ranks_on_node():
    return job.local_size() if job.joined() else launcher_number(RANKS_ON_NODE, 1)


def cpu_threads():
    """The BLAS thread count this rank should use, or None to leave the user's setting."""
    threads = NUM_THREADS.value()
    if threads is not None:
        return threads
    if any(os.environ.get(name) for name in _USER_THREAD_ENVS):
        return None
    return max(1, (os.cpu_count() or 1) // _ranks_on_node())


def limit_cpu_threads():
    """Apply ``cpu_threads()`` to the BLAS NumPy uses (through threadpoolctl, when installed)."""
    global _thread_limit
    threads = cpu_threads()
    if threads is None:
        return None
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # a dependency of fleetmpi, absent only where pip was told --no-deps
        from .log import logger

        if _local_rank() == 0:  # once per node: its ranks share their packages
            logger.warning("threadpoolctl is not installed, so BLAS threads are not limited to "
                           "%d per rank; set OMP_NUM_THREADS or pip install threadpoolctl",
                           threads)
        return None
    _thread_limit = threadpool_limits(limits=threads, user_api="blas")
    return threads


def array_module():
    """The array module every layer computes with (``cupy`` or ``numpy``), chosen once."""
    global _xp
    if _xp is None:
        device = requested_device()
        cupy = None if device == "cpu" else _import_cupy(required=device == "gpu")
        _xp = cupy if cupy is not None else np
        if _xp is np:
            limit_cpu_threads()
            keep_freed_memory()
    return _xp


def choose(device):
    """Make ``device`` (``"cpu"`` or ``"gpu"``) the backend, before the first array is made;
    afterwards only the backend already in use is accepted (arrays made on one cannot move
    to the other). Paddle's ``set_device`` comes here."""
    global _xp
    if _xp is None:
        cupy = None if device == "cpu" else _import_cupy(required=True)
        _xp = cupy if cupy is not None else np
        if _xp is np:
            limit_cpu_threads()
            keep_freed_memory()
    elif (device == "gpu") != on_gpu():
        raise ValueError(f"set_device({device!r}): this process already computes on the "
                         f"{'GPU' if on_gpu() else 'CPU'} backend, chosen when its first array "
                         f"was made; call set_device first, or set {DEVICE.name}={device} "
                         "before the script starts")


def device_index():
    """The CUDA device this rank drives (``local_rank % device_count``), None on the CPU."""
    return int(array_module().cuda.Device().id) if on_gpu() else None


def on_gpu():
    """True when the array module is CuPy."""
    return array_module() is not np


def synchronize():
    """Wait for the device to finish what was queued (timings of GPU work need it; nothing to
    wait for on the host)."""
    check_host_read("backend.synchronize()")
    if on_gpu():
        array_module().cuda.get_current_stream().synchronize()


def to_numpy(array):
    """A host NumPy copy (or the array itself when it already lives on the host)."""
    check_host_read("backend.to_numpy()")
    if isinstance(array, np.ndarray) or np.isscalar(array):
        return np.asarray(array)
    return array.get()


def asarray(array, dtype=None):
    """``array`` on the backend's device."""
    return array_module().asarray(array, dtype=dtype)


def manual_seed(seed):
    """Seed every generator of fleetmpi; call it with the same value on every rank."""
    global _seed, _shared_rng, _rank_rng
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, not {seed!r}")
    _seed = int(seed)
    _shared_rng = None
    _rank_rng = None


def get_seed():
    return _seed


def shared_rng():
    """A host NumPy generator that draws the same numbers on every rank (initial weights)."""
    global _shared_rng
    if _shared_rng is None:
        _shared_rng = np.random.default_rng(np.random.SeedSequence([_seed, 0]))
    return _shared_rng


@contextlib.contextmanager
def shared_rng_of(key):
    """Inside the block ``shared_rng()`` is a generator of its own, seeded by the seed and
    ``key`` (a tuple of non-negative integers) alone; the one outside resumes afterwards where
    it was. A model built in pieces (``PipelineLayer``: each process builds only its stage)
    gives every piece its key, so a piece starts from the same values whichever process builds
    it and whatever the others drew."""
    global _shared_rng
    outside = shared_rng()
    _shared_rng = np.random.default_rng(np.random.SeedSequence([_seed, 2, *key]))
    try:
        yield
    finally:
        _shared_rng = outside


def set_model_parallel_degree(degree):
    """Make the ranks of each model-parallel group (``degree`` neighbouring ranks, the layout's
    innermost axis) share one rank generator, so that they drop an activation they all hold
    alike; ``fleetmpi.core.rng_tracker`` gives them generators of their own for split activations.
    The hybrid layout sets it (1 without one)."""
    global _model_parallel_degree, _rank_rng
    if degree != _model_parallel_degree:
        _model_parallel_degree = degree
        _rank_rng = None


def _generator_index():
    """This rank's model-parallel group: its rank generator's place in the seed."""
    return (job.worker_index() if job.joined() else 0) // _model_parallel_degree


def device_generator(sequence):
    """A generator on the backend's device seeded from the ``np.random.SeedSequence``."""
    if on_gpu():
        return array_module().random.default_rng(int(sequence.generate_state(1)[0]))
    return np.random.default_rng(sequence)


def rank_rng():
    """A generator on the backend's device that differs between ranks (dropout masks), but
    not between the ranks of one model-parallel group (``set_model_parallel_degree``)."""
    global _rank_rng
    if _rank_rng is None:
        _rank_rng = device_generator(np.random.SeedSequence([_seed, 1, _generator_index()]))
    return _rank_rng


def rank_rng_snapshot(generator=None):
    """A copy of the whole state of ``generator`` (the rank generator by default), on either
    backend (on a GPU a device array of CuPy's generator state), to replay its draws later in
    this process; not for files."""
    generator = rank_rng() if generator is None else generator
    if on_gpu():
        return generator.bit_generator._state.copy()
    return generator.bit_generator.state


def restore_rank_rng(snapshot, generator=None):
    """Put ``generator`` (the rank generator by default) back to what ``rank_rng_snapshot``
    returned."""
    generator = rank_rng() if generator is None else generator
    if on_gpu():
        generator.bit_generator._state[...] = snapshot
    else:
        generator.bit_generator.state = snapshot


@contextlib.contextmanager
def rank_rng_replaced(stand_in):
    """Inside the block ``rank_rng()`` returns ``stand_in`` (an object that forwards to the
    real generator, to watch the draws)."""
    global _rank_rng
    generator = rank_rng()
    _rank_rng = stand_in
    try:
        yield
    finally:
        if _rank_rng is stand_in:
            _rank_rng = generator


def rng_state():
    """The state of the rank generator as JSON-able data (None on a GPU, or before first use)."""
    if _rank_rng is None or on_gpu():
        return None
    return _rank_rng.bit_generator.state


def rng_device_state():
    """On a GPU, the rank generator's whole state (CuPy's per-thread generator states) as a
    host array, for checkpoints; None on NumPy (``rng_state`` holds it there) or before the
    generator was first used."""
    if _rank_rng is None or not on_gpu():
        return None
    return to_numpy(_rank_rng.bit_generator._state).copy()


def set_rng_device_state(state):
    """Restore what ``rng_device_state`` returned (None: nothing to restore); a ValueError when
    it was saved on a GPU whose generator has another number of threads."""
    if state is None:
        return
    if not on_gpu():
        raise ValueError("the checkpoint holds a GPU generator state, but this process runs "
                         "on NumPy; its random state cannot be restored here")
    target = rank_rng().bit_generator._state
    if target.shape != state.shape or target.dtype != state.dtype:
        raise ValueError(f"the checkpoint's GPU generator state has {state.size} bytes; this "
                         f"GPU's generator has {target.size} (another number of threads)")
    target[...] = asarray(state)


def _generator_from(state):
    """A NumPy generator in ``state`` (what ``rng_state`` returned); a ValueError when it is
    not one."""
    generator = np.random.default_rng()
    try:
        generator.bit_generator.state = state
    except (TypeError, ValueError, KeyError) as error:
        raise ValueError(f"random state {str(state)[:80]!r} is not a state of the rank "
                         f"generator ({type(error).__name__}: {error})") from None
    return generator


def check_rng_state(state):
    """Raise the ValueError ``set_rng_state`` would raise for ``state``, changing nothing."""
    if state is not None:
        _generator_from(state)


def set_rng_state(state):
    """Restore what ``rng_state`` returned."""
    global _rank_rng
    _rank_rng = None if state is None else _generator_from(state)


def bfloat16():
    """The bfloat16 dtype of both array modules: ``ml_dtypes.bfloat16`` (NumPy has none of its
    own, and CuPy 14 takes it from ml_dtypes too). Without ml_dtypes, a ValueError saying what
    to install."""
    try:
        import ml_dtypes
    except ImportError:
        raise ValueError("bfloat16 needs the ml_dtypes package, since NumPy has no bfloat16 of "
                         "its own: install it (pip install ml-dtypes)") from None
    return np.dtype(ml_dtypes.bfloat16)


def is_floating(dtype):
    """Whether ``dtype`` is a floating dtype: one of NumPy's (kind ``f``) or bfloat16, which
    ml_dtypes defines with kind ``V``."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype.name == "bfloat16"

"""``cupy.random.default_rng``: a generator whose state is a device array, advanced by each
draw on the device, so that a captured draw draws anew at every replay (CuPy's generator
keeps its cuRAND states in ``bit_generator._state`` the same way; fleetmpi's snapshots copy
that array).

The numbers come from NumPy's counter-based Philox: ``_state`` holds its key (2 words) and
counter (4 words); a draw is one kernel that reads them, draws, and writes the advanced
counter back. So the stand-in's streams are not CuPy's (nor the NumPy backend's): a step
with dropout matches the NumPy backend's in distribution only.
"""
import numpy as np

from . import arrays
from .functions import empty


class BitGenerator:
    """The state: ``_state``, six uint64 words on the device."""

    def __init__(self, seed):
        words = np.random.SeedSequence(seed).generate_state(2, np.uint64)
        self._state = arrays.call("seed", lambda: np.concatenate([words,
                                                                  np.zeros(4, np.uint64)]))

    def philox(self):
        """A NumPy ``Philox`` at the state's key and counter (a host view of the state, for
        the kernel that draws)."""
        state = self._state._array
        generator = np.random.Philox(key=state[:2])
        generator.state = {"bit_generator": "Philox",
                           "state": {"counter": state[2:].copy(), "key": state[:2].copy()},
                           "buffer": np.zeros(4, np.uint64), "buffer_pos": 4,
                           "has_uint32": 0, "uinteger": 0}
        return generator


class Generator:
    """``cupy.random.Generator``: the draw the trainer makes (``random``, dropout's), one
    kernel."""

    def __init__(self, bit_generator):
        self.bit_generator = bit_generator

    def random(self, size=None, dtype=np.float64, out=None):
        shape = () if size is None else size
        out = empty(shape, dtype)
        target, state = out._array, self.bit_generator._state._array

        def run():
            philox = self.bit_generator.philox()
            target[...] = np.random.Generator(philox).random(shape, dtype=dtype)
            state[2:] = philox.state["state"]["counter"]
        arrays.current_runtime().enqueue("random", run)
        return out


def default_rng(seed=None):
    return Generator(BitGenerator(seed))

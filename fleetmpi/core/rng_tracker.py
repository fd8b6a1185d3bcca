"""Paddle's random-state tracker (``fleet.meta_parallel.get_rng_state_tracker()``): named
generators that dropout draws from inside ``rng_state(name)``.

Outside the tracker, dropout masks come from the rank generator (``backend.rank_rng``), which
the ranks of one model-parallel group share (``backend.set_model_parallel_degree``): an
activation replicated over the group is dropped alike on each of its ranks. Inside
``rng_state(name)`` masks come from the generator ``add(name, seed)`` made, and
``model_parallel_random_seed`` (``fleetmpi.hybrid``) gives each model-parallel rank its own seed,
so the parts of a split activation (a tensor-parallel attention's heads) are dropped
independently, as Paddle and Megatron-LM do. Recomputation replays these draws too
(``fleetmpi.autograd.recompute``).
"""
import contextlib

import numpy as np

from . import backend

MODEL_PARALLEL_RNG = "model_parallel_rng"


class RNGStatesTracker:
    """Named generators, each seeded once (``add``); ``rng_state(name)`` makes one the
    generator dropout draws from. ``generators`` maps each name to its generator."""

    def __init__(self):
        self.generators = {}
        self._seeds = {}

    def reset(self):
        """Forget every generator and seed."""
        self.generators = {}
        self._seeds = {}

    def add(self, name, seed):
        """A generator called ``name`` seeded with ``seed``; a name or a seed used twice is a
        ValueError, as in Paddle (two states from one seed would draw the same masks)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"an RNG state's name must be a non-empty string, not {name!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"the seed of RNG state {name!r} must be a non-negative integer, "
                             f"not {seed!r}")
        if name in self.generators:
            raise ValueError(f"RNG state {name!r} already exists; reset() the tracker first")
        if int(seed) in self._seeds.values():
            owner = next(n for n, s in self._seeds.items() if s == int(seed))
            raise ValueError(f"seed {seed} is already the seed of RNG state {owner!r}; give "
                             f"{name!r} another")
        self._seeds[name] = int(seed)
        self.generators[name] = backend.device_generator(np.random.SeedSequence([int(seed), 2]))

    def get_states_tracker(self):
        """``{name: state}``, a copy of each generator's state (on a GPU a device array), for
        ``set_states_tracker`` in this process."""
        return {name: backend.rank_rng_snapshot(g) for name, g in self.generators.items()}

    def set_states_tracker(self, states):
        """Put the generators back to what ``get_states_tracker`` returned."""
        unknown = sorted(set(states) - set(self.generators))
        if unknown:
            raise ValueError(f"no RNG state(s) {unknown} to set; the tracker has "
                             f"{sorted(self.generators)}")
        for name, state in states.items():
            backend.restore_rank_rng(state, self.generators[name])

    @contextlib.contextmanager
    def rng_state(self, name=MODEL_PARALLEL_RNG):
        """Inside the block, dropout draws from the generator ``name``."""
        if name not in self.generators:
            raise ValueError(f"RNG state {name!r} does not exist (the tracker has "
                             f"{sorted(self.generators)}): add it with get_rng_state_tracker()"
                             f".add({name!r}, seed), or call model_parallel_random_seed(seed)")
        with backend.rank_rng_replaced(self.generators[name]):
            yield


_TRACKER = RNGStatesTracker()


def get_rng_state_tracker():
    """The process's one ``RNGStatesTracker``."""
    return _TRACKER

"""``strategy.auto``: the strategy chosen by measuring it inside the job.

- ``search``: the calibration, its candidates and the choice (``Calibration``, ``resolved``);
- ``measure``: what the calibration times and measures (allreduce, training steps, the
  activations one forward holds), with every rank's timings agreed;
- ``settings``: auto's own settings (``auto_seconds``, ``auto_allow``, ``auto_memory_MB``),
  each an argument of ``distributed_optimizer`` and an environment variable.
"""
from .search import Calibration, recompute_checkpoints, resolved
from .settings import AutoKnobs, auto_knobs

__all__ = ["AutoKnobs", "Calibration", "auto_knobs", "recompute_checkpoints", "resolved"]

"""``fleetmpi.plan``: predicted step time, communication share and scaling efficiency of
data-parallel training from 1 to thousands of ranks, from the comm layer's own cost models
calibrated on this machine. ``python -m fleetmpi.plan --help``; see docs/plan.md."""
from .buckets import Buckets, gradient_buckets, model_from_spec
from .calibrate import calibrate
from .links import PRESETS, Link, preset
from .predict import (ALGORITHMS, GPU, Cluster, Device, Prediction, SharedMemory, Workload,
                      predict, scaling)

__all__ = ["ALGORITHMS", "Buckets", "Cluster", "Device", "GPU", "Link", "PRESETS", "Prediction",
           "SharedMemory", "Workload", "calibrate", "gradient_buckets", "model_from_spec",
           "predict", "preset", "scaling"]

"""The bottom layer: this process's state and what every layer above may read.

The array backend (``backend``: NumPy or CuPy), the ``FLEETMPI_*`` knobs, logging, files
written without following links, host memory, the timeline, the failure path, this rank's
place in the job (``job``), the launchers' variables, Paddle's flags, the CUDA-graph capture
checks and the RNG state tracker. Nothing here imports another part of fleetmpi except
``fleetmpi.device`` (docs/architecture.md, "Layers").
"""

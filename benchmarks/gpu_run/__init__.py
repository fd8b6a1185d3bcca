"""The parts of ``benchmarks/gpu_check.py``: the plan, the offline install, the version probe,
the MPI launcher choice, the stages and the report."""

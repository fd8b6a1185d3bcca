"""How long a test lets a job it starts run before it calls the job hung.

Only a hang reaches it: a healthy job of these tests takes seconds on a 2-core machine, and a
few times that beside another CPU-bound job, so a verdict never depends on the machine's load.
It stays under the per-test limit of ``tests/run`` and ``tests/mpi_pytest.py`` (pytest-timeout,
300 s), so that the test itself reports the hang, with the job's output, rather than
pytest-timeout's stack dump.
"""
HANG_SECONDS = 240

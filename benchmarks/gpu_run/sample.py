"""A pytest plugin for the dry run of the gpu_tests stage: ``--sample-per-file N`` keeps N
tests of each file, evenly spread over it (the first and the last among them), and deselects
the rest. The dry run proves that every planned file imports, collects and runs on the CPU and
that the stage records what ran; the whole list runs on the GPU.

    python -m pytest -p gpu_run.sample --sample-per-file 3 tests/test_kernels.py
"""


def pytest_addoption(parser):
    parser.addoption("--sample-per-file", type=int, default=None, metavar="N",
                     help="run N tests of each file, evenly spread (the dry run's sample)")


def spread(count, size):
    """``count`` indices evenly spread over ``range(size)``, the first and the last included
    (all of them where ``size <= count``)."""
    if size <= count:
        return list(range(size))
    if count == 1:
        return [0]
    return sorted({round(i * (size - 1) / (count - 1)) for i in range(count)})


def pytest_collection_modifyitems(config, items):
    count = config.getoption("sample_per_file")
    if count is None:
        return
    by_file = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)
    kept = {id(tests[i]) for tests in by_file.values() for i in spread(count, len(tests))}
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
    items[:] = [item for item in items if id(item) in kept]

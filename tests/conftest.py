"""Fixtures shared by the test modules."""
import logging

import pytest

import fleetmpi as fleet
from fleetmpi.core import backend, cuda_source
from fleetmpi import nn
from fleetmpi.autograd import engine
from fleetmpi.comm import hybrid_topology, release_communicators


@pytest.fixture
def float64_layers():
    """Layers made in float64 from a fixed seed (for finite-difference checks and exact
    comparisons), float32 again afterwards."""
    nn.set_default_dtype("float64")
    backend.manual_seed(0)
    yield
    nn.set_default_dtype("float32")


@pytest.fixture(autouse=True)
def no_hybrid_layout_after():
    """A test that lays the ranks out with hybrid_configs leaves no layout to the next one
    (layers built without a group would take its model-parallel group, dropout would share
    its masks over it), no strategy of fleet.init for the next distributed_optimizer, no
    step it left open to take the next test's backward, and no communicator: the next test
    starts with fresh ones (one that provoked a collective error leaves messages behind),
    and MPI's communicators are not used up over the suite."""
    yield
    engine.set_step_driver(None)
    hybrid_topology.set_current(None)
    backend.set_model_parallel_degree(1)
    fleet.world._init_strategy = None
    release_communicators()


@pytest.fixture
def fleetmpi_warnings(caplog, monkeypatch):
    """A function returning the messages of the warnings the ``fleetmpi`` logger wrote on this
    rank during the test. ``fleet.init()`` (called here first) gives that logger a handler of
    its own and stops it from propagating, so ``caplog`` alone would see none of them."""
    fleet.init()
    monkeypatch.setattr(logging.getLogger("fleetmpi"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="fleetmpi")
    return lambda: [r.getMessage() for r in caplog.records
                    if r.name.startswith("fleetmpi") and r.levelno >= logging.WARNING]


@pytest.fixture
def gpu_stand_in(monkeypatch):
    """The NumPy-backed CuPy stand-in (``tests/cupy_stand_in``) installed as the backend's
    array module and as ``cupy``: the trainer takes its GPU branches, its kernels run compiled
    for the host, its products run through the cuBLASLt stand-in
    (``tests/cublaslt_stand_in.py``), cuDNN is absent. The fixture's value is the stand-in (``counting()``,
    ``runtime``)."""
    from cublaslt_stand_in import install_on_cupy_stand_in
    from cupy_stand_in import install

    stand_in = install(monkeypatch)
    install_on_cupy_stand_in(monkeypatch)
    yield stand_in
    cuda_source._module.cache_clear()

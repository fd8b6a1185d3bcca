"""Fixtures shared by the test modules."""
import pytest

from fleetmpi import backend, nn


@pytest.fixture
def float64_layers():
    """Layers made in float64 from a fixed seed (for finite-difference checks and exact
    comparisons), float32 again afterwards."""
    nn.set_default_dtype("float64")
    backend.manual_seed(0)
    yield
    nn.set_default_dtype("float32")

"""Finite-difference gradient checks of recorded operations (use float64)."""
import numpy as np

from ..core import backend
from ..autograd import Tensor, as_array, no_grad


def _weighted_sum(function, inputs, weights, seed):
    backend.manual_seed(seed)
    y = function(*inputs)
    if weights is None:
        return y
    return (y * weights).sum()


def check_gradients(function, *inputs, eps=1e-6, seed=0):
    """Compare the gradients ``backward`` computes with central differences of
    ``sum(function(*inputs) * w)`` for a fixed random ``w``: for every floating input and,
    when ``function`` is a Layer, every parameter. ``function`` may be a Layer, a
    ``Function``'s ``apply`` or any function of Tensors. Generators are reseeded before every
    evaluation, so dropout masks stay fixed. Returns ``{name: max relative error}``, with
    ``"input0"``, ``"input1"``... for the inputs."""
    xp = backend.array_module()
    tensors = [Tensor(backend.asarray(as_array(x)), stop_gradient=as_array(x).dtype.kind != "f")
               for x in inputs]
    named = list(function.named_parameters()) if hasattr(function, "named_parameters") else []
    with no_grad():
        y = _weighted_sum(function, tensors, None, seed)
    weights = xp.asarray(np.random.default_rng(seed + 1).standard_normal(y.shape),
                         dtype=y.dtype)
    for _, p in named:
        p.clear_gradient()
    _weighted_sum(function, tensors, weights, seed).backward()
    targets = [(name, p) for name, p in named]
    targets += [(f"input{i}", t) for i, t in enumerate(tensors) if not t.stop_gradient]
    errors = {}
    for name, tensor in targets:
        analytic = tensor.grad.numpy().copy()
        array = tensor.data
        numeric = np.zeros(array.shape)
        with no_grad():
            for index in np.ndindex(*array.shape):
                original = float(array[index])
                array[index] = original + eps
                plus = float(_weighted_sum(function, tensors, weights, seed))
                array[index] = original - eps
                minus = float(_weighted_sum(function, tensors, weights, seed))
                array[index] = original
                numeric[index] = (plus - minus) / (2 * eps)
        scale = max(np.abs(numeric).max(), np.abs(analytic).max(), 1e-3)
        errors[name] = float(np.abs(numeric - analytic).max() / scale)
    return errors

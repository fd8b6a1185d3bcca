"""Finite-difference gradient checks of a layer's ``backward`` (use float64)."""
import numpy as np

from .. import backend


def _loss_and_backward(layer, x, weights, seed):
    backend.manual_seed(seed)
    y = layer.forward(x)
    loss = float((y * weights).sum())
    return loss, y


def check_gradients(layer, x, eps=1e-6, seed=0):
    """Compare ``layer.backward`` with central differences of ``sum(forward(x) * w)`` for a fixed
    random ``w``, for the input (when it is floating point) and every parameter. The generators
    are reseeded before every forward, so dropout masks stay fixed. Returns
    ``{name: max relative error}`` with ``"input"`` for the input gradient."""
    xp = backend.array_module()
    _, y = _loss_and_backward(layer, x, 0.0, seed)
    weights = xp.asarray(np.random.default_rng(seed + 1).standard_normal(y.shape))
    _loss_and_backward(layer, x, weights, seed)
    params = layer.named_parameters()
    dx = layer.backward(weights.astype(y.dtype))
    analytic = {name: backend.to_numpy(p.grad).copy() for name, p in params}
    targets = [(name, p.data) for name, p in params]
    if x.dtype.kind == "f":
        analytic["input"] = backend.to_numpy(dx)
        targets.append(("input", x))
    errors = {}
    for name, array in targets:
        numeric = np.zeros(array.shape)
        flat_index = np.ndindex(*array.shape)
        for index in flat_index:
            original = float(array[index])
            array[index] = original + eps
            plus, _ = _loss_and_backward(layer, x, weights, seed)
            array[index] = original - eps
            minus, _ = _loss_and_backward(layer, x, weights, seed)
            array[index] = original
            numeric[index] = (plus - minus) / (2 * eps)
        scale = max(np.abs(numeric).max(), np.abs(analytic[name]).max(), 1e-3)
        errors[name] = float(np.abs(numeric - analytic[name]).max() / scale)
    return errors

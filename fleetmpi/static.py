"""``fleetmpi.static``: Paddle's ``paddle.static.InputSpec``, which ``paddle.Model`` scripts
pass to say what the network takes and what the labels are. fleetmpi trains in dygraph only,
so Paddle's static-graph programs, executors and the rest of ``paddle.static`` are not here.
"""
import numpy as np

__all__ = ["InputSpec"]


class InputSpec:
    """Paddle's ``InputSpec(shape, dtype="float32", name=None, stop_gradient=False)``: the
    shape of one input (``None`` or ``-1`` for a size that varies, the batch's), its dtype and
    its name. ``Model`` counts its inputs by them and ``Model.summary`` reads their shapes."""

    def __init__(self, shape, dtype="float32", name=None, stop_gradient=False):
        if isinstance(shape, (int, np.integer)):
            shape = [shape]
        if not isinstance(shape, (list, tuple)) or any(
                d is not None and (not isinstance(d, (int, np.integer)) or d < -1 or d == 0)
                for d in shape):
            raise ValueError(f"InputSpec shape={shape!r}: a list of positive sizes, with None "
                             "or -1 for a size that varies")
        self.shape = tuple(None if d is None else int(d) for d in shape)
        self.dtype = str(np.dtype(dtype))
        self.name = name
        self.stop_gradient = bool(stop_gradient)

    @classmethod
    def from_tensor(cls, tensor, name=None):
        return cls(list(tensor.shape), str(tensor.dtype), name)

    @classmethod
    def from_numpy(cls, ndarray, name=None):
        return cls(list(ndarray.shape), str(ndarray.dtype), name)

    def __repr__(self):
        return f"InputSpec(shape={self.shape}, dtype={self.dtype}, name={self.name}, " \
               f"stop_gradient={self.stop_gradient})"

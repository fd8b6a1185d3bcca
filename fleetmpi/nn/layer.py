"""``Layer``: the base of every layer and model, with explicit ``forward`` and ``backward``.

A leaf layer implements ``forward(x)`` (keeping what backward needs) and ``_backward(dy,
input_grad)`` (setting its parameters' gradients and returning the input gradient, or None when
``input_grad`` is False and nobody needs it). ``backward(dy, on_gradient, input_grad)`` runs
``_backward`` and then calls ``on_gradient(parameters)`` with the layer's own parameters, whose
gradients are now final for this step; gradient reduction hooks in there.
Gradients are set, not accumulated: every backward overwrites them.
"""
from collections import OrderedDict

import numpy as np

from .. import backend
from ..device_guard import current_stage
from .flat import flatten
from .parameter import Parameter

_default_dtype = np.dtype("float32")
FLOAT_DTYPES = ("float16", "float32", "float64")


def set_default_dtype(dtype):
    """The dtype of parameters of layers created from now on (``"float32"`` to start with)."""
    global _default_dtype
    _default_dtype = _check_float_dtype(dtype)


def get_default_dtype():
    return _default_dtype


def _check_float_dtype(dtype):
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved.name not in FLOAT_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not allowed; use one of {FLOAT_DTYPES}")
    return resolved


class Layer:
    """Parameters, buffers (non-trained state such as running means) and child layers.

    ``op_type`` names the Paddle operator a leaf layer computes (``"matmul"``, ``"conv2d"``,
    ``"relu"``...): what amp's white and black lists refer to. None for containers and for
    layers without such an operator. ``pipeline_stage``: the stage of the ``device_guard`` the
    layer was built in (None outside any), given to its parameters too."""

    op_type = None

    def __init__(self, dtype=None):
        self._parameters = OrderedDict()
        self._buffers = OrderedDict()
        self._children = OrderedDict()
        self.training = True
        self.dtype = _check_float_dtype(dtype) if dtype is not None else _default_dtype
        self.pipeline_stage = current_stage()

    def create_parameter(self, name, value):
        """Register ``value`` (a host array) as the trainable parameter ``name``."""
        param = Parameter(np.asarray(value, dtype=self.dtype))
        param.pipeline_stage = self.pipeline_stage
        self._parameters[name] = param
        setattr(self, name, param)
        return param

    def create_buffer(self, name, value):
        self._buffers[name] = backend.asarray(np.asarray(value, dtype=self.dtype))

    def buffer(self, name):
        return self._buffers[name]

    def add_sublayer(self, name, layer):
        if not isinstance(layer, Layer):
            raise TypeError(f"sublayer {name!r} must be a fleetmpi.nn.Layer, "
                            f"not {type(layer).__name__}")
        self._children[name] = layer
        return layer

    def sublayers(self):
        return list(self._children.values())

    def named_sublayers(self, prefix=""):
        """Every descendant as ``(dotted name, layer)``, parents before children."""
        result = []
        for name, child in self._children.items():
            full = f"{prefix}{name}"
            result.append((full, child))
            result.extend(child.named_sublayers(full + "."))
        return result

    # -- parameters -------------------------------------------------------------------------
    def _named_parameters_unflat(self, prefix=""):
        result = [(f"{prefix}{name}", p) for name, p in self._parameters.items()]
        for name, child in self._children.items():
            result.extend(child._named_parameters_unflat(f"{prefix}{name}."))
        return result

    def named_parameters(self):
        """``(dotted name, Parameter)`` in forward order; the parameters are flattened first
        (one contiguous buffer per dtype, laid out in backward order) unless they already are.
        The layer that flattens names the parameters (``Parameter.name``) from itself down."""
        named = self._named_parameters_unflat()
        before = [p.buffer for _, p in named]
        flatten([p for _, p in reversed(named)])
        if any(p.buffer is not old for (_, p), old in zip(named, before)):
            for name, p in named:
                p.name = name
        return named

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def flat_buffers(self):
        """The flat buffers holding this layer's parameters, one per dtype."""
        params = self.parameters()
        seen = OrderedDict()
        for p in params:
            seen[id(p.buffer)] = p.buffer
        return list(seen.values())

    def own_parameters(self):
        return list(self._parameters.values())

    def named_buffers(self, prefix=""):
        result = [(f"{prefix}{name}", b) for name, b in self._buffers.items()]
        for name, child in self._children.items():
            result.extend(child.named_buffers(f"{prefix}{name}."))
        return result

    def state_dict(self):
        """Parameters and buffers by dotted name, as host NumPy copies."""
        state = OrderedDict((name, backend.to_numpy(p.data).copy())
                            for name, p in self.named_parameters())
        for name, b in self.named_buffers():
            state[name] = backend.to_numpy(b).copy()
        return state

    def set_state_dict(self, state):
        """Load what ``state_dict`` returned; every name must be present with its shape."""
        params = dict(self.named_parameters())
        expected = set(params) | {name for name, _ in self.named_buffers()}
        missing = sorted(expected - set(state))
        unexpected = sorted(set(state) - expected)
        if missing or unexpected:
            raise KeyError(f"state dict does not match the model: missing {missing}, "
                           f"unexpected {unexpected}")
        for name, p in params.items():
            p.data[...] = backend.asarray(_checked(name, state[name], p.shape))
        for layer_prefix, layer in [("", self)] + [(n + ".", l) for n, l in
                                                   self.named_sublayers()]:
            for bname, b in layer._buffers.items():
                b[...] = backend.asarray(_checked(layer_prefix + bname, state[layer_prefix + bname],
                                                  b.shape))

    # -- modes ------------------------------------------------------------------------------
    def train(self):
        self.training = True
        for child in self._children.values():
            child.train()
        return self

    def eval(self):
        self.training = False
        for child in self._children.values():
            child.eval()
        return self

    def configure_fusion(self, fuse_elewise_add_act_ops=False, fuse_bn_act_ops=False):
        """Switch fused kernels on or off (the ``BuildStrategy`` fields of the same names)."""
        for child in self._children.values():
            child.configure_fusion(fuse_elewise_add_act_ops, fuse_bn_act_ops)

    # -- computation ------------------------------------------------------------------------
    def forward(self, x):
        raise NotImplementedError(f"{type(self).__name__} does not define forward")

    def _backward(self, dy, input_grad):
        raise NotImplementedError(f"{type(self).__name__} does not define backward")

    def backward(self, dy, on_gradient=None, input_grad=True):
        """The input gradient (None if not ``input_grad``); sets the parameters' gradients and
        reports them to ``on_gradient`` as they become final."""
        dx = self._backward(dy, input_grad)
        if on_gradient is not None and self._parameters:
            on_gradient(self.own_parameters())
        return dx

    def __call__(self, x):
        return self.forward(x)

    def extra_repr(self):
        return ""

    def __repr__(self):
        head = f"{type(self).__name__}({self.extra_repr()})"
        if not self._children:
            return head
        lines = [f"  ({name}): " + repr(child).replace("\n", "\n  ")
                 for name, child in self._children.items()]
        return f"{type(self).__name__}(\n" + "\n".join(lines) + "\n)"


def _checked(name, value, shape):
    value = np.asarray(value) if isinstance(value, (list, tuple)) else value
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"state entry {name!r} has shape {tuple(value.shape)}, "
                         f"the model expects {tuple(shape)}")
    return value

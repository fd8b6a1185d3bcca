"""``Layer``: the base of every layer and model, as Paddle dygraph users write one.

A model subclasses ``Layer``, assigns its sublayers and parameters as attributes in
``__init__`` (after ``super().__init__()``) and defines ``forward``; calling the model runs
``forward`` and the operations it performs are recorded for ``loss.backward()``. Attributes
are registered in assignment order, and their dotted paths (``"block1.fc.weight"``) name the
parameters: what recompute checkpoints, lars/lamb exclusion lists and checkpoints refer to.

``pipeline_stage`` annotates a layer and its parameters with the pipeline stage they belong to;
``nn`` only carries it (a parameter assigned to a layer without a stage of its own takes the
layer's). It is set from outside: on a built layer and everything in it by
``Layer.set_pipeline_stage``, or on each layer as it is constructed by a hook of
``register_construction_hook`` (``fleetmpi.device_guard`` puts every layer built inside its
block on its stage so).

The interface strategies use, besides a model's public methods (``parameters``,
``named_children``, ``named_sublayers``, ``named_buffers``, ``flat_buffers``,
``configure_fusion``, the forward hooks):

* ``pipeline_stage``: read; set only through ``set_pipeline_stage``.
* ``forward``: a strategy may give a layer a ``forward`` instance attribute for the time of a
  step (recompute) and must delete it, or put back the one it had, afterwards.
* ``nn.Sequential.steps()`` and a layer's ``forward_act(x, act)``: the steps a Sequential runs
  with kernel fusion, for a strategy that runs or cuts them itself (pipeline, recompute).
"""
import warnings
from collections import OrderedDict

import numpy as np

from ..core import backend
from ..autograd import Tensor, as_array, cast, nan_inf
from ..autograd.tensor import HookRemoveHelper
from . import initializer, lazy
from .flat import flatten
from .param_attr import to_attr
from .parameter import Parameter

_default_dtype = np.dtype("float32")
FLOAT_DTYPES = ("float16", "float32", "float64")
# Called with every Layer as Layer.__init__ ends, in registration order (module docstring).
_construction_hooks = []


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


def register_construction_hook(hook):
    """Call ``hook(layer)`` for every Layer constructed from now on, as ``Layer.__init__``
    ends (before the subclass's ``__init__`` assigns sublayers and parameters); returns a
    handle whose ``remove()`` stops it."""
    _construction_hooks.append(hook)
    return HookRemoveHelper(_construction_hooks, hook)


class Layer:
    """Parameters, buffers (non-trained state such as running means) and sublayers, registered
    as they are assigned. ``pipeline_stage``: the pipeline stage the layer belongs to (None:
    none given; module docstring), given to its parameters too."""

    def __init__(self, dtype=None, name_scope=None):
        if name_scope is not None and not isinstance(name_scope, str):
            raise ValueError(f"a layer's name must be a string or None, not {name_scope!r}")
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_children", OrderedDict())
        object.__setattr__(self, "_forward_pre_hooks", [])
        object.__setattr__(self, "_forward_post_hooks", [])
        self.training = True
        self.dtype = _check_float_dtype(dtype) if dtype is not None else _default_dtype
        self.pipeline_stage = None
        self._name_scope = name_scope
        for hook in _construction_hooks:
            hook(self)

    def full_name(self):
        """The layer's name: the ``name`` (Paddle's ``name_scope``) it was built with, else its
        class name in lower case."""
        return self._name_scope or type(self).__name__.lower()

    # -- registration -----------------------------------------------------------------------
    def _registries(self, name):
        registries = self.__dict__.get("_parameters")
        if registries is None:
            raise RuntimeError(f"{type(self).__name__}: assign {name!r} after calling "
                               "super().__init__() in __init__")
        return self._parameters, self._children, self._buffers

    def __setattr__(self, name, value):
        if isinstance(value, (Parameter, Layer)) or name in self.__dict__.get("_parameters", ()) \
                or name in self.__dict__.get("_children", ()) \
                or name in self.__dict__.get("_buffers", ()):
            parameters, children, buffers = self._registries(name)
            parameters.pop(name, None)
            children.pop(name, None)
            if isinstance(value, Parameter):
                if value.pipeline_stage is None:
                    value.pipeline_stage = self.pipeline_stage
                parameters[name] = value
            elif isinstance(value, Layer):
                children[name] = value
            elif name in buffers:
                value = as_array(value) if value is not None else None
                if value is None:
                    del buffers[name]
                else:
                    buffers[name] = value
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        for registry in (self._parameters, self._children, self._buffers):
            registry.pop(name, None)
        object.__delattr__(self, name)

    def create_parameter(self, shape, attr=None, dtype=None, is_bias=False,
                         default_initializer=None):
        """A new Parameter of ``shape`` (Paddle's signature): ``attr`` a ``ParamAttr`` or what
        a layer argument takes (``nn.param_attr``; False: no parameter, None is returned);
        values from its initializer, else ``default_initializer`` (an initializer of
        ``fleetmpi.nn.initializer``, any callable of the shape, or an array of that shape),
        else zeros for a bias and Xavier-uniform for the rest. Assign it to an attribute to
        register it. Under ``LazyGuard`` the initializer is recorded, not run (``nn.lazy``)."""
        attr = to_attr(attr, "attr")
        if attr is False:
            return None
        shape = tuple(int(n) for n in np.atleast_1d(shape)) if np.ndim(shape) else (int(shape),)
        if any(n < 1 for n in shape):
            raise ValueError(f"create_parameter shape {shape} must have sizes >= 1")
        init = attr.initializer or default_initializer
        if init is None:
            init = initializer.Constant(0.0) if is_bias else initializer.XavierUniform()
        dtype = self.dtype if dtype is None else _check_float_dtype(dtype)
        if lazy.building():
            deferred = lazy.DeferredInit(init, shape, dtype, type(self).__name__)
            param = Parameter(None, trainable=attr.trainable, deferred_init=deferred,
                              name=attr.name)
        else:
            values = init(shape) if callable(init) else np.asarray(init)
            values = np.asarray(backend.to_numpy(as_array(values)))
            if tuple(values.shape) != shape:
                raise ValueError(f"create_parameter: the initializer gave shape "
                                 f"{tuple(values.shape)} for a parameter of shape {shape}")
            param = Parameter(values.astype(dtype), trainable=attr.trainable, name=attr.name)
        param.pipeline_stage = self.pipeline_stage
        return param

    def add_parameter(self, name, parameter):
        if not isinstance(parameter, Parameter):
            raise TypeError(f"add_parameter({name!r}) takes a Parameter, not "
                            f"{type(parameter).__name__}")
        setattr(self, name, parameter)
        return parameter

    def add_sublayer(self, name, layer):
        if not isinstance(layer, Layer):
            raise TypeError(f"sublayer {name!r} must be a fleetmpi.nn.Layer, "
                            f"not {type(layer).__name__}")
        setattr(self, str(name), layer)
        return layer

    def register_buffer(self, name, tensor, persistable=True):
        """Keep ``tensor`` (an array or Tensor; state that is not trained, such as running
        statistics) as the buffer ``name``: saved in ``state_dict``, broadcast by
        ``distributed_model``, reachable as an attribute (a backend array)."""
        self._registries(name)[2][name] = backend.asarray(as_array(tensor))
        object.__setattr__(self, name, self._buffers[name])

    def buffer(self, name):
        return self._buffers[name]

    # -- the tree ---------------------------------------------------------------------------
    def children(self):
        return list(self._children.values())

    def sublayers(self, include_self=False):
        """Every descendant (Paddle's ``sublayers``; ``children`` gives the direct ones)."""
        return [layer for _, layer in self.named_sublayers(include_self=include_self)]

    def named_children(self):
        return list(self._children.items())

    def named_sublayers(self, prefix="", include_self=False):
        """Every descendant as ``(dotted name, layer)``, parents before children, each layer
        once (a shared sublayer under its first name)."""
        return _depth_first(self, prefix, include_self)

    def set_pipeline_stage(self, stage):
        """Put this layer, every layer inside it and their parameters on pipeline stage
        ``stage``."""
        for member in [self] + [child for _, child in self.named_sublayers()]:
            member.pipeline_stage = stage
            for parameter in member.own_parameters():
                parameter.pipeline_stage = stage

    def apply(self, function):
        """Call ``function(layer)`` on every sublayer, then on this one."""
        for _, layer in self.named_sublayers():
            function(layer)
        function(self)
        return self

    # -- parameters -------------------------------------------------------------------------
    def _named_parameters_unflat(self, prefix=""):
        result, seen = [], set()
        for layer_path, layer in _depth_first(self, prefix, include_self=True):
            for name, p in layer._parameters.items():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    result.append((f"{layer_path}.{name}" if layer_path else name, p))
        return result

    def named_parameters(self, prefix=""):
        """``(dotted name, Parameter)`` in registration order, each parameter once; the
        parameters are flattened first (one contiguous buffer per dtype, laid out in reverse
        registration order, which is the order backward usually completes them) unless they
        already are. The layer that flattens names the parameters (``Parameter.name``) that
        their ``ParamAttr`` did not name."""
        named = self._named_parameters_unflat(prefix)
        before = [p.buffer for _, p in named]
        flatten([p for _, p in reversed(named)])
        if any(p.buffer is not old for (_, p), old in zip(named, before)):
            for name, p in named:
                if not p.named_by_attr:
                    p.name = name
        return named

    def parameters(self, include_sublayers=True):
        return [p for _, p in self.named_parameters()]

    def flat_buffers(self):
        """The flat buffers holding this layer's parameters, one per dtype."""
        seen = OrderedDict()
        for p in self.parameters():
            seen[id(p.buffer)] = p.buffer
        return list(seen.values())

    def own_parameters(self):
        return [p for p in self._parameters.values() if p is not None]

    def clear_gradients(self):
        for p in self.parameters():
            p.clear_gradient()

    def named_buffers(self, prefix=""):
        result = []
        for layer_path, layer in _depth_first(self, prefix, include_self=True):
            for name, b in layer._buffers.items():
                result.append((f"{layer_path}.{name}" if layer_path else name, b))
        return result

    def buffers(self):
        return [b for _, b in self.named_buffers()]

    def state_dict(self):
        """Parameters and buffers by dotted name, as host NumPy copies (under sharding stage 3
        gathered: every rank calls it)."""
        state = OrderedDict((name, backend.to_numpy(p.values()).copy())
                            for name, p in self.named_parameters())
        for name, b in self.named_buffers():
            state[name] = backend.to_numpy(b).copy()
        return state

    def set_state_dict(self, state):
        """Load what ``state_dict`` returned; every name must be present with its shape."""
        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        expected = set(params) | set(buffers)
        missing = sorted(expected - set(state))
        unexpected = sorted(set(state) - expected)
        if missing or unexpected:
            raise KeyError(f"state dict does not match the model: missing {missing}, "
                           f"unexpected {unexpected}")
        for name, p in params.items():
            p.assign(backend.asarray(_checked(name, as_array(state[name]), p.shape)))
        for name, b in buffers.items():
            b[...] = backend.asarray(_checked(name, as_array(state[name]), b.shape))

    set_dict = load_dict = set_state_dict

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
    def forward(self, *inputs, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} does not define forward")

    def register_forward_pre_hook(self, hook):
        """``hook(layer, inputs)`` before every forward; a tuple it returns replaces the
        inputs."""
        self._forward_pre_hooks.append(hook)
        return HookRemoveHelper(self._forward_pre_hooks, hook)

    def register_forward_post_hook(self, hook):
        """``hook(layer, inputs, output)`` after every forward; a value it returns replaces
        the output."""
        self._forward_post_hooks.append(hook)
        return HookRemoveHelper(self._forward_post_hooks, hook)

    def __call__(self, *inputs, **kwargs):
        if any(getattr(x, "dtype", None) == np.float64 for x in inputs):
            inputs = self._float64_inputs_cast(inputs)
        for hook in self._forward_pre_hooks:
            replaced = hook(self, inputs)
            if replaced is not None:
                inputs = replaced if isinstance(replaced, tuple) else (replaced,)
        if nan_inf.enabled:
            with nan_inf.in_layer(self):
                output = self.forward(*inputs, **kwargs)
        else:
            output = self.forward(*inputs, **kwargs)
        for hook in self._forward_post_hooks:
            replaced = hook(self, inputs, output)
            if replaced is not None:
                output = replaced
        return output

    def _float64_inputs_cast(self, inputs):
        """``inputs`` with their float64 arrays and Tensors cast to the dtype of this layer's
        floating parameters when those are narrower (NumPy's default float64 data would
        otherwise promote every operation of a float32 model to float64, silently doubling its
        memory and time), warning once per call site; unchanged when the layer has no
        parameters or float64 ones. (The parameters are looked at unflattened: flattening a
        sublayer's on its own would break the model's flat buffer.)"""
        dtype = next((p.dtype for _, p in self._named_parameters_unflat("")
                      if backend.is_floating(p.dtype)), None)
        if dtype is None or np.dtype(dtype) == np.float64:
            return inputs
        warnings.warn(f"{type(self).__name__} got float64 input while its parameters are "
                      f"{np.dtype(dtype).name}: the input is cast to {np.dtype(dtype).name} "
                      f"(cast the data once, e.g. x.astype('float32'), to avoid the cast each "
                      f"call)", UserWarning, stacklevel=3)
        return tuple(self._cast_input(x, dtype) for x in inputs)

    @staticmethod
    def _cast_input(x, dtype):
        if getattr(x, "dtype", None) != np.float64:
            return x
        return cast(x, dtype) if isinstance(x, Tensor) else x.astype(dtype)

    def extra_repr(self):
        return ""

    def __repr__(self):
        head = f"{type(self).__name__}({self.extra_repr()})"
        if not self._children:
            return head
        lines = [f"  ({name}): " + repr(child).replace("\n", "\n  ")
                 for name, child in self._children.items()]
        return f"{type(self).__name__}(\n" + "\n".join(lines) + "\n)"


def _depth_first(layer, prefix, include_self):
    """``(dotted name, layer)`` of ``layer``'s tree, parents before children, depth first in
    registration order, each layer once."""
    result = [(prefix, layer)] if include_self else []
    seen = {id(layer)}

    def visit(path, node):
        for name, child in node._children.items():
            if id(child) in seen:
                continue
            seen.add(id(child))
            full = f"{path}.{name}" if path else name
            result.append((full, child))
            visit(full, child)

    visit(prefix, layer)
    return result


def _checked(name, value, shape):
    value = np.asarray(value) if isinstance(value, (list, tuple)) else value
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"state entry {name!r} has shape {tuple(value.shape)}, "
                         f"the model expects {tuple(shape)}")
    return value

"""``Function``: a differentiable operation, with ``forward`` and ``backward`` over arrays.

Subclass it and call ``MyOp.apply(*args)``. ``forward(ctx, *args)`` receives the arrays of the
Tensor arguments (other arguments as they are) and returns an array or a tuple of arrays;
``backward(ctx, *grads)`` receives the gradient of each output (None for an output nothing
used) and returns one gradient per argument of ``forward`` (None where there is none). ``ctx``
is the recorded call itself: keep what backward needs on it (``ctx.save_for_backward(...)``
and ``ctx.saved_tensor()``, or plain attributes), and ``ctx.needs_input_grad[i]`` tells
whether argument ``i`` needs a gradient. This is Chainer's ``FunctionNode`` and PyTorch's
``autograd.Function`` in one form; forward and backward work on arrays so that a backward can
launch a RawKernel directly (``PyLayer``, Paddle's form over Tensors, records one of these).

``op_type`` names the Paddle operator the function computes (``"matmul"``, ``"conv2d"``,
``"elementwise_add"``...): amp's white and black lists refer to these names
(``Function.op_types()`` lists every one defined). Under ``autocast`` a function with an
``op_type`` gets its floating inputs cast to the policy's dtype for it first.

A call is recorded only when recording is on and some Tensor argument requires a gradient;
otherwise forward runs and its outputs are plain leaves. On a GPU a NumPy array argument is
copied to the device first, so a model takes host batches as they come. Under Paddle's
``FLAGS_check_nan_inf`` every call's outputs are checked for inf and NaN (``nan_inf``).
"""
import itertools

import numpy as np

from ..core import backend
from . import autocast as _autocast
from . import grad_mode as _grad_mode
from . import nan_inf as _nan_inf
from .tensor import Tensor

_sequence = itertools.count()
_op_types = set()


class Edge:
    """What a recorded call keeps of an input computed by another call: where its gradient goes
    (``_node``, ``_index``) and its shape and dtype, not its values, which stay alive only if
    the call that made it or the user keeps them. (A leaf input, a parameter, is kept as the
    tensor itself: its gradient accumulates there.)"""

    __slots__ = ("_node", "_index", "shape", "dtype")

    def __init__(self, tensor):
        self._node = tensor._node
        self._index = tensor._index
        self.shape = tuple(tensor.data.shape)
        self.dtype = tensor.data.dtype


class Function:
    """Base of every differentiable operation (module docstring)."""

    op_type = None
    # Under FLAGS_check_nan_inf, the layers running when the call was recorded (nan_inf).
    _layers = ()
    # What a tensor's keeper packed of this call's saved arrays (``Tensor._keeper``): the
    # record its ``after_forward`` returned, unpacked by the engine before ``backward``.
    _packed = None
    # Gradient hooks of its outputs, ``{output index: [hook]}`` (``Tensor.register_hook``).
    _hooks = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("op_type"):
            _op_types.add(cls.op_type)

    @staticmethod
    def op_types():
        """Every ``op_type`` a Function defined so far names."""
        return frozenset(_op_types)

    def grad_buffer(self, position, shape, dtype):
        """In ``backward``: the array to write the gradient of argument ``position`` into
        directly, when that argument is a parameter whose gradient is zero so far and has this
        shape and dtype (returning the array itself then stores the gradient with no copy);
        None otherwise."""
        for index, tensor in self._inputs or ():
            if index == position:
                storage = (getattr(tensor, "zero_gradient_storage", None)
                           if tensor._node is None else None)
                return None if storage is None else storage(shape, dtype)
        return None

    def save_for_backward(self, *values):
        self._saved = values

    def saved_tensor(self):
        return self._saved

    @property
    def saved_tensors(self):
        return self._saved

    def forward(self, *args):
        raise NotImplementedError(f"{type(self).__name__} does not define forward")

    def backward(self, *grads):
        raise NotImplementedError(f"{type(self).__name__} does not define backward")

    @classmethod
    def apply(cls, *args, **kwargs):
        policy = _autocast._policy
        if policy is not None and cls.op_type is not None:
            dtype = policy.dtype_for(cls.op_type)
            if dtype is not None:
                args = tuple(_cast_input(a, dtype) for a in args)
        record = _grad_mode._enabled
        arrays = []
        inputs = []
        kept = None
        for position, arg in enumerate(args):
            if isinstance(arg, Tensor):
                if arg._keeper is None:
                    arrays.append(arg.data)
                else:
                    arrays.append(arg._keeper.fetch(arg))
                    kept = (kept or []) + [arg]
                if record and not arg.stop_gradient:
                    inputs.append((position, arg if arg._node is None else Edge(arg)))
            elif type(arg) is np.ndarray and backend.on_gpu():
                arrays.append(backend.asarray(arg))
            elif isinstance(arg, np.generic):
                # A NumPy scalar (np.sqrt(d), np.float64(0.5)) acts as a Python number does, as
                # in PyTorch and Paddle: it keeps a float32 tensor float32.
                arrays.append(arg.item())
            else:
                arrays.append(arg)
        node = cls.__new__(cls)
        node._saved = None
        if inputs:
            needs = [False] * len(args)
            for position, _ in inputs:
                needs[position] = True
            node.needs_input_grad = tuple(needs)
        else:
            node.needs_input_grad = (False,) * len(args)
        result = _bfloat16_kept(cls.forward(node, *arrays, **kwargs), arrays)
        if _nan_inf.enabled:
            node._layers = _nan_inf.running_layers()
            _nan_inf.check(node, result if isinstance(result, tuple) else (result,),
                           node._layers, "forward")
        if kept is not None and inputs:
            for keeper in {id(t._keeper): t._keeper for t in kept}.values():
                packed = keeper.after_forward(node)
                if packed is not None:
                    node._packed = packed
        if not inputs:
            if isinstance(result, tuple):
                return tuple(Tensor(r) for r in result)
            return Tensor(result)
        node._inputs = inputs
        node._seq = next(_sequence)
        if isinstance(result, tuple):
            node._n_outputs = len(result)
            outputs = []
            for index, array in enumerate(result):
                out = Tensor(array, stop_gradient=False)
                out._node = node
                out._index = index
                outputs.append(out)
            return tuple(outputs)
        node._n_outputs = 1
        out = Tensor(result, stop_gradient=False)
        out._node = node
        return out


class Cast(Function):
    """``x`` in ``dtype``; the gradient goes back in ``x``'s dtype."""

    op_type = "cast"

    def forward(self, x, dtype):
        self.source = x.dtype
        return x.astype(dtype)

    def backward(self, dy):
        return dy.astype(self.source), None


def _bfloat16_kept(result, arrays):
    """``result`` with its floating arrays in bfloat16 when a Python float is among the
    arguments and every floating input array is bfloat16. NumPy returns float32 for
    ml_dtypes' bfloat16 where a Python float takes part (``x * 0.5``), where float16 stays
    float16 (NEP 50's weak scalars); an operation keeps bfloat16 as it keeps float16."""
    if float not in map(type, arrays):
        return result
    floating = [a.dtype for a in arrays if hasattr(a, "dtype") and backend.is_floating(a.dtype)]
    # A kind "f" dtype is not bfloat16: tested first, as a dtype's name is slow to produce.
    if not floating or any(dtype.kind == "f" or dtype.name != "bfloat16" for dtype in floating):
        return result

    def kept(array):
        if hasattr(array, "dtype") and backend.is_floating(array.dtype) \
                and array.dtype != floating[0]:
            return array.astype(floating[0])
        return array
    return tuple(map(kept, result)) if isinstance(result, tuple) else kept(result)


def _cast_input(arg, dtype):
    """A floating Tensor or array argument in ``dtype`` (Tensors through a recorded cast)."""
    if isinstance(arg, Tensor):
        if backend.is_floating(arg.data.dtype) and arg.data.dtype != dtype:
            return Cast.apply(arg, dtype)
        return arg
    if hasattr(arg, "dtype") and getattr(arg, "ndim", 0) and backend.is_floating(arg.dtype) \
            and arg.dtype != dtype:
        return arg.astype(dtype)
    return arg

"""Paddle's ``paddle.autograd.PyLayer``: a differentiable operation written over Tensors.

    class Cube(PyLayer):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x ** 3

        @staticmethod
        def backward(ctx, dy):
            x, = ctx.saved_tensor()
            return 3 * x ** 2 * dy

    y = Cube.apply(x)

As in Paddle 2.x, ``forward`` runs with recording off and takes and returns Tensors (one, or a
tuple); ``backward`` gets one gradient Tensor per output (zeros for an output nothing used) and
returns one gradient per Tensor argument of ``forward``, in order (None for none), also with
recording off. The call is recorded as one node of the graph (``_PyLayerCall``), so the engine
visits it in the same order as any ``Function``. ``Function`` is the array-level form of the
same idea; ``PyLayer`` is the one Paddle scripts write.
"""
from ..core import backend
from .function import Function
from .grad_mode import no_grad
from .tensor import Tensor


class PyLayerContext:
    """The ``ctx`` of ``forward`` and ``backward``: ``save_for_backward(*tensors)`` and
    ``saved_tensor()``; any other attribute a user sets is kept too."""

    def __init__(self):
        self._saved = ()

    def save_for_backward(self, *tensors):
        self._saved = tensors

    def saved_tensor(self):
        return self._saved


class _PyLayerCall(Function):
    """The recorded node of one ``PyLayer.apply``: its forward hands on the arrays ``forward``
    made; its backward calls the layer's ``backward`` over Tensors."""

    def forward(self, *arrays, layer, ctx, outputs, tensor_positions):
        self.layer, self.ctx, self.tensor_positions = layer, ctx, tensor_positions
        self.out_shapes = [(o.shape, o.dtype) for o in outputs]
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def backward(self, *grads):
        xp = backend.array_module()
        grads = [Tensor(xp.zeros(shape, dtype) if g is None else g)
                 for g, (shape, dtype) in zip(grads, self.out_shapes)]
        with no_grad():
            given = self.layer.backward(self.ctx, *grads)
        given = given if isinstance(given, (tuple, list)) else (given,)
        if len(given) != len(self.tensor_positions):
            raise ValueError(f"{self.layer.__name__}.backward returned {len(given)} "
                             f"gradient(s); forward took {len(self.tensor_positions)} Tensor "
                             "argument(s), and backward returns one gradient (or None) for "
                             "each, in order")
        result = [None] * len(self.needs_input_grad)
        for position, grad in zip(self.tensor_positions, given):
            result[position] = None if grad is None else getattr(grad, "data", grad)
        return tuple(result)


class PyLayer:
    """Base of a user's operation: define the static methods ``forward(ctx, *args,
    **kwargs)`` and ``backward(ctx, *grads)`` and call ``apply`` (module docstring)."""

    @staticmethod
    def forward(ctx, *args, **kwargs):
        raise NotImplementedError("a PyLayer defines forward(ctx, ...)")

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("a PyLayer defines backward(ctx, *grads)")

    @classmethod
    def apply(cls, *args, **kwargs):
        ctx = PyLayerContext()
        with no_grad():
            result = cls.forward(ctx, *args, **kwargs)
        single = not isinstance(result, (tuple, list))
        outputs = [result] if single else list(result)
        for index, output in enumerate(outputs):
            if not isinstance(output, Tensor):
                raise TypeError(f"{cls.__name__}.forward returned a {type(output).__name__} "
                                f"as output {index}; a PyLayer's forward returns Tensors")
        positions = tuple(i for i, a in enumerate(args) if isinstance(a, Tensor))
        made = _PyLayerCall.apply(*args, layer=cls, ctx=ctx,
                                  outputs=[o.data for o in outputs], tensor_positions=positions)
        return made if single else made if isinstance(made, tuple) else (made,)

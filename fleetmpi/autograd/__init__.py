"""Define-by-run autograd over the backend's arrays: ``Tensor``, ``Function``, ``PyLayer``
(Paddle's ``paddle.autograd.PyLayer``), ``no_grad``, the elementary operations, and
``recompute``."""
from ..core.paddle_names import module_getattr as _module_getattr
from . import operations
from .autocast import autocast
from .engine import run_backward
from .function import Cast, Function
from .nan_inf import NonFiniteError
from .grad_mode import enable_grad, is_grad_enabled, no_grad
from .operations import (abs, add, cast, concat, divide, exp, gather, log, matmul, max, mean,
                         multiply, reshape, sigmoid, split, sqrt, stack, subtract, sum, tanh,
                         transpose)
from .py_layer import PyLayer, PyLayerContext
from .tensor import Tensor, as_array, to_tensor

__all__ = [
    "abs", "add", "as_array", "autocast", "Cast", "cast", "concat", "divide", "enable_grad",
    "exp", "Function", "gather", "is_grad_enabled", "log", "matmul", "max", "mean", "multiply",
    "no_grad", "NonFiniteError", "operations", "PyLayer", "PyLayerContext", "reshape",
    "run_backward", "sigmoid", "split", "sqrt", "stack", "subtract", "sum", "tanh", "Tensor",
    "to_tensor", "transpose",
]


# A name Paddle has and fleetmpi lacks raises an error that says so (core.paddle_names).
__getattr__ = _module_getattr(__name__, "paddle.autograd", globals())

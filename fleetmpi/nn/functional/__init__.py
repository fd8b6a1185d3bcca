"""``fleetmpi.nn.functional``: the differentiable operations layers are built from (Paddle's
``paddle.nn.functional``). Each takes Tensors or plain NumPy/CuPy arrays and returns a Tensor.
"""
from ...core.paddle_names import module_getattr as _module_getattr
from ...autograd.operations import sigmoid, tanh
from .activation import activation, gelu, log_softmax, relu, softmax
from .attention import scaled_dot_product_attention
from .conv import adaptive_avg_pool2d, avg_pool2d, conv2d, global_avg_pool, max_pool2d
from .common import dropout, dropout_add, embedding, linear, linear_activation
from .norm import batch_norm, layer_norm
from .loss import cross_entropy, mse_loss, nll_loss
from .pointwise_loss import binary_cross_entropy_with_logits, l1_loss, smooth_l1_loss
from .tensor_parallel import (copy_to_model_parallel, gather_from_model_parallel,
                              parallel_cross_entropy, reduce_from_model_parallel,
                              scatter_to_model_parallel)

__all__ = [
    "activation", "adaptive_avg_pool2d", "avg_pool2d", "batch_norm",
    "binary_cross_entropy_with_logits", "conv2d", "copy_to_model_parallel", "cross_entropy",
    "dropout", "dropout_add", "embedding", "gather_from_model_parallel", "gelu",
    "global_avg_pool", "l1_loss", "layer_norm", "linear", "linear_activation", "log_softmax",
    "max_pool2d", "mse_loss", "nll_loss", "parallel_cross_entropy",
    "reduce_from_model_parallel", "relu", "scaled_dot_product_attention",
    "scatter_to_model_parallel", "sigmoid", "smooth_l1_loss", "softmax", "tanh",
]


# A name Paddle has and fleetmpi lacks raises an error that says so (core.paddle_names).
__getattr__ = _module_getattr(__name__, "paddle.nn.functional", globals())

"""``fleetmpi.nn``: layers with explicit forward and backward on the backend array module,
parameters and gradients held in flat buffers, and ready-made models."""
from .containers import ResidualBlock, Sequential
from .conv import AvgPool2D, Conv2D, GlobalAvgPool, MaxPool2D
from .flat import FlatBuffer, flatten
from .layer import Layer, get_default_dtype, set_default_dtype
from .layers import GELU, Activation, Dropout, Embedding, Flatten, Linear, ReLU, Tanh
from .loss import SoftmaxCrossEntropy
from .models import MLP, basic_block, bottleneck_block, resnet20, resnet50, resnet101
from .norm import BatchNorm, BatchNorm1D, BatchNorm2D
from .parameter import Parameter

__all__ = [
    "Activation", "AvgPool2D", "BatchNorm", "BatchNorm1D", "BatchNorm2D", "Conv2D", "Dropout",
    "Embedding", "FlatBuffer", "Flatten", "GELU", "GlobalAvgPool", "Layer", "Linear", "MLP",
    "MaxPool2D", "Parameter", "ReLU", "ResidualBlock", "SoftmaxCrossEntropy", "Sequential",
    "Tanh", "basic_block", "bottleneck_block", "flatten", "get_default_dtype", "resnet20",
    "resnet50", "resnet101", "set_default_dtype",
]

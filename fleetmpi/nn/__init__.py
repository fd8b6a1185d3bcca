"""``fleetmpi.nn``: ``Layer`` (models as Paddle dygraph users write them), the built-in layers
over ``fleetmpi.nn.functional``, parameters held in flat buffers, and ready-made models."""
from ..core.paddle_names import module_getattr as _module_getattr
from . import creation, functional, initializer, lazy
from ..optimizer.clip import ClipGradByGlobalNorm, ClipGradByNorm
from .containers import LayerDict, LayerList, ResidualBlock, Sequential
from .conv import AdaptiveAvgPool2D, AvgPool2D, Conv2D, GlobalAvgPool, MaxPool2D
from .flat import FlatBuffer, flatten
from .gpt import gpt_pipeline
from .layer import Layer, get_default_dtype, set_default_dtype
from .basic_layers import (GELU, Activation, Dropout, Embedding, Flatten, Linear, ReLU, Sigmoid,
                           Softmax, Tanh)
from .loss import (BCEWithLogitsLoss, CrossEntropyLoss, L1Loss, MSELoss, NLLLoss,
                   SmoothL1Loss)
from .models import GPT, MLP, basic_block, bottleneck_block, resnet20, resnet50, resnet101
from .norm import BatchNorm, BatchNorm1D, BatchNorm2D, BatchNorm3D, LayerNorm
from .parameter import Parameter
from .rnn import GRU, LSTM
from .transformer import MultiHeadAttention, TransformerEncoder, TransformerEncoderLayer
from .tensor_parallel import (ColumnParallelLinear, ParallelCrossEntropy, RowParallelLinear,
                              VocabParallelEmbedding)

__all__ = [
    "Activation", "AdaptiveAvgPool2D", "AvgPool2D", "BatchNorm", "BatchNorm1D", "BatchNorm2D",
    "BatchNorm3D", "BCEWithLogitsLoss", "ClipGradByGlobalNorm", "ClipGradByNorm",
    "ColumnParallelLinear", "Conv2D", "CrossEntropyLoss", "Dropout", "Embedding", "FlatBuffer",
    "Flatten", "GELU", "GlobalAvgPool", "GPT", "GRU", "L1Loss", "Layer", "LayerDict",
    "LayerList", "LayerNorm", "Linear", "LSTM", "MaxPool2D", "MLP", "MSELoss",
    "MultiHeadAttention", "NLLLoss", "ParallelCrossEntropy", "Parameter", "ReLU",
    "ResidualBlock", "RowParallelLinear", "Sequential", "Sigmoid", "SmoothL1Loss", "Softmax",
    "Tanh", "TransformerEncoder", "TransformerEncoderLayer", "VocabParallelEmbedding",
    "basic_block", "bottleneck_block", "creation", "flatten", "functional",
    "get_default_dtype", "gpt_pipeline", "initializer", "lazy", "resnet101", "resnet20",
    "resnet50", "set_default_dtype",
]


# A name Paddle has and fleetmpi lacks raises an error that says so (core.paddle_names).
__getattr__ = _module_getattr(__name__, "paddle.nn", globals())

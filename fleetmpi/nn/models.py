"""Ready-made models: ``MLP``, the CIFAR-style ``resnet20``, ImageNet ``resnet50`` and the
GPT-style decoder ``GPT`` (in ``fleetmpi.nn.gpt``)."""
from .containers import ResidualBlock, Sequential
from .conv import Conv2D, MaxPool2D
from .gpt import GPT
from .basic_layers import GELU, Dropout, Linear, ReLU, Tanh
from .norm import BatchNorm2D

__all__ = ["GPT", "MLP", "basic_block", "bottleneck_block", "conv_bn", "resnet20", "resnet50",
           "resnet101"]

_ACTIVATIONS = {"relu": ReLU, "tanh": Tanh, "gelu": GELU}


class MLP(Sequential):
    """Linear layers of the given ``sizes`` (input, hidden..., output) with an activation (and
    optional dropout) between them; layers are named ``fc0``, ``act0``, ``drop0``, ``fc1``..."""

    def __init__(self, sizes, activation="relu", dropout=0.0, dtype=None):
        if len(sizes) < 2:
            raise ValueError(f"MLP sizes must list at least an input and an output size, "
                             f"got {sizes!r}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"MLP activation {activation!r} is not one of "
                             f"{sorted(_ACTIVATIONS)}")
        layers = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append((f"fc{i}", Linear(fan_in, fan_out, dtype=dtype)))
            if i < len(sizes) - 2:
                layers.append((f"act{i}", _ACTIVATIONS[activation]()))
                if dropout:
                    layers.append((f"drop{i}", Dropout(dropout)))
        super().__init__(*layers)


def conv_bn(in_channels, out_channels, kernel_size, stride, relu, dtype):
    """Conv2D (no bias) + BatchNorm2D (+ ReLU) as named layers."""
    layers = [("conv", Conv2D(in_channels, out_channels, kernel_size, stride,
                              kernel_size // 2, bias_attr=False, dtype=dtype)),
              ("bn", BatchNorm2D(out_channels, dtype=dtype))]
    if relu:
        layers.append(("relu", ReLU()))
    return layers


def _shortcut(in_channels, out_channels, stride, dtype):
    if stride == 1 and in_channels == out_channels:
        return None
    return Sequential(*conv_bn(in_channels, out_channels, 1, stride, False, dtype))


def basic_block(in_channels, out_channels, stride=1, dtype=None):
    """The two-3x3-convolution residual block of ResNet-18/20/34."""
    body = Sequential(*[(f"{name}1", layer) for name, layer in
                        conv_bn(in_channels, out_channels, 3, stride, True, dtype)],
                      *[(f"{name}2", layer) for name, layer in
                        conv_bn(out_channels, out_channels, 3, 1, False, dtype)])
    return ResidualBlock(body, _shortcut(in_channels, out_channels, stride, dtype))


def bottleneck_block(in_channels, width, stride=1, dtype=None):
    """The 1x1-3x3-1x1 residual block of ResNet-50, output ``4 * width`` channels."""
    out_channels = 4 * width
    body = Sequential(*[(f"{name}1", layer) for name, layer in
                        conv_bn(in_channels, width, 1, 1, True, dtype)],
                      *[(f"{name}2", layer) for name, layer in
                        conv_bn(width, width, 3, stride, True, dtype)],
                      *[(f"{name}3", layer) for name, layer in
                        conv_bn(width, out_channels, 1, 1, False, dtype)])
    return ResidualBlock(body, _shortcut(in_channels, out_channels, stride, dtype))


def _head(in_features, num_classes, dtype):
    from .conv import GlobalAvgPool

    return [("pool", GlobalAvgPool()), ("fc", Linear(in_features, num_classes, dtype=dtype))]


def resnet20(num_classes=10, in_channels=3, dtype=None):
    """ResNet-20 for 32x32 images (He et al. 2016, section 4.2): a 3x3 stem of 16 channels,
    three stages of three basic blocks (16, 32, 64 channels), global pooling, a linear head."""
    layers = [(f"stem_{name}", layer) for name, layer in conv_bn(in_channels, 16, 3, 1, True,
                                                                  dtype)]
    channels = 16
    for stage, width in enumerate((16, 32, 64)):
        for block in range(3):
            stride = 2 if stage > 0 and block == 0 else 1
            layers.append((f"stage{stage + 1}_block{block}",
                           basic_block(channels, width, stride, dtype)))
            channels = width
    return Sequential(*layers, *_head(channels, num_classes, dtype))


def _bottleneck_resnet(blocks_per_stage, num_classes, in_channels, dtype):
    """A 7x7/2 stem and 3x3/2 max pool, four stages of bottleneck blocks (widths 64 to 512,
    ``blocks_per_stage`` blocks each), global pooling, a linear head."""
    layers = [(f"stem_{name}", layer) for name, layer in conv_bn(in_channels, 64, 7, 2, True,
                                                                  dtype)]
    layers.append(("stem_pool", MaxPool2D(3, 2, 1)))
    channels = 64
    for stage, (width, blocks) in enumerate(zip((64, 128, 256, 512), blocks_per_stage)):
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            layers.append((f"stage{stage + 1}_block{block}",
                           bottleneck_block(channels, width, stride, dtype)))
            channels = 4 * width
    return Sequential(*layers, *_head(channels, num_classes, dtype))


def resnet50(num_classes=1000, in_channels=3, dtype=None):
    """ResNet-50 for 224x224 images: stages of 3, 4, 6, 3 bottleneck blocks."""
    return _bottleneck_resnet((3, 4, 6, 3), num_classes, in_channels, dtype)


def resnet101(num_classes=1000, in_channels=3, dtype=None):
    """ResNet-101 for 224x224 images: stages of 3, 4, 23, 3 bottleneck blocks."""
    return _bottleneck_resnet((3, 4, 23, 3), num_classes, in_channels, dtype)

"""The models ``train_throughput.py`` trains: per-rank batch, input, optimizer and the
precisions a GPU run measures, each model's sizes, and fleetmpi's builder of it.

GPT-2 small (``gpt2``) and ResNet-50 are GPU models: on the CPU ResNet-50 trains a batch of 8
and GPT-2 runs scaled down (2 layers of GPT-2's width per head, 128 tokens, the whole
vocabulary), its description saying so.
"""
from dataclasses import dataclass, replace

MLP_SIZES = (784, 1024, 1024, 10)
# nn.GPT's keyword arguments.
GPT_TINY = {"vocab_size": 96, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128}
GPT2_SMALL = {"vocab_size": 50257, "block_size": 1024, "n_layer": 12, "n_head": 12,
              "n_embd": 768}
GPT2_SCALED = {"vocab_size": 50257, "block_size": 128, "n_layer": 2, "n_head": 2,
               "n_embd": 128}
# Each optimizer's settings, for both trainers (PyTorch's ``lr`` is ``learning_rate``); the rest
# are both trainers' defaults (Adam's betas 0.9 and 0.999, epsilon 1e-8).
OPTIMIZERS = {"momentum": {"learning_rate": 0.01, "momentum": 0.9},
              "adamw": {"learning_rate": 1e-4, "weight_decay": 0.01}}


@dataclass(frozen=True)
class ModelSpec:
    """One model as the benchmark trains it. ``sample``: one sample's input shape (a GPT's
    is its ``block_size`` tokens); ``classes``: labels, or a GPT's vocabulary;
    ``steps_scale``: measured steps as a share of ``--steps``; ``precisions``: what a GPU
    run measures unless told otherwise; ``gpt``: nn.GPT's sizes, None for the others."""

    title: str
    batch: int
    sample: tuple
    classes: int
    warmup: int
    steps_scale: float
    optimizer: str
    precisions: tuple
    one_rank: bool = False
    gpt: dict = None


MODELS = {
    "mlp": ModelSpec("MLP " + "-".join(map(str, MLP_SIZES)), 128, (784,), 10, 5, 1.0,
                     "momentum", ("fp32", "amp-fp16")),
    "resnet20": ModelSpec("ResNet-20 (3x32x32)", 32, (3, 32, 32), 10, 2, 0.2, "momentum",
                          ("fp32", "amp-fp16")),
    "gpt": ModelSpec("GPT-tiny", 16, (GPT_TINY["block_size"],), GPT_TINY["vocab_size"], 3,
                     0.5, "adamw", ("fp32", "amp-fp16"), gpt=GPT_TINY),
    "gpt2": ModelSpec("GPT-2 small", 8, (GPT2_SMALL["block_size"],), GPT2_SMALL["vocab_size"],
                      1, 0.1, "adamw", ("amp-fp16", "amp-bf16"), one_rank=True,
                      gpt=GPT2_SMALL),
    "resnet50": ModelSpec("ResNet-50 (3x224x224)", 64, (3, 224, 224), 1000, 2, 0.1,
                          "momentum", ("amp-fp16",), one_rank=True),
}
# What changes on the CPU, where the GPU sizes would take minutes a step.
ON_THE_CPU = {
    "gpt2": {"title": "GPT-2-shaped, scaled down for the CPU", "batch": 2,
             "sample": (GPT2_SCALED["block_size"],), "gpt": GPT2_SCALED},
    "resnet50": {"batch": 8},
}


def spec(name, device):
    """The ``ModelSpec`` of model ``name`` on ``device`` ("cpu" or "gpu")."""
    found = MODELS[name]
    return replace(found, **ON_THE_CPU.get(name, {})) if device == "cpu" else found


def describe(name, device):
    """What the model is, in words: its title and, for a GPT, its sizes."""
    model = spec(name, device)
    if model.gpt is None:
        return model.title
    sizes = model.gpt
    return (f"{model.title}: {sizes['n_layer']} layers, {sizes['n_embd']} wide, "
            f"{sizes['n_head']} heads, sequence {sizes['block_size']}, vocabulary "
            f"{sizes['vocab_size']}, tied embedding")


def unit(name, device):
    """What one sample is in the rates: a GPT's is a sequence of ``block_size`` tokens."""
    model = spec(name, device)
    if model.gpt is None:
        return "samples/s"
    return f"sequences/s ({model.gpt['block_size']} tokens)"


def our_model(name, device):
    """fleetmpi's model ``name``."""
    from fleetmpi import nn

    model = spec(name, device)
    if model.gpt is not None:
        return nn.GPT(**model.gpt)
    if name == "mlp":
        return nn.MLP(list(MLP_SIZES))
    if name == "resnet20":
        return nn.resnet20()
    return nn.resnet50()

"""fleetmpi's models written with ``torch.nn``: the same layers and sizes (the GPT with a tied
embedding, ``scaled_dot_product_attention``, tanh GELU and GPT-2's initial weights), for
PyTorch's side of the table."""
import math

from .models import MLP_SIZES, spec


def torch_gpt(vocab_size, block_size, n_layer, n_head, n_embd):
    """``nn.GPT`` written with ``torch.nn``: the same layers, sizes and tied embedding."""
    import torch
    import torch.nn as tnn
    import torch.nn.functional as TF

    class TorchGPTBlock(tnn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = tnn.LayerNorm(n_embd), tnn.LayerNorm(n_embd)
            self.qkv, self.proj = tnn.Linear(n_embd, 3 * n_embd), tnn.Linear(n_embd, n_embd)
            self.fc, self.fc_proj = tnn.Linear(n_embd, 4 * n_embd), tnn.Linear(4 * n_embd, n_embd)

        def forward(self, x):
            batch, seq, width = x.shape
            q, k, v = (t.reshape(batch, seq, n_head, width // n_head).transpose(1, 2)
                       for t in self.qkv(self.ln1(x)).split(width, dim=-1))
            y = TF.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(batch, seq, width))
            return x + self.fc_proj(TF.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class TorchGPT(tnn.Module):
        def __init__(self):
            super().__init__()
            self.wte = tnn.Embedding(vocab_size, n_embd)
            self.wpe = tnn.Embedding(block_size, n_embd)
            self.blocks = tnn.ModuleList(TorchGPTBlock() for _ in range(n_layer))
            self.ln_f = tnn.LayerNorm(n_embd)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            return (self.ln_f(x) @ self.wte.weight.T).reshape(-1, vocab_size)

    model = TorchGPT()
    _initialize_as_gpt2(model, n_layer)
    return model


def _initialize_as_gpt2(model, n_layer):
    """``nn.GPT``'s initial weights: normal(0, 0.02), the projections back into the residual
    stream (``proj``, ``fc_proj``) scaled by ``1 / sqrt(2 * n_layer)``, biases zero."""
    import torch

    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                residual = name.endswith("proj")
                module.weight.normal_(0.0, 0.02 / math.sqrt(2 * n_layer) if residual else 0.02)
            if isinstance(module, torch.nn.Linear):
                module.bias.zero_()


def torch_mlp():
    import torch.nn as tnn

    layers = []
    for i, (a, b) in enumerate(zip(MLP_SIZES[:-1], MLP_SIZES[1:])):
        layers.append(tnn.Linear(a, b))
        if i < len(MLP_SIZES) - 2:
            layers.append(tnn.ReLU())
    return tnn.Sequential(*layers)


def torch_resnet20():
    """``nn.resnet20`` written with ``torch.nn``."""
    import torch.nn as tnn

    class Block(tnn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.body = tnn.Sequential(
                tnn.Conv2d(cin, cout, 3, stride, 1, bias=False), tnn.BatchNorm2d(cout),
                tnn.ReLU(), tnn.Conv2d(cout, cout, 3, 1, 1, bias=False), tnn.BatchNorm2d(cout))
            self.shortcut = (tnn.Sequential(tnn.Conv2d(cin, cout, 1, stride, bias=False),
                                            tnn.BatchNorm2d(cout))
                             if stride != 1 or cin != cout else tnn.Identity())
            self.relu = tnn.ReLU()

        def forward(self, x):
            return self.relu(self.body(x) + self.shortcut(x))

    layers = [tnn.Conv2d(3, 16, 3, 1, 1, bias=False), tnn.BatchNorm2d(16), tnn.ReLU()]
    cin = 16
    for stage, width in enumerate((16, 32, 64)):
        for block in range(3):
            layers.append(Block(cin, width, 2 if stage > 0 and block == 0 else 1))
            cin = width
    layers += [tnn.AdaptiveAvgPool2d(1), tnn.Flatten(), tnn.Linear(64, 10)]
    return tnn.Sequential(*layers)


def torch_resnet50():
    """``nn.resnet50`` written with ``torch.nn``: the stride in each block's 3x3 convolution,
    a 1x1 convolution and batch norm on the shortcut where the shape changes."""
    import torch.nn as tnn

    def conv_bn(cin, cout, kernel, stride, relu):
        layers = [tnn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False),
                  tnn.BatchNorm2d(cout)]
        return layers + [tnn.ReLU()] if relu else layers

    class Bottleneck(tnn.Module):
        def __init__(self, cin, width, stride):
            super().__init__()
            cout = 4 * width
            self.body = tnn.Sequential(*conv_bn(cin, width, 1, 1, True),
                                       *conv_bn(width, width, 3, stride, True),
                                       *conv_bn(width, cout, 1, 1, False))
            self.shortcut = (tnn.Sequential(*conv_bn(cin, cout, 1, stride, False))
                             if stride != 1 or cin != cout else tnn.Identity())
            self.relu = tnn.ReLU()

        def forward(self, x):
            return self.relu(self.body(x) + self.shortcut(x))

    layers = conv_bn(3, 64, 7, 2, True) + [tnn.MaxPool2d(3, 2, 1)]
    channels = 64
    for stage, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3))):
        for block in range(blocks):
            layers.append(Bottleneck(channels, width, 2 if stage > 0 and block == 0 else 1))
            channels = 4 * width
    layers += [tnn.AdaptiveAvgPool2d(1), tnn.Flatten(), tnn.Linear(channels, 1000)]
    return tnn.Sequential(*layers)


def torch_model(name, device):
    """PyTorch's model ``name`` (on the host; the caller moves it)."""
    model = spec(name, device)
    if model.gpt is not None:
        return torch_gpt(**model.gpt)
    builders = {"mlp": torch_mlp, "resnet20": torch_resnet20, "resnet50": torch_resnet50}
    return builders[name]()

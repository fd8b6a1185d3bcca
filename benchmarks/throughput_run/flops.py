"""Model FLOP utilisation: a GPT's FLOPs per token, and the peak of the device it ran on.

Per token, a training step of a GPT does ``6 N + 12 L S W`` FLOPs (Chowdhery et al. 2022,
PaLM, appendix B): ``6 N`` for the forward and backward matrix products with the ``N``
weights that multiply (every parameter but the position embedding, whose rows are only
looked up; the tied token embedding once, as the output projection), and ``12 L S W`` for
attention's score and value products over ``L`` layers, ``S`` tokens of context and width
``W``. MFU is those FLOPs at the measured tokens/s over the device's peak.
"""
from .models import spec

FORMULA = ("6 N + 12 L S W FLOPs per token (PaLM's; N the parameters that multiply: all but "
           "the position embedding, the tied embedding once)")
# Dense peak FLOP/s of NVIDIA's datasheets (their sparse figures halved): 16-bit tensor cores
# (float16 and bfloat16), and float32 without tensor cores (neither trainer turns TF32 on).
# The first entry whose text the device's name contains applies.
PEAK_FLOPS = (
    ("H100 PCIe", {"16-bit": 756e12, "fp32": 51e12}),
    ("H100 NVL", {"16-bit": 835e12, "fp32": 60e12}),
    ("H100", {"16-bit": 989e12, "fp32": 67e12}),
    ("H200 NVL", {"16-bit": 835e12, "fp32": 60e12}),
    ("H200", {"16-bit": 989e12, "fp32": 67e12}),
)


def peak_flops(device_name, precision):
    """The peak FLOP/s of ``device_name`` in ``precision``, or None for an unknown device."""
    kind = "fp32" if precision == "fp32" else "16-bit"
    for text, peaks in PEAK_FLOPS:
        if text in (device_name or ""):
            return peaks[kind]
    return None


def gpt_parameters(vocab_size, block_size, n_layer, n_head, n_embd):
    """``nn.GPT``'s parameter count: embeddings, per block two LayerNorms, the query-key-value
    and output projections and the 4x MLP (``12 W^2 + 13 W``), and the final LayerNorm."""
    width = n_embd
    return (vocab_size + block_size) * width + n_layer * (12 * width ** 2 + 13 * width) \
        + 2 * width


def gpt_flops_per_token(vocab_size, block_size, n_layer, n_head, n_embd):
    """``6 N + 12 L S W`` (module docstring) for a GPT of these sizes, over full sequences."""
    multiplying = gpt_parameters(vocab_size, block_size, n_layer, n_head, n_embd) \
        - block_size * n_embd
    return 6 * multiplying + 12 * n_layer * block_size * n_embd


def achieved_flops(model, device, samples_per_s):
    """The FLOP/s that ``samples_per_s`` of GPT ``model`` amount to; None for the others."""
    sizes = spec(model, device).gpt
    if sizes is None or samples_per_s is None:
        return None
    return samples_per_s * sizes["block_size"] * gpt_flops_per_token(**sizes)


def mfu(flops, peak):
    """``flops`` over ``peak``, or None where either is unknown."""
    if flops is None or peak is None:
        return None
    return flops / peak

"""amp's step against the float32 step: the gradients of a float16 step (``auto_cast`` with
the amp strategy's lists, loss scale 32768), divided by the loss scale, are the float32 step's
to float16 rounding, for the benchmark models of ``test_gpu_stand_in.py`` from the same seed
and batch.

Where a model has ReLUs, that holds once both steps switch the same gradient elements on.
ReLU's derivative jumps at zero, so a step's gradients are not a continuous function of the
roundings before it: float16 moves the ReLU inputs that lie within its rounding of zero to the
other side (measured: 180 of ResNet-20's 376,832 at a batch of 2, 9 of the MLP's 65,536), and
each one switches its element's gradient on or off. That moves ResNet-20's weight gradients by
up to 37% of a layer's largest element (12% in the median layer) and the MLP's by 17%. It is
float16's, not this trainer's: PyTorch's float16 autocast on the same ResNet-20, weights and
batch is 37% off its float32 step, and so is a float64 reference that rounds each
convolution's and product's operands and results to float16. The steps compared here
therefore share the float32 step's ReLU masks (``relu_masks``); then ResNet-20's amp gradients
are within 1.3e-2 of the largest of their layer (a batch norm weight's; its convolutions'
within 8e-3), the MLP's within 1.1e-3, and GPT-tiny's (GELU, no jump) within 4e-3 without any
mask. The tolerance is 2e-2. The numbers are the same under each of OpenBLAS's kernels, as the
host's float16 products are (``fleetmpi/kernels/products.py``).
"""
import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi import amp, nn
from fleetmpi.core import backend
from fleetmpi.nn.functional.activation import ReLU

from test_gpu_stand_in import MODELS, model_data

LOSS_SCALE = 32768.0  # the amp strategy's init_loss_scaling
TOLERANCE = 2e-2  # of the largest gradient element of each parameter


@pytest.fixture
def relu_masks(monkeypatch):
    """``(recorded, imposed)``: every ReLU's forward appends ``input > 0`` to ``recorded``;
    while ``imposed`` holds masks, the ReLUs of a step use them instead, in call order, and
    backward passes the gradient where its mask is True."""
    recorded, imposed = [], []
    forward = ReLU.forward

    def masked_forward(node, x):
        node.mask = imposed.pop(0) if imposed else x > 0
        recorded.append(x > 0)
        return forward(node, x)

    monkeypatch.setattr(ReLU, "forward", masked_forward)
    monkeypatch.setattr(ReLU, "backward", lambda node, dy: dy * node.mask)
    return recorded, imposed


def gradients(name, precision):
    """The gradients of one step of ``name`` from seed 0 on its batch, in float32 or under
    ``auto_cast`` with a ``GradScaler`` (divided by its scale)."""
    backend.manual_seed(0)
    model = MODELS[name][0]()
    x, y = (fleet.to_tensor(a) for a in model_data(name))
    scaler = amp.GradScaler(init_loss_scaling=LOSS_SCALE, enable=precision == "amp")
    with amp.auto_cast(enable=precision == "amp"):
        loss = nn.CrossEntropyLoss()(model(x), y)
    scaler.scale(loss).backward()
    scale = LOSS_SCALE if precision == "amp" else 1.0
    return [p.grad.numpy().astype(np.float64) / scale for p in model.parameters()]


@pytest.mark.parametrize("name", ["mlp", "gpt", "resnet20"])
def test_amp_gradients_are_the_float32_steps_to_float16_rounding(name, relu_masks):
    recorded, imposed = relu_masks
    expected = gradients(name, "fp32")
    masks = list(recorded)
    imposed.extend(masks)
    got = gradients(name, "amp")
    assert not imposed  # every ReLU of the amp step took the float32 step's mask
    # the masks the amp step's own inputs gave: few elements on the other side of zero
    changed = sum(int((mask != own).sum()) for mask, own in zip(masks, recorded[len(masks):]))
    assert changed <= 1e-3 * sum(mask.size for mask in masks)
    for index, (a, b) in enumerate(zip(got, expected)):
        scale = float(np.abs(b).max())
        np.testing.assert_allclose(a / scale, b / scale, atol=TOLERANCE, err_msg=f"grad {index}")

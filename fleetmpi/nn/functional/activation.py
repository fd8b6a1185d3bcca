"""Activations and softmax."""
from ...core import backend
from ...autograd import Function
from ...autograd.operations import Tanh
from ...kernels import reference


class Activation(Function):
    """An elementwise activation of ``fleetmpi.kernels.reference`` by name (``act``)."""

    act = None

    def forward(self, x):
        xp = backend.array_module()
        self.x = x if self.act in reference.INPUT_ACTIVATIONS else None
        self.y = reference.activation_forward(x, self.act, xp)
        return self.y

    def backward(self, dy):
        return reference.activation_backward(dy, self.y, self.x, self.act,
                                             backend.array_module())


class ReLU(Activation):
    act = op_type = "relu"


class GELU(Activation):
    """GELU in its tanh approximation (Paddle's ``approximate=True``)."""

    act = op_type = "gelu"


class Softmax(Function):
    op_type = "softmax"

    def forward(self, x, axis):
        xp = backend.array_module()
        shifted = x - x.max(axis=axis, keepdims=True)
        e = xp.exp(shifted)
        self.y, self.axis = e / e.sum(axis=axis, keepdims=True), axis
        return self.y

    def backward(self, dy):
        y = self.y
        return y * (dy - (dy * y).sum(axis=self.axis, keepdims=True)), None


class LogSoftmax(Function):
    op_type = "log_softmax"

    def forward(self, x, axis):
        xp = backend.array_module()
        shifted = x - x.max(axis=axis, keepdims=True)
        self.y = shifted - xp.log(xp.exp(shifted).sum(axis=axis, keepdims=True))
        self.axis = axis
        return self.y

    def backward(self, dy):
        xp = backend.array_module()
        return dy - xp.exp(self.y) * dy.sum(axis=self.axis, keepdims=True), None


ACTIVATION_FUNCTIONS = {"relu": ReLU, "gelu": GELU, "tanh": Tanh}


def relu(x):
    return ReLU.apply(x)


def gelu(x, approximate=True):
    if not approximate:
        raise ValueError("gelu(approximate=False) needs erf, which this trainer does not "
                         "compute on every backend; use approximate=True (the tanh form)")
    return GELU.apply(x)


def activation(x, act):
    """``act`` (``"relu"``, ``"tanh"`` or ``"gelu"``) of ``x``."""
    reference.check_activation(act)
    return ACTIVATION_FUNCTIONS[act].apply(x)


def softmax(x, axis=-1):
    return Softmax.apply(x, axis)


def log_softmax(x, axis=-1):
    return LogSoftmax.apply(x, axis)

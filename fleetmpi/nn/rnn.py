"""Paddle's recurrent layers ``LSTM`` and ``GRU``, with Paddle 2.5's arguments, gate layouts,
parameter names and shapes, so a Paddle ``state_dict`` loads as it is.

Each layer and direction owns ``weight_ih_l{k}`` ``(gates * hidden_size, input)``,
``weight_hh_l{k}`` ``(gates * hidden_size, hidden_size)``, ``bias_ih_l{k}`` and
``bias_hh_l{k}`` ``(gates * hidden_size,)`` (``_reverse`` appended for the backward direction
of a bidirectional layer), every one drawn from ``U(-1/sqrt(hidden_size), 1/sqrt(hidden_size))``.
The gates are stacked in Paddle's order: LSTM ``i, f, c, o``
(``c = f * c' + i * tanh(g_c)``, ``h = o * tanh(c)``); GRU ``r, z, c`` with the reset gate
applied after the hidden product (``c = tanh(x_c + r * h_c)``, ``h = z * h' + (1 - z) * c``).

A step is composed from the recorded Tensor operations, so backward is the autograd engine's
(the graph holds one node per operation and step: for the short sequences of tests and small
models, not for long ones at speed).
"""
import math

from ..autograd import Tensor, concat, matmul, sigmoid, split, stack, tanh
from ..core import backend
from . import functional as F
from . import initializer
from .basic_layers import check_positive_int
from .layer import Layer
from .param_attr import to_attr

DIRECTIONS = {"forward": 1, "bidirect": 2, "bidirectional": 2}


def _lstm_step(x_gates, h_gates, state):
    h, c = state
    i, f, g, o = split(x_gates + h_gates, 4, axis=-1)
    c = sigmoid(f) * c + sigmoid(i) * tanh(g)
    h = sigmoid(o) * tanh(c)
    return h, (h, c)


def _gru_step(x_gates, h_gates, state):
    x_r, x_z, x_c = split(x_gates, 3, axis=-1)
    h_r, h_z, h_c = split(h_gates, 3, axis=-1)
    r = sigmoid(x_r + h_r)
    z = sigmoid(x_z + h_z)
    c = tanh(x_c + r * h_c)
    h = (state - c) * z + c
    return h, h


class RNNBase(Layer):
    """The stacked, optionally bidirectional recurrence shared by ``LSTM`` and ``GRU``:
    ``forward(inputs, initial_states=None, sequence_length=None)`` returns ``(outputs,
    final_states)``, ``outputs`` ``(batch, time, directions * hidden_size)`` (``(time,
    batch, ...)`` with ``time_major``), the final states ``(num_layers * directions, batch,
    hidden_size)`` each. ``dropout`` applies to the outputs of every layer but the last, while
    training."""

    gates = state_parts = None
    step = None

    def __init__(self, input_size, hidden_size, num_layers=1, direction="forward",
                 time_major=False, dropout=0.0, weight_ih_attr=None, weight_hh_attr=None,
                 bias_ih_attr=None, bias_hh_attr=None, name=None):
        super().__init__(None, name)
        self.input_size = check_positive_int("input_size", input_size)
        self.hidden_size = check_positive_int("hidden_size", hidden_size)
        self.num_layers = check_positive_int("num_layers", num_layers)
        if direction not in DIRECTIONS:
            raise ValueError(f"direction={direction!r} is not allowed; allowed: "
                             f"{sorted(DIRECTIONS)}")
        self.direction, self.num_directions = direction, DIRECTIONS[direction]
        self.time_major = bool(time_major)
        self.dropout = F.common.check_dropout_rate(dropout)
        bound = 1 / math.sqrt(hidden_size)
        attrs = [(to_attr(a, name), name) for a, name in (
            (weight_ih_attr, "weight_ih_attr"), (weight_hh_attr, "weight_hh_attr"),
            (bias_ih_attr, "bias_ih_attr"), (bias_hh_attr, "bias_hh_attr"))]
        rows = self.gates * hidden_size
        for layer in range(self.num_layers):
            width = input_size if layer == 0 else hidden_size * self.num_directions
            for suffix in ("", "_reverse")[:self.num_directions]:
                shapes = ((rows, width), (rows, hidden_size), (rows,), (rows,))
                for (attr, _), kind, shape in zip(attrs, ("weight_ih", "weight_hh", "bias_ih",
                                                          "bias_hh"), shapes):
                    param = self.create_parameter(
                        shape, attr, default_initializer=initializer.Uniform(-bound, bound))
                    setattr(self, f"{kind}_l{layer}{suffix}", param)

    def extra_repr(self):
        return (f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, "
                f"direction={self.direction!r}")

    def _initial(self, initial_states, batch, dtype):
        """The initial state of each layer and direction, in Paddle's order: zeros, or the
        slices of ``initial_states`` (``state_parts`` tensors: LSTM's ``(h, c)``, GRU's
        ``h``)."""
        count = self.num_layers * self.num_directions
        if initial_states is None:
            zeros = Tensor(backend.array_module().zeros((batch, self.hidden_size), dtype))
            return [self._state_of([zeros] * self.state_parts)] * count
        parts = list(initial_states) if isinstance(initial_states, (tuple, list)) \
            else [initial_states]
        expected = (count, batch, self.hidden_size)
        if len(parts) != self.state_parts or any(tuple(p.shape) != expected for p in parts):
            raise ValueError(f"{type(self).__name__} initial_states must be {self.state_parts} "
                             f"tensor(s) of shape {expected} (num_layers * directions, batch, "
                             f"hidden_size), got {[tuple(p.shape) for p in parts]}")
        return [self._state_of([part[k] for part in parts]) for k in range(count)]

    def _run_direction(self, steps, state, layer, suffix):
        w_ih = getattr(self, f"weight_ih_l{layer}{suffix}")
        w_hh = getattr(self, f"weight_hh_l{layer}{suffix}")
        b_ih = getattr(self, f"bias_ih_l{layer}{suffix}")
        b_hh = getattr(self, f"bias_hh_l{layer}{suffix}")
        order = range(len(steps) - 1, -1, -1) if suffix else range(len(steps))
        outputs = [None] * len(steps)
        for t in order:
            x_gates = matmul(steps[t], w_ih, transpose_y=True)
            h_gates = matmul(self._hidden(state), w_hh, transpose_y=True)
            if b_ih is not None:
                x_gates = x_gates + b_ih
            if b_hh is not None:
                h_gates = h_gates + b_hh
            outputs[t], state = type(self).step(x_gates, h_gates, state)
        return outputs, state

    def forward(self, inputs, initial_states=None, sequence_length=None):
        if sequence_length is not None:
            raise ValueError(f"{type(self).__name__} sequence_length is not supported: pad "
                             "the batch to one length, or run each length apart")
        if not isinstance(inputs, Tensor):
            inputs = Tensor(backend.asarray(inputs))
        if inputs.ndim != 3 or inputs.shape[2] != self.input_size:
            raise ValueError(f"{type(self).__name__} expects inputs (batch, time, "
                             f"{self.input_size}) (time first with time_major), got shape "
                             f"{tuple(inputs.shape)}")
        time_axis = 0 if self.time_major else 1
        steps = [inputs[t] if self.time_major else inputs[:, t]
                 for t in range(inputs.shape[time_axis])]
        states = self._initial(initial_states, inputs.shape[1 - time_axis], inputs.dtype)
        finals = []
        for layer in range(self.num_layers):
            directions = []
            for d, suffix in enumerate(("", "_reverse")[:self.num_directions]):
                outputs, final = self._run_direction(
                    steps, states[layer * self.num_directions + d], layer, suffix)
                directions.append(outputs)
                finals.append(final)
            steps = [concat(list(pair), axis=-1) if len(pair) > 1 else pair[0]
                     for pair in zip(*directions)]
            if layer < self.num_layers - 1 and self.dropout:
                steps = [F.dropout(s, self.dropout, self.training) for s in steps]
        return stack(steps, axis=time_axis), self._final_states(finals)


class LSTM(RNNBase):
    """Paddle's ``paddle.nn.LSTM`` (module docstring); states ``(h, c)``."""

    gates, state_parts = 4, 2
    step = staticmethod(_lstm_step)

    @staticmethod
    def _state_of(parts):
        return tuple(parts)

    @staticmethod
    def _hidden(state):
        return state[0]

    @staticmethod
    def _final_states(finals):
        return stack([h for h, _ in finals]), stack([c for _, c in finals])


class GRU(RNNBase):
    """Paddle's ``paddle.nn.GRU`` (module docstring); the state is ``h``."""

    gates, state_parts = 3, 1
    step = staticmethod(_gru_step)

    @staticmethod
    def _state_of(parts):
        return parts[0]

    @staticmethod
    def _hidden(state):
        return state

    @staticmethod
    def _final_states(finals):
        return stack(finals)

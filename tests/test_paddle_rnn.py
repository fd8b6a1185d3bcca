"""LSTM and GRU against NumPy forms of Paddle 2.5's cells, read from the layers' own
parameters by Paddle's names, and their gradients against finite differences."""
import numpy as np
import pytest

import fleetmpi as paddle
from fleetmpi import nn
from fleetmpi.nn.gradcheck import check_gradients


@pytest.fixture
def float64():
    nn.set_default_dtype("float64")
    yield
    nn.set_default_dtype("float32")


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def lstm_cell(x, state, w_ih, w_hh, b_ih, b_hh):
    h, c = state
    i, f, g, o = np.split(x @ w_ih.T + b_ih + h @ w_hh.T + b_hh, 4, axis=-1)
    c = sigmoid(f) * c + sigmoid(i) * np.tanh(g)
    h = sigmoid(o) * np.tanh(c)
    return h, (h, c)


def gru_cell(x, h, w_ih, w_hh, b_ih, b_hh):
    x_r, x_z, x_c = np.split(x @ w_ih.T + b_ih, 3, axis=-1)
    h_r, h_z, h_c = np.split(h @ w_hh.T + b_hh, 3, axis=-1)
    r, z = sigmoid(x_r + h_r), sigmoid(x_z + h_z)
    c = np.tanh(x_c + r * h_c)
    return z * h + (1 - z) * c, z * h + (1 - z) * c


def reference(layer, cell, x, states):
    """Outputs and final states of ``layer`` in NumPy, from its state_dict by Paddle's
    names; ``states``: one initial state per layer and direction."""
    params = {k: np.asarray(v) for k, v in layer.state_dict().items()}
    finals = []
    for k in range(layer.num_layers):
        outs = []
        for d, suffix in enumerate(["", "_reverse"][:layer.num_directions]):
            weights = [params[f"{n}_l{k}{suffix}"] for n in ("weight_ih", "weight_hh",
                                                                "bias_ih", "bias_hh")]
            state, seq = states[k * layer.num_directions + d], [None] * x.shape[1]
            for t in (range(x.shape[1] - 1, -1, -1) if suffix else range(x.shape[1])):
                seq[t], state = cell(x[:, t], state, *weights)
            outs.append(np.stack(seq, axis=1))
            finals.append(state)
        x = np.concatenate(outs, axis=-1)
    return x, finals


@pytest.mark.parametrize("direction", ["forward", "bidirect"])
def test_lstm_equals_paddles_cell(float64, direction):
    paddle.seed(1)
    lstm = nn.LSTM(3, 4, num_layers=2, direction=direction)
    keys = set(lstm.state_dict())
    assert {"weight_ih_l0", "weight_hh_l1", "bias_ih_l1", "bias_hh_l0"} <= keys
    assert ("weight_ih_l1_reverse" in keys) == (direction == "bidirect")
    assert list(lstm.state_dict()["weight_ih_l1"].shape) == [16, 4 * lstm.num_directions]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 3))
    count = 2 * lstm.num_directions
    h0, c0 = rng.standard_normal((2, count, 2, 4))
    out, (h, c) = lstm(paddle.to_tensor(x), (paddle.to_tensor(h0), paddle.to_tensor(c0)))
    expected, finals = reference(lstm, lstm_cell, x, list(zip(h0, c0)))
    assert out.shape == [2, 5, 4 * lstm.num_directions] and h.shape == [count, 2, 4]
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(h.numpy(), [s[0] for s in finals], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(c.numpy(), [s[1] for s in finals], rtol=1e-12, atol=1e-12)


def test_gru_equals_paddles_cell_time_major_and_zero_state(float64):
    paddle.seed(2)
    gru = nn.GRU(3, 2, direction="bidirectional", time_major=True)
    x = np.random.default_rng(1).standard_normal((4, 2, 3))       # (time, batch, input)
    out, h = gru(paddle.to_tensor(x))
    expected, finals = reference(gru, gru_cell, x.transpose(1, 0, 2), [np.zeros((2, 2))] * 2)
    np.testing.assert_allclose(out.numpy(), expected.transpose(1, 0, 2), rtol=1e-12)
    np.testing.assert_allclose(h.numpy(), finals, rtol=1e-12)


class Outputs(nn.Layer):
    """The outputs and the final states of an RNN, joined: one tensor to check."""

    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x):
        out, states = self.rnn(x)
        states = states if isinstance(states, tuple) else (states,)
        return paddle.concat([out.reshape(-1)] + [s.reshape(-1) for s in states])


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_rnn_gradients_match_finite_differences(float64, kind):
    paddle.seed(3)
    layer = Outputs(getattr(nn, kind)(2, 2, num_layers=2, direction="bidirect"))
    x = np.random.default_rng(2).standard_normal((1, 2, 2))
    errors = check_gradients(layer, x)
    assert len(errors) == 1 + 16 and max(errors.values()) < 1e-6, errors


def test_rnn_refusals_name_the_problem():
    lstm = nn.LSTM(3, 4)
    with pytest.raises(ValueError, match=r"expects inputs \(batch, time, 3\).*got shape "
                                         r"\(2, 5\)"):
        lstm(paddle.to_tensor(np.zeros((2, 5), np.float32)))
    with pytest.raises(ValueError, match=r"initial_states must be 2 tensor\(s\) of shape "
                                         r"\(1, 2, 4\)"):
        lstm(paddle.to_tensor(np.zeros((2, 5, 3), np.float32)),
             paddle.to_tensor(np.zeros((1, 2, 4), np.float32)))
    with pytest.raises(ValueError, match="direction='both' is not allowed"):
        nn.GRU(3, 4, direction="both")

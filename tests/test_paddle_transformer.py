"""MultiHeadAttention, TransformerEncoderLayer/TransformerEncoder and BatchNorm3D against
NumPy forms of Paddle 2.5's arithmetic, read from the layers' parameters by Paddle's names;
gradients against finite differences."""
import numpy as np
import pytest

import fleetmpi as paddle
from fleetmpi import nn
from fleetmpi.nn.gradcheck import check_gradients

RNG = np.random.default_rng(0)


@pytest.fixture
def float64():
    nn.set_default_dtype("float64")
    yield
    nn.set_default_dtype("float32")


def params(layer):
    return {k: np.asarray(v) for k, v in layer.state_dict().items()}


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def attention(p, prefix, query, key, value, heads, mask=None):
    def project(x, name):
        y = x @ p[f"{prefix}{name}.weight"] + p[f"{prefix}{name}.bias"]
        b, t, e = y.shape
        return y.reshape(b, t, heads, e // heads).transpose(0, 2, 1, 3)
    q, k, v = project(query, "q_proj"), project(key, "k_proj"), project(value, "v_proj")
    scores = q / np.sqrt(q.shape[-1]) @ k.transpose(0, 1, 3, 2)
    if mask is not None:
        scores = scores + mask
    weights = softmax(scores)
    out = (weights @ v).transpose(0, 2, 1, 3).reshape(query.shape[0], query.shape[1], -1)
    return out @ p[f"{prefix}out_proj.weight"] + p[f"{prefix}out_proj.bias"], weights


def layer_norm(x, weight, bias, eps=1e-5):
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def encoder_layer(p, prefix, x, heads, before, mask=None):
    def norm(y, name):
        return layer_norm(y, p[f"{prefix}{name}.weight"], p[f"{prefix}{name}.bias"])

    def feed_forward(y):
        hidden = np.maximum(y @ p[f"{prefix}linear1.weight"] + p[f"{prefix}linear1.bias"], 0)
        return hidden @ p[f"{prefix}linear2.weight"] + p[f"{prefix}linear2.bias"]

    def attend(y):
        return attention(p, f"{prefix}self_attn.", y, y, y, heads, mask)[0]
    for name, block in (("norm1", attend), ("norm2", feed_forward)):
        x = x + block(norm(x, name) if before else x)
        x = x if before else norm(x, name)
    return x


def test_multi_head_attention_with_masks_equals_paddles(float64):
    paddle.seed(0)
    mha = nn.MultiHeadAttention(8, 2, kdim=6, vdim=5, need_weights=True)
    assert {"q_proj.weight", "k_proj.weight", "v_proj.bias", "out_proj.weight"} <= \
        set(mha.state_dict())
    q, k, v = RNG.standard_normal((2, 3, 8)), RNG.standard_normal((2, 4, 6)), \
        RNG.standard_normal((2, 4, 5))
    keep = np.array([[True, True, False, True]])               # broadcast over queries
    out, weights = mha(paddle.to_tensor(q), paddle.to_tensor(k), paddle.to_tensor(v),
                       attn_mask=paddle.to_tensor(keep))
    expected, expected_weights = attention(params(mha), "", q, k, v, 2,
                                           (keep.astype(float) - 1) * 1e9)
    assert out.shape == [2, 3, 8] and weights.shape == [2, 2, 3, 4]
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-10)
    np.testing.assert_allclose(weights.numpy(), expected_weights, rtol=1e-10, atol=1e-300)
    assert np.all(weights.numpy()[..., 2] == 0)
    additive = RNG.standard_normal((3, 4))
    got = nn.MultiHeadAttention(8, 2, kdim=6, vdim=5)
    got.set_state_dict(mha.state_dict())
    np.testing.assert_allclose(
        got(paddle.to_tensor(q), paddle.to_tensor(k), paddle.to_tensor(v), additive).numpy(),
        attention(params(mha), "", q, k, v, 2, additive)[0], rtol=1e-10)


@pytest.mark.parametrize("normalize_before", [False, True])
def test_transformer_encoder_equals_paddles(float64, normalize_before):
    paddle.seed(1)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0,
                                       normalize_before=normalize_before)
    encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(8))
    encoder.eval()
    p = params(encoder)
    assert {"layers.0.self_attn.q_proj.weight", "layers.1.linear1.weight",
            "layers.1.norm2.bias", "norm.weight"} <= set(p)
    assert not np.array_equal(p["layers.0.linear1.weight"], p["layers.1.linear1.weight"])
    x = RNG.standard_normal((2, 3, 8))
    mask = np.array([[1, 1, 0]])                                # an integer mask, as Paddle's
    expected = x
    for i in range(2):
        expected = encoder_layer(p, f"layers.{i}.", expected, 2, normalize_before,
                                 (mask - 1.0) * 1e9)
    expected = layer_norm(expected, p["norm.weight"], p["norm.bias"])
    np.testing.assert_allclose(encoder(paddle.to_tensor(x), mask).numpy(), expected,
                               rtol=1e-9, atol=1e-12)


def test_attention_and_encoder_gradients_match_finite_differences(float64):
    paddle.seed(2)
    mha = nn.MultiHeadAttention(4, 2)
    x = RNG.standard_normal((1, 3, 4))
    errors = check_gradients(mha, x)
    assert len(errors) == 9 and max(errors.values()) < 1e-6, errors
    layer = nn.TransformerEncoderLayer(4, 2, 6, dropout=0.0, normalize_before=True)
    errors = check_gradients(layer, x)
    assert max(errors.values()) < 1e-6, errors


def test_batch_norm_3d_normalizes_each_channel_over_the_rest(float64):
    bn = nn.BatchNorm3D(3)
    x = RNG.standard_normal((2, 3, 2, 2, 2)) * 3 + 1
    mean = x.mean(axis=(0, 2, 3, 4), keepdims=True)
    var = x.var(axis=(0, 2, 3, 4), keepdims=True)
    np.testing.assert_allclose(bn(paddle.to_tensor(x)).numpy(),
                               (x - mean) / np.sqrt(var + 1e-5), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"BatchNorm3D expects a 5-d input"):
        bn(paddle.to_tensor(x[0]))


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="embed_dim=6 must divide into num_heads=4"):
        nn.MultiHeadAttention(6, 4)
    with pytest.raises(ValueError, match="activation='gelu' is not supported.*exact erf"):
        nn.TransformerEncoderLayer(8, 2, 16, activation="gelu")
    with pytest.raises(ValueError, match="cache is not supported"):
        nn.MultiHeadAttention(8, 2)(paddle.to_tensor(np.zeros((1, 2, 8), np.float32)),
                                    cache=object())

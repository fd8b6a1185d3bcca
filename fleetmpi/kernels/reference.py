"""NumPy references of the fused kernels: they define the math of the ``.cu`` files beside them
and are what runs on CPU. The unfused layers and optimizers are built from the same functions, so
fused and unfused paths compute the same operations in the same order.

Arrays are laid out ``(N, C, inner...)``: ``channels`` sits on axis 1 (axis 1 of a Linear output
is its features), and per-channel vectors broadcast over the other axes.
"""
import math
import numbers
import threading

import numpy as np

# In the order of their codes in bias_act.cu (kernels.ACT_CODES).
ACTIVATIONS = ("relu", "tanh", "gelu")
# The activations whose backward needs their input (the others need only their output).
INPUT_ACTIVATIONS = ("gelu",)
GELU_K = math.sqrt(2.0 / math.pi)
GELU_C = 0.044715


def check_activation(act):
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r} is not supported; use one of {ACTIVATIONS}")


def per_channel(vector, ndim):
    """``vector`` of length C shaped to broadcast along axis 1 of an ``ndim``-d array."""
    return vector.reshape((1, -1) + (1,) * (ndim - 2))


def activation_forward(z, act, xp):
    """``act(z)``; GELU is the tanh approximation."""
    if act == "relu":
        return xp.maximum(z, 0)
    if act == "tanh":
        return xp.tanh(z)
    return gelu_forward(z, xp)


def activation_backward(dy, y, z, act, xp):
    """``dy * act'(z)``; ReLU and Tanh need only the output ``y``, GELU the input ``z``."""
    if act == "relu":
        return dy * (y > 0)
    if act == "tanh":
        return dy * (1 - y * y)
    return gelu_backward(dy, z, xp)


def _gelu_exp(z, xp):
    """``exp(-2u)`` with ``u = K (z + C z^3)``, in a new array (it overflows to inf, harmlessly,
    for large negative ``z``)."""
    e = z * z
    e *= -2 * GELU_K * GELU_C
    e -= 2 * GELU_K
    e *= z
    with np.errstate(over="ignore"):
        xp.exp(e, out=e)
    return e


def gelu_forward(z, xp):
    """GELU's tanh approximation ``0.5 z (1 + tanh(u))``, computed as the equal
    ``z / (1 + exp(-2u))``: NumPy's exp is about twice as fast as its tanh, and this form has
    no cancellation where ``tanh(u)`` nears -1. Two passes fewer than the tanh form, in place."""
    e = _gelu_exp(z, xp)
    e += 1
    return xp.divide(z, e, out=e)


def gelu_backward(dy, z, xp):
    """``dy * gelu'(z)``: with ``s = 1 / (1 + exp(-2u))`` (which is ``(1 + tanh(u)) / 2``),
    ``gelu'(z) = s + 2 z s (1 - s) K (1 + 3 C z^2)``."""
    s = _gelu_exp(z, xp)
    s += 1
    xp.reciprocal(s, out=s)
    d = z * z
    d *= 6 * GELU_K * GELU_C
    d += 2 * GELU_K
    d *= z
    d *= s
    d *= 1 - s
    d += s
    if d.dtype == xp.result_type(d, dy):
        d *= dy
        return d
    return d * dy


def bias_act_forward(z, bias, act, xp):
    """``fuse_elewise_add_act_ops`` forward: ``pre = z + bias``, ``y = act(pre)``. Returns
    ``(y, pre)``; ``pre`` is kept only for GELU, whose derivative needs it."""
    pre = z + per_channel(bias, z.ndim)
    y = activation_forward(pre, act, xp)
    return y, (pre if act in INPUT_ACTIVATIONS else None)


def bias_act_backward(dy, y, pre, act, xp):
    """``fuse_elewise_add_act_ops`` backward: the gradient of the pre-activation. The bias
    gradient is its sum over every axis but 1, a reduction left to the caller."""
    return activation_backward(dy, y, pre, act, xp)


def bn_xhat(x, mean, invstd):
    """The normalized input ``(x - mean) * invstd``."""
    xhat = x - per_channel(mean, x.ndim)
    xhat *= per_channel(invstd, x.ndim)
    return xhat


def _affine(xhat, gamma, beta, in_place):
    """``gamma * xhat + beta`` per channel, in one array: ``xhat``'s memory when ``in_place``,
    else a new one, where ``xhat``'s dtype holds the result (the same bits either way)."""
    scale, shift = per_channel(gamma, xhat.ndim), per_channel(beta, xhat.ndim)
    if np.result_type(xhat.dtype, scale.dtype, shift.dtype) != xhat.dtype:
        return scale * xhat + shift
    if in_place:
        xhat *= scale
        y = xhat
    else:
        y = xhat * scale
    y += shift
    return y


def bn_normalize(x, mean, invstd, gamma, beta):
    """Batch-norm affine transform given per-channel statistics: ``(xhat, y)``."""
    xhat = bn_xhat(x, mean, invstd)
    return xhat, _affine(xhat, gamma, beta, in_place=False)


def bn_act_forward(x, mean, invstd, gamma, beta, xp):
    """``fuse_bn_act_ops`` forward: ``(y, xhat)``, ``y = relu(gamma * xhat + beta)`` with
    ``xhat = (x - mean) * invstd``, which backward needs and so need not compute again."""
    xhat, y = bn_normalize(x, mean, invstd, gamma, beta)
    return xp.maximum(y, 0, out=y), xhat


def move_running(running, batch, momentum):
    """Batch norm's running statistic moved towards the batch's, in place: ``running =
    momentum * running + (1 - momentum) * batch`` (Paddle's convention)."""
    running *= momentum
    running += (1 - momentum) * batch


def bn_input_grad(dz, xhat, invstd, gamma, sum_dz, sum_dz_xhat, count):
    """Batch-norm input gradient from the gradient ``dz`` of its output, given the per-channel
    sums of ``dz`` and ``dz * xhat`` over the ``count`` values of each channel."""
    nd = dz.ndim
    dx = count * dz  # then, in place, the same operations in the same order as one expression
    dx -= per_channel(sum_dz, nd)
    dx -= xhat * per_channel(sum_dz_xhat, nd)
    dx *= per_channel(gamma * invstd / count, nd)
    return dx


def bn_act_backward_mask(dy, y):
    """``fuse_bn_act_ops`` backward, first half: the ReLU mask applied to ``dy``."""
    return dy * (y > 0)


def sgd_update(param, grad, lr, weight_decay):
    """``p -= lr * (g + wd * p)``, in place."""
    step = grad + weight_decay * param if weight_decay else grad
    param -= lr * step


def momentum_update(param, grad, velocity, lr, momentum, weight_decay, nesterov):
    """``v = mu * v + g'``; ``p -= lr * v`` (Nesterov: ``p -= lr * (g' + mu * v)``), in place,
    where ``g' = g + wd * p``."""
    step = grad + weight_decay * param if weight_decay else grad
    velocity *= momentum
    velocity += step
    if nesterov:
        param -= lr * (step + momentum * velocity)
    else:
        param -= lr * velocity


def adam_corrections(lr, beta1, beta2, epsilon, step_count, xp):
    """``(lr_t, eps_t)``: Adam's bias corrections after ``step_count`` updates folded into the
    step size and epsilon. ``step_count`` is a host integer or a one-element integer array
    counting the updates (the optimizer's counter, kept on the device so that a captured step
    counts on replays too). From a host count (a NumPy counter is host memory: nothing waits)
    they are Python floats, the same arithmetic as ever; from a device counter, 0-d float64
    device arrays computed there, with no read on the host (the device's pow may differ from
    the host's in the last bit)."""
    if isinstance(step_count, np.ndarray):
        step_count = int(step_count[0])
    if isinstance(step_count, numbers.Integral):
        correction2 = math.sqrt(1 - beta2 ** step_count)
        return lr * correction2 / (1 - beta1 ** step_count), epsilon * correction2
    t = step_count[0].astype(np.float64)
    correction2 = xp.sqrt(1 - beta2 ** t)
    return lr * correction2 / (1 - beta1 ** t), epsilon * correction2


def adam_update(param, grad, moment1, moment2, lr, beta1, beta2, epsilon, step_count,
                weight_decay, decoupled, xp):
    """Adam (Paddle's bias correction folded into the step size, ``adam_corrections``) in
    place. With ``decoupled`` (AdamW) the weight decay shrinks the parameter, ``p *= 1 - lr *
    wd``; otherwise it is added to the gradient as L2 regularisation."""
    if decoupled and weight_decay:
        param *= 1 - lr * weight_decay
    g = grad + weight_decay * param if (weight_decay and not decoupled) else grad
    moment1 *= beta1
    moment1 += (1 - beta1) * g
    moment2 *= beta2
    moment2 += (1 - beta2) * (g * g)
    lr_t, eps_t = adam_corrections(lr, beta1, beta2, epsilon, step_count, xp)
    if not isinstance(lr_t, float):
        # Rounded to the parameters' dtype first, as a Python float is (and the kernel does).
        lr_t, eps_t = lr_t.astype(param.dtype), eps_t.astype(param.dtype)
    param -= lr_t * (moment1 / (xp.sqrt(moment2) + eps_t))


def unscale(grad, inverse, found):
    """amp's unscale and overflow check in one pass: ``grad *= inverse`` in place (1 / loss
    scale: a number, or a one-element array), and ``found[0]`` (an int32 flag) set to 1 when
    any result is inf or NaN, left as it was otherwise (no read on the host)."""
    grad *= inverse
    found |= ~np.isfinite(grad).all()


def check_finite(grad, found):
    """The non-finite check of a step without amp: ``found[0]`` (an int32 flag) set to 1 when
    ``grad`` holds an inf or NaN, left as it was otherwise (no read of a device array on the
    host; a host array is tested by ``all_finite``)."""
    if isinstance(grad, np.ndarray):
        if not all_finite(grad):
            found |= 1
        return
    found |= ~np.isfinite(grad).all()


def all_finite(grad):
    """Whether every element of the host array ``grad`` is finite. It is reduced to one
    number first (``_finite_probe``): an inf or NaN carries through it, so a finite one
    settles it, and the elementwise test runs only where it is not finite (an inf or NaN, or
    finite values whose squares or sum overflowed)."""
    return bool(np.isfinite(_finite_probe(grad))) or bool(np.isfinite(grad).all())


_ROW = 1024
_ONES = {np.dtype(t): np.ones(_ROW, t) for t in (np.float32, np.float64)}


def _finite_probe(grad):
    """A number that is finite when every element of the host array ``grad`` is (it may be
    inf for finite values too large, which the elementwise test then settles). Where BLAS
    computes it (float32, float64): on the main thread, the sum of the sums of rows of
    ``_ROW`` elements, which the BLAS takes as a matrix-vector product over its threads; on
    another thread (the communicator's, beside backward), a dot product with itself, which
    does not take the BLAS's thread pool that the main thread's matrix products hold (two
    threads calling a threaded OpenBLAS at once stalled the probe for up to 500 ms). Else the
    sum. Over the 1.86M float32 gradients of benchmarks/train_throughput.py's MLP
    (benchmarks/finite_probe.py, medians): the row sums 0.14-0.18 ms on two threads, 0.28-0.31
    on one; the dot product 0.29 on either (a BLAS level-1 call runs on one thread); the sum
    0.34-0.37; the elementwise test 0.41-0.44. Its overflow is expected, so NumPy's warning
    about it is not given."""
    with np.errstate(over="ignore", invalid="ignore"):
        ones = _ONES.get(grad.dtype)
        if ones is None or grad.ndim != 1 or not grad.flags.c_contiguous:
            return grad.sum()
        if threading.current_thread() is not threading.main_thread():
            return np.dot(grad, grad)
        whole = grad.size - grad.size % _ROW
        return (grad[:whole].reshape(-1, _ROW) @ ones).sum() + grad[whole:].sum()

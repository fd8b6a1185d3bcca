"""Fused kernels: CuPy ``RawKernel``s compiled from the ``.cu`` files beside this module on a GPU,
their NumPy references (``reference.py``) on CPU and for dtypes the kernels do not cover.

Each function here takes backend arrays and returns backend arrays; what it computes is defined
by the reference function of the same name.
"""
import math

import numpy as np

from .. import backend
from . import reference
from .loader import KERNEL_DTYPES, launch

ACT_CODES = {"relu": 0, "tanh": 1, "gelu": 2}
# The optimizer updates' references are chains of elementwise passes over whole arrays. On the
# host they run over blocks of this many elements instead, so each pass after the first finds
# its block in cache: the same arithmetic, element by element, at a fraction of the memory
# traffic (docs/performance.md: Momentum over 1.86M parameters 5.3 -> 3.4 ms, Adam 24 -> 8.7).
HOST_BLOCK = 1 << 16


def _use_kernel(*arrays):
    return backend.on_gpu() and all(a.dtype.name in KERNEL_DTYPES for a in arrays)


def _host_blocks(update, arrays, *args):
    """``update(*arrays, *args)`` of an elementwise reference, over ``HOST_BLOCK`` elements at
    a time when the arrays are contiguous host arrays (views of them, so results land in
    place)."""
    if (arrays[0].size <= HOST_BLOCK or not all(isinstance(a, np.ndarray)
                                                 and a.flags.c_contiguous for a in arrays)):
        return update(*arrays, *args)
    flat = [a.reshape(-1) for a in arrays]
    for start in range(0, flat[0].size, HOST_BLOCK):
        update(*(a[start:start + HOST_BLOCK] for a in flat), *args)
    return None


def _layout(x):
    channels = x.shape[1]
    inner = x.size // (x.shape[0] * channels) if x.shape[0] * channels else 1
    return np.int64(x.size), np.int64(channels), np.int64(inner)


def bias_act_forward(z, bias, act):
    reference.check_activation(act)
    xp = backend.array_module()
    if not _use_kernel(z, bias):
        return reference.bias_act_forward(z, bias, act, xp)
    z = xp.ascontiguousarray(z)
    y = xp.empty_like(z)
    pre = xp.empty_like(z) if act == "gelu" else y
    n, channels, inner = _layout(z)
    launch("bias_act.cu", "bias_act_forward", z.dtype, n,
           (z, bias, y, pre, n, channels, inner, np.int32(ACT_CODES[act])))
    return y, (pre if act == "gelu" else None)


def bias_act_backward(dy, y, pre, act):
    xp = backend.array_module()
    if not _use_kernel(dy, y):
        return reference.bias_act_backward(dy, y, pre, act, xp)
    dy = xp.ascontiguousarray(dy)
    dz = xp.empty_like(dy)
    launch("bias_act.cu", "bias_act_backward", dy.dtype, dy.size,
           (dy, y, pre if pre is not None else y, dz, np.int64(dy.size),
            np.int32(ACT_CODES[act])))
    return dz


def bn_act_forward(x, mean, invstd, gamma, beta):
    """``(y, xhat)``: the normalized input ``xhat`` where it was formed on the way (the
    reference), None from the device kernel, which never stores it."""
    xp = backend.array_module()
    if not _use_kernel(x, gamma):
        return reference.bn_act_forward(x, mean, invstd, gamma, beta, xp)
    x = xp.ascontiguousarray(x)
    y = xp.empty_like(x)
    n, channels, inner = _layout(x)
    launch("bn_act.cu", "bn_act_forward", x.dtype, n,
           (x, mean, invstd, gamma, beta, y, n, channels, inner))
    return y, None


def bn_act_backward_mask(dy, y):
    xp = backend.array_module()
    if not _use_kernel(dy, y):
        return reference.bn_act_backward_mask(dy, y)
    dy = xp.ascontiguousarray(dy)
    dz = xp.empty_like(dy)
    launch("bn_act.cu", "bn_act_backward_mask", dy.dtype, dy.size,
           (dy, y, dz, np.int64(dy.size)))
    return dz


def bn_input_grad(dz, xhat, invstd, gamma, sum_dz, sum_dz_xhat, count):
    xp = backend.array_module()
    if not _use_kernel(dz, xhat):
        return reference.bn_input_grad(dz, xhat, invstd, gamma, sum_dz, sum_dz_xhat, count)
    dz = xp.ascontiguousarray(dz)
    dx = xp.empty_like(dz)
    n, channels, inner = _layout(dz)
    launch("bn_act.cu", "bn_input_grad", dz.dtype, n,
           (dz, xp.ascontiguousarray(xhat), invstd, gamma, sum_dz, sum_dz_xhat, dx, n,
            channels, inner, dz.dtype.type(count)))
    return dx


def _address(array):
    """The device (CuPy) or host (NumPy) address of ``array``'s first element."""
    data = array.data
    return data.ptr if hasattr(data, "ptr") else array.ctypes.data


_tables = {}


def _table(kinds):
    """``(table, offsets, total)`` for the multi-tensor kernels of ``optimizer.cu``: the
    addresses of the arrays of every kind (a list per kind, one array per run) and the runs'
    offsets, as backend arrays, and the element count. Kept per set of addresses, so a
    training loop, whose arrays stay put, copies them to the device once rather than every
    step."""
    key = tuple(_address(a) for arrays in kinds for a in arrays) + tuple(
        a.size for a in kinds[0])
    if key not in _tables:
        if len(_tables) >= 64:
            _tables.clear()
        offsets = np.zeros(len(kinds[0]) + 1, dtype=np.int64)
        np.cumsum([a.size for a in kinds[0]], out=offsets[1:])
        table = np.array(key[:-len(kinds[0])], dtype=np.uint64)
        _tables[key] = (backend.asarray(table), backend.asarray(offsets), int(offsets[-1]))
    return _tables[key]


def _by_dtype(kinds):
    """The runs of ``kinds`` (lists of arrays, one entry per run) grouped by the runs' dtype:
    ``[(dtype, kinds of that dtype's runs)]``."""
    groups = {}
    for index, array in enumerate(kinds[0]):
        groups.setdefault(array.dtype, []).append(index)
    return [(dtype, [[arrays[i] for i in indices] for arrays in kinds])
            for dtype, indices in groups.items()]


def _multi_tensor(kernel, kinds, reference_update, scalars, *reference_args):
    """Run ``reference_update(*arrays of one run, *reference_args)`` for every run of
    ``kinds``, on a GPU as one launch of ``multi_tensor_<kernel>`` per dtype with
    ``scalars(dtype)`` after the table."""
    for dtype, group in _by_dtype(kinds):
        if not _use_kernel(*group[0]):
            for arrays in zip(*group):
                _host_blocks(reference_update, arrays, *reference_args)
            continue
        table, offsets, total = _table(group)
        launch("optimizer.cu", f"multi_tensor_{kernel}", dtype, total,
               (table, offsets, np.int32(len(group[0])), *scalars(dtype.type)))


def multi_tensor_sgd_update(params, grads, lr, weight_decay):
    """``reference.sgd_update`` of every ``(params[i], grads[i])``."""
    _multi_tensor("sgd", [params, grads], reference.sgd_update,
                  lambda t: (t(lr), t(weight_decay)), lr, weight_decay)


def multi_tensor_momentum_update(params, grads, velocities, lr, momentum, weight_decay,
                                 nesterov):
    """``reference.momentum_update`` of every ``(params[i], grads[i], velocities[i])``."""
    _multi_tensor("momentum", [params, grads, velocities], reference.momentum_update,
                  lambda t: (t(lr), t(momentum), t(weight_decay), np.int32(bool(nesterov))),
                  lr, momentum, weight_decay, nesterov)


def multi_tensor_adam_update(params, grads, moment1s, moment2s, lr, beta1, beta2, epsilon,
                             step_count, weight_decay, decoupled):
    """``reference.adam_update`` of every ``(params[i], grads[i], moment1s[i],
    moment2s[i])``."""
    correction2 = math.sqrt(1 - beta2 ** step_count)
    lr_t = lr * correction2 / (1 - beta1 ** step_count)
    l2 = 0.0 if decoupled else weight_decay
    scale = 1 - lr * weight_decay if decoupled else 1.0
    _multi_tensor("adam", [params, grads, moment1s, moment2s], reference.adam_update,
                  lambda t: (t(lr_t), t(beta1), t(beta2), t(epsilon * correction2), t(l2),
                             t(scale)),
                  lr, beta1, beta2, epsilon, step_count, weight_decay, decoupled,
                  backend.array_module())


def multi_tensor_unscale(grads, inverse, found, token):
    """amp's unscale and overflow check in one pass: every array of ``grads`` multiplied by
    ``inverse`` in place, and ``found[0]`` (an int32 backend array) set to ``token`` when any
    result is inf or NaN, left as it was otherwise."""
    def unscale(grad):
        if not reference.unscale(grad, inverse):
            found[0] = token

    _multi_tensor("unscale", [grads], unscale,
                  lambda t: (t(inverse), found, np.int32(token)))

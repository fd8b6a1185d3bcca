"""Fused kernels: CuPy ``RawKernel``s compiled from the ``.cu`` files beside this module on a GPU,
their NumPy references (``reference.py``, ``transformer_reference.py`` for the transformer
step's kernels, ``attention_reference.py`` for attention's) on CPU and for dtypes the kernels
do not cover.

Each function here takes backend arrays and returns backend arrays; what it computes is defined
by the reference function of the same name. Matrix products are ``products.matmul_arrays``
(through cuBLASLt on a GPU), which every product of the trainer calls.
"""
import math
import numbers

import numpy as np

from ..core import backend, capture_checks
from . import attention_reference, reference, transformer_reference
from .loader import constant, instance_suffix, instances, launch
from .products import matmul_arrays

ACT_CODES = {act: code for code, act in enumerate(reference.ACTIVATIONS)}
# The optimizer updates' references are chains of elementwise passes over whole arrays. On the
# host they run over blocks of this many elements instead, so each pass after the first finds
# its block in cache: the same arithmetic, element by element, at a fraction of the memory
# traffic (docs/performance.md: Momentum over 1.86M parameters 5.3 -> 3.4 ms, Adam 24 -> 8.7).
HOST_BLOCK = 1 << 16


def _use_kernel(filename, *groups):
    """On a GPU, the suffix of the instance of ``filename``'s kernels for these arguments: each
    group holds the arrays (or dtypes) one type parameter of the kernel takes, in order. None on
    the CPU, for a group of several dtypes, or where the file has no such instance: the
    reference runs then."""
    if not backend.on_gpu():
        return None
    dtypes = []
    for group in groups:
        kinds = {a if isinstance(a, np.dtype) else a.dtype for a in group}
        if len(kinds) != 1:
            return None
        dtypes.append(kinds.pop())
    suffix = instance_suffix(*dtypes)
    return suffix if suffix in instances(filename) else None


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
    suffix = _use_kernel("bias_act.cu", (z, bias))
    if suffix is None:
        return reference.bias_act_forward(z, bias, act, xp)
    z = xp.ascontiguousarray(z)
    y = xp.empty_like(z)
    pre = xp.empty_like(z) if act in reference.INPUT_ACTIVATIONS else y
    n, channels, inner = _layout(z)
    launch("bias_act.cu", "bias_act_forward", suffix, n,
           (z, bias, y, pre, n, channels, inner, np.int32(ACT_CODES[act])))
    return y, (pre if act in reference.INPUT_ACTIVATIONS else None)


def bias_act_backward(dy, y, pre, act):
    xp = backend.array_module()
    pre_or_y = pre if pre is not None else y
    suffix = _use_kernel("bias_act.cu", (dy, y, pre_or_y))
    if suffix is None:
        return reference.bias_act_backward(dy, y, pre, act, xp)
    dy = xp.ascontiguousarray(dy)
    dz = xp.empty_like(dy)
    launch("bias_act.cu", "bias_act_backward", suffix, dy.size,
           (dy, y, pre_or_y, dz, np.int64(dy.size),
            np.int32(ACT_CODES[act])))
    return dz


def bn_act_forward(x, mean, invstd, gamma, beta):
    """``(y, xhat)``: the normalized input ``xhat`` where it was formed on the way (the
    reference), None from the device kernel, which never stores it."""
    xp = backend.array_module()
    suffix = _use_kernel("bn_act.cu", (x, mean, invstd, gamma, beta))
    if suffix is None:
        return reference.bn_act_forward(x, mean, invstd, gamma, beta, xp)
    x = xp.ascontiguousarray(x)
    y = xp.empty_like(x)
    n, channels, inner = _layout(x)
    launch("bn_act.cu", "bn_act_forward", suffix, n,
           (x, mean, invstd, gamma, beta, y, n, channels, inner))
    return y, None


def bn_act_backward_mask(dy, y):
    xp = backend.array_module()
    suffix = _use_kernel("bn_act.cu", (dy, y))
    if suffix is None:
        return reference.bn_act_backward_mask(dy, y)
    dy = xp.ascontiguousarray(dy)
    dz = xp.empty_like(dy)
    launch("bn_act.cu", "bn_act_backward_mask", suffix, dy.size,
           (dy, y, dz, np.int64(dy.size)))
    return dz


def bn_input_grad(dz, xhat, invstd, gamma, sum_dz, sum_dz_xhat, count):
    xp = backend.array_module()
    suffix = _use_kernel("bn_act.cu", (dz, xhat, invstd, gamma, sum_dz, sum_dz_xhat))
    if suffix is None:
        return reference.bn_input_grad(dz, xhat, invstd, gamma, sum_dz, sum_dz_xhat, count)
    dz = xp.ascontiguousarray(dz)
    dx = xp.empty_like(dz)
    n, channels, inner = _layout(dz)
    launch("bn_act.cu", "bn_input_grad", suffix, n,
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


_no_overflow = {}


def no_overflow():
    """A zero overflow flag (int32, one element) on the backend's device: what an update
    takes where amp found nothing to skip for. Shared, and only ever read."""
    xp = backend.array_module()
    if xp not in _no_overflow:
        _no_overflow[xp] = xp.zeros(1, dtype=np.int32)
    return _no_overflow[xp]


def reads_flag(found):
    """Whether amp's overflow flag ``found`` is read on the host: a NumPy flag (host memory,
    nothing waits) outside a CUDA graph capture. Inside one, and on a device, the flag is
    only ever selected on, so that the host stand-in of a graph runs the path a CUDA graph
    replays."""
    return isinstance(found, np.ndarray) and capture_checks.current is None


def where_found(found, arrays, values):
    """``arrays[i][...] = values[i]`` where amp's overflow flag ``found`` (a one-element int32
    backend array) is set; the arrays are left as they were otherwise (``reads_flag``: by a
    branch on the host, or by a select on the device)."""
    if reads_flag(found):
        if found[0]:
            for array, value in zip(arrays, values):
                array[...] = value
        return
    xp = backend.array_module()
    skip = found[0] != 0
    for array, value in zip(arrays, values):
        array[...] = xp.where(skip, value, array)


def unless_found(found, written, update):
    """Run ``update()`` but leave the arrays ``written`` as they were where amp's overflow
    flag ``found`` (or None for none) is set: on the host the update is not run; elsewhere
    it runs and a select puts the arrays back, with no wait on the host for the flag."""
    if found is None or reads_flag(found):
        if found is None or not found[0]:
            update()
        return
    saved = [array.copy() for array in written]
    update()
    where_found(found, written, saved)


def _multi_tensor(kernel, kinds, reference_update, scalars, found, *reference_args):
    """Run ``reference_update(*arrays of one run, *reference_args)`` for every run of
    ``kinds`` (the parameters, the gradients, then each state), on a GPU as one launch of
    ``multi_tensor_<kernel>`` per dtype with ``scalars(dtype)`` after the table. Where the
    overflow flag ``found`` is set, the reference leaves parameters and state untouched (the
    kernels take the flag among their scalars)."""
    for dtype, group in _by_dtype(kinds):
        suffix = _use_kernel("optimizer.cu", [run for arrays in group for run in arrays])
        if suffix is None:
            def update(group=group):
                for arrays in zip(*group):
                    _host_blocks(reference_update, arrays, *reference_args)
            unless_found(found, [run for index, arrays in enumerate(group) if index != 1
                                 for run in arrays], update)
            continue
        table, offsets, total = _table(group)
        launch("optimizer.cu", f"multi_tensor_{kernel}", suffix, total,
               (table, offsets, np.int32(len(group[0])), *scalars(dtype.type)))


def _flag(found):
    return no_overflow() if found is None else found


def multi_tensor_sgd_update(params, grads, lr, weight_decay, found=None):
    """``reference.sgd_update`` of every ``(params[i], grads[i])``, unless ``found`` (amp's
    overflow flag) is set."""
    _multi_tensor("sgd", [params, grads], reference.sgd_update,
                  lambda t: (_flag(found), t(lr), t(weight_decay)), found, lr, weight_decay)


def multi_tensor_momentum_update(params, grads, velocities, lr, momentum, weight_decay,
                                 nesterov, found=None):
    """``reference.momentum_update`` of every ``(params[i], grads[i], velocities[i])``, unless
    ``found`` (amp's overflow flag) is set."""
    _multi_tensor("momentum", [params, grads, velocities], reference.momentum_update,
                  lambda t: (_flag(found), t(lr), t(momentum), t(weight_decay),
                             np.int32(bool(nesterov))),
                  found, lr, momentum, weight_decay, nesterov)


def multi_tensor_adam_update(params, grads, moment1s, moment2s, lr, beta1, beta2, epsilon,
                             step_count, weight_decay, decoupled, found=None):
    """``reference.adam_update`` of every ``(params[i], grads[i], moment1s[i],
    moment2s[i])``, unless ``found`` (amp's overflow flag) is set. ``step_count``: a host
    integer or a one-element int64 backend array (the kernel reads its count on the device)."""
    xp = backend.array_module()
    l2 = 0.0 if decoupled else weight_decay
    scale = 1 - lr * weight_decay if decoupled else 1.0

    def scalars(t):
        steps = step_count
        if isinstance(steps, numbers.Integral):
            steps = xp.full(1, steps, dtype=np.int64)
        return (_flag(found), steps, np.float64(lr), np.float64(beta1), np.float64(beta2),
                np.float64(epsilon), t(l2), t(scale))
    _multi_tensor("adam", [params, grads, moment1s, moment2s], reference.adam_update, scalars,
                  found, lr, beta1, beta2, epsilon, step_count, weight_decay, decoupled, xp)


def multi_tensor_unscale(grads, inverse, found):
    """amp's unscale and overflow check in one pass: every array of ``grads`` multiplied by
    ``inverse`` (1 / loss scale, a one-element float32 backend array) in place, and
    ``found[0]`` (an int32 backend array) set to 1 when any result is inf or NaN, left as it
    was otherwise; nothing is read on the host."""
    _multi_tensor("unscale", [grads], reference.unscale, lambda t: (inverse, found), None,
                  inverse, found)


def multi_tensor_check_finite(grads, found):
    """``found[0]`` (an int32 backend array) set to 1 when any element of ``grads`` is inf or
    NaN, left as it was otherwise, in one launch per dtype on a GPU (amp's overflow check
    without the unscale); nothing is read on the host. On the CPU each array is checked whole:
    its probe (``reference.check_finite``) makes no temporary of the array's size, so
    cache-sized blocks (``HOST_BLOCK``) would only add calls (the MLP's 1.86M gradients of
    benchmarks/train_throughput.py: 0.3 ms whole, 0.7 in blocks, on one thread)."""
    if not backend.on_gpu():
        for grad in grads:
            reference.check_finite(grad, found)
        return
    _multi_tensor("check_finite", [grads], reference.check_finite, lambda t: (found,), None,
                  found)


def layer_norm_forward(x, weight, bias, epsilon):
    """``(y, mean, rstd, xhat)``: the normalized input ``xhat`` where it was formed on the way
    (the reference), None from the device kernel, which never stores it."""
    xp = backend.array_module()
    compute = transformer_reference.compute_dtype(x.dtype)
    suffix = _use_kernel("layer_norm.cu", (x,), (compute, weight, bias))
    if suffix is None:
        return transformer_reference.layer_norm_forward(x, weight, bias, epsilon, xp)
    x = xp.ascontiguousarray(x)
    rows = x.size // weight.size
    y = xp.empty_like(x)
    statistics = x.shape[:x.ndim - weight.ndim] + (1,) * weight.ndim
    mean, rstd = xp.empty(statistics, compute), xp.empty(statistics, compute)
    launch("layer_norm.cu", "layer_norm_forward", suffix, rows,
           (x, xp.ascontiguousarray(weight), xp.ascontiguousarray(bias), y, mean, rstd,
            np.int64(rows), np.int64(weight.size), compute.type(epsilon)))
    return y, mean, rstd, None


def layer_norm_backward(dy, x, mean, rstd, xhat, weight):
    """``(dx, dweight, dbias)`` from the normalized input ``xhat`` where forward kept it, else
    from ``x`` and the statistics (the device kernel forms ``xhat`` again as it goes)."""
    xp = backend.array_module()
    suffix = None if xhat is not None else _use_kernel("layer_norm.cu", (dy, x),
                                                       (mean, rstd, weight))
    if suffix is None:
        if xhat is None:
            xhat = transformer_reference.layer_norm_xhat(x, mean, rstd)
        return transformer_reference.layer_norm_backward(dy, xhat, rstd, weight)
    dy = xp.ascontiguousarray(dy)
    rows, cols = dy.size // weight.size, weight.size
    dx = xp.empty_like(dy)
    dweight, dbias = xp.empty(weight.shape, mean.dtype), xp.empty(weight.shape, mean.dtype)
    launch("layer_norm.cu", "layer_norm_backward", suffix, rows + cols,
           (dy, xp.ascontiguousarray(x), mean, rstd, xp.ascontiguousarray(weight), dx, dweight,
            dbias, np.int64(rows), np.int64(cols)))
    return dx, dweight, dbias


def softmax_cross_entropy_forward(logits, labels):
    """``(loss, log_probs, row_max, row_logsum)`` of 2-d ``logits``: ``log_probs`` from the
    reference, which backward uses; None from the device kernel, which keeps only the row
    statistics (backward forms the softmax again from the logits)."""
    xp = backend.array_module()
    compute = transformer_reference.compute_dtype(logits.dtype)
    suffix = _use_kernel("softmax_cross_entropy.cu", (logits,), (compute,))
    if suffix is None:
        return transformer_reference.softmax_cross_entropy_forward(logits, labels, xp)
    logits = xp.ascontiguousarray(logits)
    rows, classes = logits.shape
    loss, row_max, row_logsum = (xp.empty(rows, compute) for _ in range(3))
    launch("softmax_cross_entropy.cu", "softmax_cross_entropy_forward", suffix, rows,
           (logits, xp.ascontiguousarray(labels, dtype=np.int64), loss, row_max, row_logsum,
            np.int64(rows), np.int64(classes)))
    return loss, None, row_max.reshape(rows, 1), row_logsum.reshape(rows, 1)


def softmax_cross_entropy_backward(logits, labels, log_probs, row_max, row_logsum, scale,
                                   dtype):
    """The logits' gradient in ``dtype``, ``(softmax - onehot) * scale``: from ``log_probs``
    where forward kept them (``logits`` may be None then), else by the device kernel from
    ``logits`` and the row statistics."""
    xp = backend.array_module()
    if log_probs is None:
        suffix = _use_kernel("softmax_cross_entropy.cu", (logits,), (row_max, row_logsum))
        if suffix is not None:
            logits = xp.ascontiguousarray(logits)
            rows, classes = logits.shape
            scale = xp.ascontiguousarray(scale, dtype=row_max.dtype).reshape(-1)
            grad = xp.empty_like(logits)
            launch("softmax_cross_entropy.cu", "softmax_cross_entropy_backward", suffix,
                   logits.size, (logits, xp.ascontiguousarray(labels, dtype=np.int64),
                                 row_max, row_logsum, scale, grad, np.int64(logits.size),
                                 np.int64(classes), np.int64(scale.size > 1)))
            return grad
        log_probs = transformer_reference.log_probs(logits, row_max, row_logsum)
    return transformer_reference.softmax_cross_entropy_backward(log_probs, labels, scale, dtype,
                                                                xp)


def dropout_add_forward(x, residual, draws, p):
    """``(residual + dropout(x), keep)`` with ``keep = draws >= p``."""
    xp = backend.array_module()
    suffix = _use_kernel("dropout_add.cu", (x,), (residual,))
    if suffix is None:
        return transformer_reference.dropout_add_forward(x, residual, draws, p)
    x, residual = xp.ascontiguousarray(x), xp.ascontiguousarray(residual)
    y = xp.empty_like(residual)
    keep = xp.empty(x.shape, dtype=np.bool_)
    launch("dropout_add.cu", "dropout_add_forward", suffix, x.size,
           (x, residual, xp.ascontiguousarray(draws), y, keep, np.int64(x.size), np.float64(p),
            np.float64(x.dtype.type(1.0 / (1.0 - p)))))
    return y, keep


def dropout_add_backward(dy, keep, p, dtype):
    """The gradient of ``x`` in its ``dtype``; the residual's is ``dy``."""
    xp = backend.array_module()
    dtype = np.dtype(dtype)
    suffix = _use_kernel("dropout_add.cu", (dtype,), (dy,))
    if suffix is None:
        return transformer_reference.dropout_add_backward(dy, keep, p, dtype)
    dy = xp.ascontiguousarray(dy)
    dx = xp.empty(dy.shape, dtype=dtype)
    launch("dropout_add.cu", "dropout_add_backward", suffix, dy.size,
           (dy, keep, dx, np.int64(dy.size), np.float64(dtype.type(1.0 / (1.0 - p)))))
    return dx


def _attention_suffix(dtypes, head_dim, value_dim):
    """The instance of ``attention.cu`` for inputs of ``dtypes`` (query, key, value) with these
    head sizes, or None: off the GPU, for dtypes it has no instance of, for a head larger than
    the rows its threads hold."""
    if max(head_dim, value_dim) > constant("attention.cu", "MAX_HEAD_DIM"):
        return None
    compute = transformer_reference.compute_dtype(np.result_type(*dtypes))
    return _use_kernel("attention.cu", tuple(np.dtype(d) for d in dtypes), (compute,))


def attention_runs_kernel(dtypes, head_dim, value_dim):
    """Whether ``attention_forward`` and ``attention_backward`` run ``attention.cu`` (rather
    than the reference) for inputs of ``dtypes`` (query, key, value) with these head sizes."""
    return _attention_suffix(dtypes, head_dim, value_dim) is not None


def _attention_mask(mask, scores_shape, compute, xp):
    """``attention.cu``'s mask arguments for ``mask`` (None, boolean or float) broadcasting to
    ``scores_shape``: the arrays ``(keep, bias, mask_offset)`` and the scalars
    ``(mask_row_stride, mask_col_stride, mask_kind)``; the mask is passed at its own size, each
    folded batch index pointing at the slab it reads."""
    keep, bias = xp.zeros(1, dtype=np.bool_), xp.zeros(1, dtype=compute)
    if mask is None:
        return (keep, bias, xp.zeros(1, dtype=np.int64)), (np.int64(0), np.int64(0), np.int32(0))
    shape = (1,) * (len(scores_shape) - mask.ndim) + tuple(mask.shape)
    rows, columns = shape[-2:]
    slabs = np.arange(math.prod(shape[:-2]), dtype=np.int64).reshape(shape[:-2])
    offsets = xp.asarray(np.broadcast_to(slabs, scores_shape[:-2]).reshape(-1) * (rows * columns))
    strides = (np.int64(columns if rows > 1 else 0), np.int64(1 if columns > 1 else 0))
    if mask.dtype == np.bool_:
        return (xp.ascontiguousarray(mask), bias, offsets), strides + (np.int32(1),)
    return (keep, xp.ascontiguousarray(mask, dtype=compute), offsets), strides + (np.int32(2),)


def _attention_operands(query, key, value, mask, is_causal, xp):
    """What every kernel of ``attention.cu`` takes besides its outputs and row count:
    ``(q, k, v)`` contiguous, the mask's arrays, the sizes ``(q_len, k_len, head_dim,
    value_dim)`` and the trailing scalars (the mask's, ``is_causal``, ``scale``)."""
    compute = transformer_reference.compute_dtype(query.dtype)
    q_len, head_dim = query.shape[-2:]
    k_len, value_dim = value.shape[-2:]
    mask_arrays, mask_scalars = _attention_mask(mask, query.shape[:-1] + (k_len,), compute, xp)
    sizes = tuple(np.int64(n) for n in (q_len, k_len, head_dim, value_dim))
    tail = mask_scalars + (np.int32(bool(is_causal)), compute.type(1.0 / math.sqrt(head_dim)))
    return tuple(xp.ascontiguousarray(a) for a in (query, key, value)), mask_arrays, sizes, tail


def attention_forward(query, key, value, mask, is_causal):
    """``(out, lse)``: the attention of ``query`` ``(..., q_len, head_dim)`` over ``key``
    ``(..., k_len, head_dim)`` and ``value`` ``(..., k_len, value_dim)`` and each query row's
    log-sum-exp, as ``attention_reference.attention_forward`` defines them; ``mask`` None,
    boolean or float, broadcasting to the scores' shape with at most as many axes."""
    xp = backend.array_module()
    suffix = _attention_suffix((query.dtype, key.dtype, value.dtype), query.shape[-1],
                               value.shape[-1])
    if suffix is None:
        return attention_reference.attention_forward(query, key, value, mask, is_causal, xp)
    qkv, mask_arrays, sizes, tail = _attention_operands(query, key, value, mask, is_causal, xp)
    rows = math.prod(query.shape[:-1])
    out = xp.empty(query.shape[:-1] + value.shape[-1:], dtype=query.dtype)
    lse = xp.empty(query.shape[:-1], dtype=transformer_reference.compute_dtype(query.dtype))
    launch("attention.cu", "attention_forward", suffix, rows,
           qkv + mask_arrays + (out, lse, np.int64(rows)) + sizes + tail)
    return out, lse


def attention_backward(dout, query, key, value, out, lse, mask, is_causal):
    """``(dquery, dkey, dvalue)`` of ``attention_forward`` from its ``out`` and ``lse`` and the
    output's gradient ``dout`` (``attention_reference.attention_backward``): each row's
    ``rowsum(dout * out)`` first, then one kernel over the query rows and the key rows."""
    xp = backend.array_module()
    suffix = _attention_suffix((query.dtype, key.dtype, value.dtype), query.shape[-1],
                               value.shape[-1])
    if suffix is None:
        return attention_reference.attention_backward(dout, query, key, value, out, lse, mask,
                                                      is_causal, xp)
    qkv, mask_arrays, sizes, tail = _attention_operands(query, key, value, mask, is_causal, xp)
    dout = xp.ascontiguousarray(dout, dtype=query.dtype)
    lse = xp.ascontiguousarray(lse)
    delta = xp.ascontiguousarray(attention_reference.attention_delta(dout, out, lse.dtype))
    grads = tuple(xp.empty_like(a) for a in qkv)
    batch = math.prod(query.shape[:-2])
    launch("attention.cu", "attention_backward", suffix, batch * (sizes[0] + sizes[1]),
           qkv + (dout, lse, delta) + mask_arrays + grads + (np.int64(batch),) + sizes + tail)
    return grads

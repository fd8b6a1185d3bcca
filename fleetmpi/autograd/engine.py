"""Backward over the recorded graph.

The graph is what ran: each recorded ``Function`` call (a node) keeps the input tensors that
need gradients, and each output tensor points back at the node that made it. ``run_backward``
first walks the graph from the roots and counts, for every node, how many edges lead into it
and, for every leaf tensor (a parameter, or a tensor made with ``stop_gradient=False``), how
many uses it has. It then calls the nodes' ``backward`` newest first (reverse creation order
among the nodes whose gradients are complete), so every rank that ran the same program
visits the same nodes in the same order. A leaf's gradient is final when the last of its uses
has been visited: that is when ``on_leaf_ready(leaf)`` is called, which is where gradient
reduction starts on a bucket while backward goes on. Gradients accumulate into ``leaf.grad``
(a weight used twice gets both contributions). Hooks (``Tensor.register_hook``) see a
tensor's whole gradient of the backward and may replace it: a non-leaf's before its node's
``backward`` runs, a leaf's before it is added to ``grad``. A gradient whose shape is a
broadcast of its input's is summed back to the input's shape, and one of another dtype is
cast to the input's.

The graph is freed as backward visits it; a second backward through it is an error.

``set_step_driver``: while a training step of a distributed optimizer is open, ``backward()``
on a tensor goes through the step (its strategies' backward stages and gradient hooks).
"""
import heapq

from ..core import backend
from . import nan_inf

_driver = None


def set_step_driver(driver):
    """Route ``Tensor.backward`` through ``driver(tensor, grad)`` (None: straight to
    ``run_backward``); returns the driver it replaces."""
    global _driver
    previous, _driver = _driver, driver
    return previous


def backward(tensor, grad=None):
    """What ``Tensor.backward`` runs: through the open step's driver, if there is one."""
    if _driver is not None:
        return _driver(tensor, grad)
    return run_backward([tensor], [grad])


def sum_to_shape(grad, shape):
    """``grad`` summed over the axes along which an input of ``shape`` was broadcast."""
    if grad.shape == shape:
        return grad
    extra = grad.ndim - len(shape)
    if extra > 0:
        grad = grad.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    if axes:
        grad = grad.sum(axis=axes, keepdims=True)
    return grad.reshape(shape)


def _array(value):
    """The array of a tensor (anything with a graph link), or ``value`` itself."""
    return value.data if hasattr(value, "_node") else value


def _conformed(grad, like):
    """``grad`` in the shape and dtype of ``like`` (a tensor, or a call's ``Edge`` to one)."""
    grad = sum_to_shape(grad, tuple(like.shape))
    return grad if grad.dtype == like.dtype else grad.astype(like.dtype)


def _root_grad(tensor, grad):
    xp = backend.array_module()
    if grad is None:
        if tensor.data.size != 1:
            raise RuntimeError(f"backward() of a tensor of shape {tuple(tensor.shape)} needs "
                               "grad, the gradient of what it feeds; only a one-element "
                               "tensor (a loss) has the implied grad of 1")
        return xp.ones_like(tensor.data)
    grad = xp.asarray(_array(grad), dtype=tensor.data.dtype)
    if grad.shape != tensor.data.shape:
        raise ValueError(f"backward grad has shape {tuple(grad.shape)}, the tensor "
                         f"{tuple(tensor.shape)}")
    return grad


def _count_uses(roots):
    """``(node uses, leaf uses, leaves)``: how many recorded edges lead into each node and each
    leaf of the graph below ``roots``."""
    node_uses, leaf_uses, leaves = {}, {}, {}
    stack = []
    seen = set()
    for root in roots:
        node = root._node
        if node is not None and id(node) not in seen:
            seen.add(id(node))
            stack.append(node)
    while stack:
        node = stack.pop()
        if node._inputs is None:
            raise RuntimeError(f"backward through the graph of a {type(node).__name__} a second "
                               "time: a graph is freed by the backward that visits it; run the "
                               "forward again")
        for _, tensor in node._inputs:
            child = tensor._node
            if child is None:
                key = id(tensor)
                leaf_uses[key] = leaf_uses.get(key, 0) + 1
                leaves[key] = tensor
            else:
                node_uses[id(child)] = node_uses.get(id(child), 0) + 1
                if id(child) not in seen:
                    seen.add(id(child))
                    stack.append(child)
    return node_uses, leaf_uses, leaves


def _store_leaf(leaf, grad):
    accumulate = getattr(leaf, "accumulate_grad", None)
    if accumulate is not None:
        accumulate(grad)
    elif leaf._grad is None:
        leaf._grad = grad.copy()
    else:
        leaf._grad += grad


def _hooked(hooks, grad):
    """``grad`` (an array) through each of ``hooks`` in turn: a hook gets the array and
    returns the array to use instead, or None to keep it (``Tensor.register_hook`` wraps a
    user's hook, which works on Tensors)."""
    for hook in hooks:
        replaced = hook(grad)
        if replaced is not None:
            grad = replaced
    return grad


def _accumulate_leaf(leaf, grad, held):
    """Add ``grad`` to the leaf's gradient; for a leaf with hooks, to ``held`` instead, where
    its contributions are summed until the last use has been visited (``_leaf_done``), so
    that its hooks see the whole gradient of this backward, as Paddle's do."""
    grad = _conformed(_array(grad), leaf)
    if not leaf._hooks:
        _store_leaf(leaf, grad)
    elif id(leaf) in held:
        held[id(leaf)] = held[id(leaf)] + grad
    else:
        # a copy: grad may be the parameter's gradient storage, which the next use may reuse
        held[id(leaf)] = grad.copy()


def _leaf_done(leaf, held, on_leaf_ready):
    """The last use of ``leaf`` has been visited: its hooks run, its gradient is final."""
    grad = held.pop(id(leaf), None)
    if grad is not None:
        _store_leaf(leaf, _hooked(leaf._hooks, grad))
    if on_leaf_ready is not None:
        on_leaf_ready(leaf)


def _add_pending(pending, node, index, grad):
    slots = pending.get(node)
    if slots is None:
        slots = pending[node] = [None] * node._n_outputs
    slots[index] = grad if slots[index] is None else slots[index] + grad


def run_backward(roots, grads, on_leaf_ready=None):
    """Backpropagate ``grads`` (arrays, or None for a one-element root) from the tensors
    ``roots`` into the leaves' ``grad``; ``on_leaf_ready(leaf)`` as each leaf's gradient
    becomes final."""
    for root in roots:
        if root.stop_gradient:
            raise RuntimeError("backward() of a tensor that does not require a gradient "
                               "(stop_gradient=True): none of its inputs required one, or it "
                               "was computed under no_grad()")
    node_uses, leaf_uses, _ = _count_uses(roots)
    pending = {}
    held = {}
    heap = []
    for root, grad in zip(roots, grads):
        grad = _root_grad(root, grad)
        node = root._node
        if node is None:
            _accumulate_leaf(root, grad, held)
            if leaf_uses.get(id(root), 0) == 0:
                _leaf_done(root, held, on_leaf_ready)
            continue
        fresh = node not in pending
        _add_pending(pending, node, root._index, grad)
        if fresh and node_uses.get(id(node), 0) == 0:
            heapq.heappush(heap, (-node._seq, node))
    while heap:
        node = heapq.heappop(heap)[1]
        packed = node._packed
        if packed is not None:
            packed.unpack(node)
            node._packed = None
        out_grads = pending.pop(node)
        if node._hooks:
            for index, hooks in node._hooks.items():
                if out_grads[index] is not None:
                    out_grads[index] = _hooked(hooks, out_grads[index])
        in_grads = type(node).backward(node, *out_grads)
        if packed is not None:
            packed.release(node)
        if not isinstance(in_grads, tuple):
            in_grads = (in_grads,)
        if nan_inf.enabled:
            nan_inf.check(node, in_grads, node._layers, "backward")
        inputs = node._inputs
        node._inputs = node._saved = None
        count = len(in_grads)
        for position, tensor in inputs:
            grad = in_grads[position] if position < count else None
            child = tensor._node
            if child is None:
                if grad is not None:
                    _accumulate_leaf(tensor, grad, held)
                key = id(tensor)
                leaf_uses[key] -= 1
                if leaf_uses[key] == 0:
                    _leaf_done(tensor, held, on_leaf_ready)
                continue
            if grad is not None:
                _add_pending(pending, child, tensor._index, _conformed(_array(grad), tensor))
            key = id(child)
            node_uses[key] -= 1
            if node_uses[key] == 0:
                if child not in pending:
                    pending[child] = [None] * child._n_outputs
                heapq.heappush(heap, (-child._seq, child))

"""``Tensor``: an array of the backend (NumPy or CuPy) that remembers the operation that made
it, so ``backward()`` can compute gradients (define-by-run, as Chainer and Paddle dygraph).

``stop_gradient`` is Paddle's flag (``requires_grad`` is its negation, PyTorch's name): a
tensor made by ``to_tensor`` does not require a gradient unless asked; parameters do; the
result of an operation requires one when any of its inputs does and recording is on (not
inside ``no_grad``). ``grad`` is a Tensor, as Paddle's, over the gradient array itself (for a
parameter, a view into the model's flat gradient buffer): ``grad.data`` is that array, which
the trainer and the strategies read and write; writing into ``grad`` (``p.grad[...] = 0``)
writes the gradient. ``shape`` is a list, as Paddle's. Python operators and methods (``+``,
``@``, ``sum``, ``reshape``, indexing...) are installed by ``fleetmpi.autograd.operations``.

The interface strategies use here is the keeper protocol: a strategy that holds a parameter's
values elsewhere (sharding stage 3) binds itself with ``Parameter.bind_keeper`` and provides
``fetch(tensor)`` and ``after_forward(node)``, as the comment on ``Tensor._keeper`` says.
"""
import numpy as np

from ..core import backend
from ..core.capture_checks import check_host_read
from . import engine
from . import grad_mode as _grad_mode


class Tensor:
    """An array and its place in the recorded graph (``_node``: the call that made it, None
    for a leaf; ``_index``: which of that call's outputs it is)."""

    # NumPy defers to the Tensor's reflected operators (ndarray + Tensor gives a Tensor).
    __array_ufunc__ = None
    # What provides a leaf's values while an operation uses them, when they are not kept
    # (``Parameter.bind_keeper``; sharding stage 3 binds one per parameter): the keeper's
    # ``fetch(tensor)`` gives the array, and its ``after_forward(node)`` may replace arrays the
    # recorded call ``node`` saved in its attributes and return a record whose
    # ``unpack(node)`` puts them back before the call's backward (None: nothing replaced)
    # and whose ``release(node)`` says that the backward is over (the graph is freed).
    _keeper = None

    # Gradient hooks of a leaf (``register_hook``); a non-leaf's are its node's.
    _hooks = None

    def __init__(self, data, stop_gradient=True):
        self.data = data
        self.stop_gradient = stop_gradient
        self._grad = None
        self._node = None
        self._index = 0
        self.name = None

    # -- what it is -------------------------------------------------------------------------
    @property
    def requires_grad(self):
        return not self.stop_gradient

    @requires_grad.setter
    def requires_grad(self, value):
        self.stop_gradient = not value

    @property
    def shape(self):
        """The dimensions as a list, as Paddle's ``shape`` (``data.shape`` is the tuple)."""
        return list(self.data.shape)

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self):
        return self.data.ndim

    @property
    def size(self):
        return int(self.data.size)

    @property
    def is_leaf(self):
        return self._node is None

    def __len__(self):
        return len(self.data)

    # -- values -----------------------------------------------------------------------------
    def numpy(self):
        """The values as a host NumPy array (a copy from the GPU; the array itself on CPU)."""
        check_host_read("Tensor.numpy()")
        return backend.to_numpy(self.data)

    # Each read of the values on the host is refused inside a CUDA graph capture
    # (fleetmpi.core.capture_checks), a Python branch on a tensor (bool) among them.
    def item(self):
        check_host_read("Tensor.item()")
        return self.data.item()

    def __float__(self):
        check_host_read("float(tensor)")
        return float(self.data)

    def __int__(self):
        check_host_read("int(tensor)")
        return int(self.data)

    def __bool__(self):
        check_host_read("a Python branch on a tensor (bool(tensor))")
        return bool(self.data)

    def __array__(self, dtype=None, copy=None):
        array = self.numpy()
        return array if dtype is None else array.astype(dtype)

    def set_value(self, value):
        """Overwrite the values in place (Paddle's ``set_value``); the shape must match."""
        value = value.data if isinstance(value, Tensor) else value
        value = np.asarray(value) if isinstance(value, (list, tuple, float, int)) else value
        if tuple(value.shape) != tuple(self.shape):
            raise ValueError(f"set_value got shape {tuple(value.shape)} for a tensor of shape "
                             f"{tuple(self.shape)}")
        self.data[...] = backend.asarray(value)

    def cpu(self):
        """The values on the host, as a new tensor outside the graph (Paddle's ``cpu()``):
        a copy from the GPU, the same array on the CPU."""
        return Tensor(self.numpy(), stop_gradient=True)

    def cuda(self):
        """The values on this rank's GPU (Paddle's ``cuda()``): each rank drives one device, so
        there is no index to choose; a ValueError on the CPU backend."""
        return self.to("gpu")

    def to(self, device=None, dtype=None, blocking=None):
        """Paddle's ``to``: on ``device`` (``"cpu"``, or ``"gpu"`` / ``"gpu:N"`` for this rank's
        GPU, the only one a rank drives), in ``dtype`` (as ``astype``, recorded in the graph)."""
        moved = self
        if device is not None:
            place = str(device).lower()
            if place == "cpu":
                moved = self.cpu()
            elif place == "gpu" or place.startswith(("gpu:", "cuda")):
                if not backend.on_gpu():
                    raise ValueError(f"to({device!r}): this process runs on the CPU backend "
                                     "(FLEETMPI_DEVICE=gpu with a CUDA device selects the GPU)")
                if isinstance(self.data, np.ndarray):  # a host tensor, made before the move
                    moved = Tensor(backend.asarray(self.data), stop_gradient=self.stop_gradient)
            else:
                raise ValueError(f"device={device!r} is not known; allowed: 'cpu', 'gpu', "
                                 "'gpu:N'")
        return moved if dtype is None else moved.astype(dtype)

    def detach(self):
        """The same values, cut from the graph (no gradient flows through)."""
        return Tensor(self.data, stop_gradient=True)

    def __setitem__(self, index, value):
        """Write ``value`` into the selected elements in place (Paddle's ``x[i] = v``); not
        on a tensor that requires a gradient while recording, whose old values the graph may
        still need."""
        if not self.stop_gradient and _grad_mode.is_grad_enabled():
            raise RuntimeError("x[...] = value on a tensor that requires a gradient "
                               "(stop_gradient=False) would change values its graph may need; "
                               "write under fleetmpi.no_grad(), or into x.clone()")
        if isinstance(index, tuple):
            index = tuple(as_array(i) for i in index)
        self.data[as_array(index)] = backend.asarray(as_array(value))

    # -- gradients --------------------------------------------------------------------------
    @property
    def grad(self):
        """The gradient, a Tensor over the gradient array (module docstring); None before a
        backward reached this tensor."""
        array = self._gradient_array()
        return None if array is None else Tensor(array)

    @grad.setter
    def grad(self, value):
        self._set_gradient(None if value is None else backend.asarray(as_array(value)))

    def _gradient_array(self):
        return self._grad

    def _set_gradient(self, array):
        self._grad = array

    def gradient(self):
        """The gradient as a host NumPy array (Paddle's ``gradient()``), None if there is
        none."""
        grad = self.grad
        return None if grad is None else grad.numpy()

    def register_hook(self, hook):
        """Call ``hook(grad)`` with this tensor's gradient (a Tensor) during each backward,
        before it is used (passed on, or added to ``grad`` for a leaf); a Tensor it returns
        replaces the gradient. Returns a handle whose ``remove()`` takes the hook away."""
        if self.stop_gradient:
            raise RuntimeError("register_hook on a tensor that does not require a gradient "
                               "(stop_gradient=True): no gradient reaches it")
        if not callable(hook):
            raise TypeError(f"register_hook takes a callable, not {type(hook).__name__}")

        def on_array(array):
            replaced = hook(Tensor(array))
            return None if replaced is None else backend.asarray(as_array(replaced))
        if self._node is None:
            if self._hooks is None:
                self._hooks = []
            hooks = self._hooks
        else:
            if self._node._hooks is None:
                self._node._hooks = {}
            hooks = self._node._hooks.setdefault(self._index, [])
        hooks.append(on_array)
        return HookRemoveHelper(hooks, on_array)

    def backward(self, grad=None, retain_graph=False):
        """Accumulate the gradients of this tensor into the leaves it was computed from.
        ``grad``: the gradient of what this tensor feeds (implied 1 for a one-element tensor).
        The graph is freed; ``retain_graph=True`` is not supported."""
        if retain_graph:
            raise NotImplementedError("retain_graph=True is not supported: a graph is freed "
                                      "by its backward; run the forward again")
        engine.backward(self, grad)

    def clear_gradient(self):
        """Zero ``grad`` (Paddle's name; ``clear_grad`` is the same)."""
        if self._grad is not None:
            self._grad[...] = 0

    clear_grad = clear_gradient

    def __repr__(self):
        grad = "" if self.stop_gradient else ", stop_gradient=False"
        return (f"Tensor(shape={list(self.shape)}, dtype={self.dtype}{grad},\n       "
                f"{np.array2string(self.numpy(), prefix='       ')})")

    # Tensors are compared by identity, so they can be dict keys and set members.
    __hash__ = object.__hash__


class HookRemoveHelper:
    """What ``register_hook`` (and a Layer's hook registrations) return: ``remove()`` takes
    the hook away."""

    def __init__(self, hooks, hook):
        self._hooks, self._hook = hooks, hook

    def remove(self):
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)
            return True
        return False


def to_tensor(data, dtype=None, stop_gradient=True):
    """A leaf tensor of ``data`` (a NumPy/CuPy array, a list, a number or a Tensor) on the
    backend's device; Paddle's ``paddle.to_tensor``."""
    if isinstance(data, Tensor):
        data = data.data
    array = backend.asarray(data, dtype=dtype)
    return Tensor(array, stop_gradient=stop_gradient)


def as_array(value):
    """The backend array of a Tensor, or of an array-like."""
    if isinstance(value, Tensor):
        return value.data
    return value


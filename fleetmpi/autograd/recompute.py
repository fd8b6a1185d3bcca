"""``recompute``: run a function or layer without keeping what it computes inside, and run it
again in backward (activation checkpointing; Paddle's ``fleet.utils.recompute``).

Forward runs ``function(*args, **kwargs)`` under ``no_grad``, so nothing inside is recorded
and only its inputs are kept. One node is recorded in its place (``Recomputation``); its inputs
are the positional Tensor arguments that need a gradient and the parameters of the layers the
function computes with. Its backward runs the function again from the kept inputs with
recording on and backpropagates the output gradients through what that recorded
(``engine.run_backward``): parameter gradients accumulate as they would have without
recompute, and the inputs' gradients go back to the backward that called it. The parameters
are inputs of the node so that that backward reports each of them final (``on_leaf_ready``,
where gradient reduction starts) only after the recomputation added to it, and in the order
the recomputation finished them, which is the order of the run without recompute.

The recomputation repeats the first run bit for bit: the same operations on the same inputs,
the rank generator and the generators of the RNG state tracker (``fleetmpi.core.rng_tracker``)
replaying their draws (dropout masks), the autocast policy that was current
at forward entered again (amp), and the layers' buffers (batch-norm running statistics) put
back afterwards as the first run left them, so they move once per step. Gradients are those of
the run without recompute bit for bit, with one exception: an input used more than once inside
the function and again by an operation after it gets its gradient contributions summed in
another order (the inside ones first), which can differ in the last bit.

Which layers a function computes with: the function itself when it is a layer (anything with
``named_sublayers``, ``own_parameters`` and ``buffers``, as ``nn.Layer``), the layer of a
bound method, the function and arguments of a ``functools.partial``, and the layers, their
bound methods and the Tensors that need a gradient held by the function's closure (the
``create_custom_forward(layer)`` idiom). A parameter the function reaches some other way still
gets its gradient; it is just not reported final during backward (a gradient reduction then
takes it at the end of backward). Tensors that need a gradient must come in as positional
arguments or be found that way: one reached otherwise (a keyword argument, a global) is
refused in backward with a clear error.

``ActivationMeter`` measures what a recorded graph holds for backward, the quantity recompute
lowers.
"""
import functools

from ..core import backend
from ..core.rng_tracker import get_rng_state_tracker
from . import function as _function
from . import grad_mode
from .autocast import autocast, current_policy
from .engine import run_backward
from .function import Function
from .tensor import Tensor

# -- the rank generator: dropout masks drawn again exactly as in forward ---------------------


class _DrawRecorder:
    """Stands in for the rank generator (``backend.rank_rng()``) while a function runs
    forward. The first draw snapshots the generator's state first, so the recomputation can
    replay the draws; functions that draw nothing cost no snapshot (on a GPU the state is
    megabytes)."""

    def __init__(self, generator):
        self._generator = generator
        self.state = None

    def __getattr__(self, name):
        if self.state is None:
            self.state = backend.rank_rng_snapshot(self._generator)
        return getattr(self._generator, name)


def run_recording_draws(run):
    """``run()`` with the rank generator and the tracker's generators watched; returns
    ``(result, states)``, ``{name: state}`` to replay the draws from (the rank generator's
    under None), empty when it drew nothing."""
    tracker = get_rng_state_tracker()
    named = dict(tracker.generators)
    recorders = {name: _DrawRecorder(g) for name, g in named.items()}
    recorder = _DrawRecorder(backend.rank_rng())
    tracker.generators.update(recorders)
    try:
        with backend.rank_rng_replaced(recorder):
            result = run()
    finally:
        for name, generator in named.items():
            if tracker.generators.get(name) is recorders[name]:
                tracker.generators[name] = generator
    recorders[None] = recorder
    return result, {name: r.state for name, r in recorders.items() if r.state is not None}


def _generator(name):
    return backend.rank_rng() if name is None else get_rng_state_tracker().generators[name]


def run_replaying_draws(run, states):
    """``run()`` with the generators set back to ``states`` (what ``run_recording_draws``
    returned, None or empty: nothing to replay), and left afterwards as they were before."""
    if not states:
        return run()
    now = {name: backend.rank_rng_snapshot(_generator(name)) for name in states}
    for name, state in states.items():
        backend.restore_rank_rng(state, _generator(name))
    try:
        return run()
    finally:
        for name, state in now.items():
            backend.restore_rank_rng(state, _generator(name))


def run_keeping_buffers(buffers, run):
    """``run()`` with the arrays ``buffers`` restored afterwards, so a recomputation does not
    update batch-norm running statistics a second time."""
    saved = [b.copy() for b in buffers]
    try:
        return run()
    finally:
        for buffer, value in zip(buffers, saved):
            buffer[...] = value


# -- the layers and parameters a function computes with ---------------------------------------

def _is_layer(value):
    return not isinstance(value, type) and all(
        callable(getattr(value, name, None))
        for name in ("named_sublayers", "own_parameters", "buffers"))


def layers_of(function):
    """``(layers, tensors)``: the layers ``function`` computes with and the Tensors needing a
    gradient its closure holds, found as the module docstring says."""
    layers, tensors = [], []

    def add(value):
        if isinstance(value, Tensor):
            if not value.stop_gradient and all(value is not t for t in tensors):
                tensors.append(value)
            return
        owner = getattr(value, "__self__", None)
        for candidate in (value, owner):
            if _is_layer(candidate) and all(candidate is not layer for layer in layers):
                layers.append(candidate)

    if isinstance(function, functools.partial):
        for value in (function.func, *function.args, *function.keywords.values()):
            add(value)
        return layers, tensors
    add(function)
    target = getattr(function, "__func__", function)
    for cell in getattr(target, "__closure__", None) or ():
        try:
            add(cell.cell_contents)
        except ValueError:
            continue
    return layers, tensors


def layer_parameters(layers):
    """The parameters of ``layers`` and their sublayers that need a gradient, each once; the
    model's flat buffers are left as they are (``Layer.parameters()`` of a sublayer would pack
    its parameters into buffers of their own)."""
    found, seen = [], set()
    for layer in layers:
        for _, member in layer.named_sublayers(include_self=True):
            for p in member.own_parameters():
                if not p.stop_gradient and id(p) not in seen:
                    seen.add(id(p))
                    found.append(p)
    return found


def layer_buffers(layers):
    found, seen = [], set()
    for layer in layers:
        for b in layer.buffers():
            if id(b) not in seen:
                seen.add(id(b))
                found.append(b)
    return found


# -- the recorded node ------------------------------------------------------------------------

class _Call:
    """Everything a recomputation needs besides the node's inputs: the function and the
    arguments that are not recorded inputs, the buffers to keep, the rank generator's state,
    the autocast policy, where kept inputs went (``offload``) and ``observe``."""

    def __init__(self, function, args, kwargs, buffers, offload, observe, preserve_rng_state):
        self.function = function
        self.args = list(args)
        self.kwargs = kwargs
        self.buffers = buffers
        self.offload = offload
        self.observe = observe
        self.preserve_rng_state = preserve_rng_state
        self.draws = None
        self.policy = None
        self.listed = False
        self.offloaded = {}

    def run(self, args):
        return self.function(*args, **self.kwargs)


def _output_arrays(outputs, call):
    """The arrays of ``outputs`` (a Tensor, or a tuple or list of Tensors); remembers whether
    they came as a list."""
    call.listed = isinstance(outputs, list)
    if isinstance(outputs, Tensor):
        return outputs.data
    if isinstance(outputs, (tuple, list)) and outputs \
            and all(isinstance(o, Tensor) for o in outputs):
        return tuple(o.data for o in outputs)
    kinds = [type(o).__name__ for o in outputs] if isinstance(outputs, (tuple, list)) \
        else type(outputs).__name__
    raise TypeError(f"recompute: the function must return a Tensor or a non-empty tuple or list "
                    f"of Tensors, got {kinds}")


def _check_recorded_inside(roots, first):
    """Refuse a recomputation whose recorded graph reaches a node recorded before it began
    (sequence number below ``first``): its backward would run into the graph outside."""
    stack = [root._node for root in roots if root._node is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node._seq < first:
            raise RuntimeError(
                f"recompute: the function used a tensor computed outside it that needs a "
                f"gradient (from a {type(node).__name__}) without getting it as a positional "
                "argument; pass every such tensor as a positional argument of recompute")
        stack.extend(t._node for _, t in node._inputs if t._node is not None)


class Recomputation(Function):
    """The node ``recompute`` records in place of the function's operations (module
    docstring). Positional arguments: the function's, then the parameters it computes with;
    ``call`` holds the rest."""

    def forward(self, *arrays, call):
        self.call = call
        self.n_args = len(call.args)
        # The function's arguments: what backward runs it on again (a call keeps no values of
        # its inputs otherwise).
        self.kept = list(arrays[:self.n_args])
        call.policy = current_policy()
        with grad_mode.no_grad():
            if call.preserve_rng_state:
                outputs, call.draws = run_recording_draws(lambda: call.run(call.args))
            else:
                outputs = call.run(call.args)
        return _output_arrays(outputs, call)

    def kept_arrays(self):
        """The device arrays this node keeps: its inputs, but parameters and inputs offloaded
        to the host (what ``ActivationMeter`` counts)."""
        call = self.call
        if call is None:
            return []
        return [value for position, value in enumerate(self.kept)
                if position not in call.offloaded]

    def backward(self, *grads):
        call, self.call = self.call, None
        kept, self.kept = self.kept, []
        if all(grad is None for grad in grads):
            self._report_in_order([])
            return (None,) * self.n_args
        args = list(call.args)
        inputs = {}
        for position, tensor in self._inputs:
            if position < self.n_args:
                data = kept[position]
                if position in call.offloaded:
                    data = call.offload.load(call.offloaded.pop(position))
                inputs[position] = args[position] = Tensor(data, stop_gradient=False)
        first = next(_function._sequence)
        with grad_mode.enable_grad(), autocast(call.policy):
            outputs = run_keeping_buffers(call.buffers, lambda: run_replaying_draws(
                lambda: call.run(args), call.draws))
        if isinstance(outputs, Tensor):
            outputs = (outputs,)
        roots, root_grads = [], []
        for output, grad in zip(outputs, grads):
            if grad is not None and isinstance(output, Tensor) and not output.stop_gradient:
                roots.append(output)
                root_grads.append(grad)
        _check_recorded_inside(roots, first)
        if call.observe is not None:
            call.observe([self, *roots, *inputs.values()])
        finished = []
        if roots:
            run_backward(roots, root_grads, finished.append)
        self._report_in_order(finished)
        return tuple(inputs[p]._grad if p in inputs else None for p in range(self.n_args))

    def _report_in_order(self, finished):
        """Reorder this node's parameter inputs as the recomputation finished their gradients,
        dropping those it did not reach. The engine goes through a node's inputs after its
        backward, so it reports the parameters in the order of the run without recompute, and
        a parameter this call did not use is left to be reported as one no operation used."""
        parameters = {id(t): (position, t) for position, t in self._inputs
                      if position >= self.n_args}
        ordered = [parameters[id(leaf)] for leaf in finished if id(leaf) in parameters]
        self._inputs = [entry for entry in self._inputs if entry[0] < self.n_args] + ordered


def run_recomputed(function, args, kwargs=None, layers=None, offload=None, observe=None,
                   preserve_rng_state=True):
    """``function(*args, **kwargs)``, recomputed in backward (module docstring).

    ``layers``: the layers whose parameters and buffers it computes with (found from
    ``function`` when None). ``offload``: an object whose ``store(position, array)`` returns a
    host copy of a kept input (the input is then held there, not in device memory) and whose
    ``load(host)`` returns it in device memory again. ``observe(roots)``: called after the
    forward with the outputs, and after each recomputation with the node, the recomputed
    outputs and inputs, for measuring what is held (``ActivationMeter.held(*roots)``).
    ``preserve_rng_state=False`` draws new random numbers in the recomputation."""
    kwargs = {} if kwargs is None else kwargs
    if layers is None:
        layers, tensors = layers_of(function)
    else:
        tensors = []
    extra = [t for t in layer_parameters(layers) + tensors
             if all(t is not a for a in args)]
    record = grad_mode.is_grad_enabled() and (
        bool(extra) or any(isinstance(a, Tensor) and not a.stop_gradient for a in args))
    if not record:
        return function(*args, **kwargs)
    call = _Call(function, args, kwargs, layer_buffers(layers), offload, observe,
                 preserve_rng_state)
    result = Recomputation.apply(*args, *extra, call=call)
    outputs = result if isinstance(result, tuple) else (result,)
    node = outputs[0]._node
    for position, tensor in node._inputs:
        if position < node.n_args:
            call.args[position] = None
            if offload is not None and tensor._node is not None:
                call.offloaded[position] = offload.store(position, node.kept[position])
                node.kept[position] = None
    if observe is not None:
        observe(list(outputs))
    return list(result) if call.listed else result


def recompute(function, *args, preserve_rng_state=True, **kwargs):
    """``function(*args, **kwargs)`` (a layer or any callable) without keeping what it
    computes inside, which is computed again in backward (Paddle's
    ``fleet.utils.recompute``): the activations of a block traded for a second forward of it.
    Gradients are those of the plain call (module docstring). ``preserve_rng_state=False``
    draws new random numbers (dropout masks) in the recomputation."""
    return run_recomputed(function, args, kwargs, preserve_rng_state=preserve_rng_state)


# -- what a recorded graph holds --------------------------------------------------------------

def _owner(array):
    """The array that owns ``array``'s memory (itself unless it is a view)."""
    kind = type(array)
    while isinstance(array.base, kind):
        array = array.base
    return array


def _node_arrays(node):
    """What ``node`` keeps for backward: the arrays among its attributes (also inside tuples
    and lists), or what it says it keeps (``kept_arrays``)."""
    kept = getattr(node, "kept_arrays", None)
    if kept is not None:
        return kept()
    found = []
    for name, value in vars(node).items():
        if name == "_inputs":
            continue
        if isinstance(value, (tuple, list)):
            found.extend(value)
        else:
            found.append(value)
    return [v.data if isinstance(v, Tensor) else v for v in found]


class ActivationMeter:
    """Counts the bytes of device memory that recorded graphs hold for backward: the arrays
    saved on the live nodes below some tensors (their attributes; for a recompute node its
    kept inputs), each memory block once (a view counts as its
    owner), never ``model``'s parameters or buffers."""

    def __init__(self, model):
        members = [layer for _, layer in model.named_sublayers(include_self=True)]
        state = [p.data for layer in members for p in layer.own_parameters()]
        state += list(model.buffers())
        self._state = {id(_owner(a)) for a in state}

    def held(self, *roots):
        """The bytes held by ``roots`` (Tensors, or recorded nodes) and the graph below them."""
        array = backend.array_module().ndarray
        owners = {}

        def count(value):
            if isinstance(value, array):
                owner = _owner(value)
                if id(owner) not in self._state:
                    owners[id(owner)] = owner.nbytes

        stack, seen = [], set()
        for root in roots:
            if isinstance(root, Tensor):
                count(root.data)
                root = root._node
            if root is not None:
                stack.append(root)
        while stack:
            node = stack.pop()
            if id(node) in seen or node._inputs is None:
                continue
            seen.add(id(node))
            for value in _node_arrays(node):
                count(value)
            stack.extend(t._node for _, t in node._inputs if t._node is not None)
        return sum(owners.values())


def held_activation_bytes(model, *outputs):
    """``ActivationMeter(model).held(*outputs)``: after a forward, what the recorded graph of
    ``model``'s ``outputs`` holds for backward."""
    return ActivationMeter(model).held(*outputs)

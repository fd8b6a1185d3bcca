"""``Optimizer``: updates parameters from their gradients, over the flat buffers they live in.

The parameters handed in are grouped into runs, contiguous ranges of one flat buffer (normally a
single run covering a whole buffer). Optimizer state (velocity, moments) is flat per run too.
With ``fuse_all_optimizer_ops`` one multi-tensor kernel updates every run at once (one launch
per dtype and step on a GPU, however many runs and parameters there are); without, each
parameter is updated on its own, with the same math from ``fleetmpi.kernels.reference``. A
``grad_clip`` (``fleetmpi.optimizer.clip``) clips the gradients before either update.

The runs laid back to back form the optimizer's parameter space. ``shard(start, stop)`` narrows
the update, and the state, to one contiguous range of that space (the sharding strategy gives
each rank of a group its own range); the runs of the update are then the pieces of the range,
which may cut a parameter, and the update math, being elementwise, is the same on a piece.

The interface strategies use (besides the public methods of any optimizer: ``parameters``,
``owns``, ``get_lr``, ``step``, ``clear_grad``, ``settle_grads``, ``clipped_grads``,
``flat_runs``, ``state_dict``):

* ``runs``: the ``BufferRun`` of every contiguous range of the parameters, in parameter-space
  order. A strategy reads them, plans gradient buckets over them and reads or writes the
  arrays their ``data`` and ``grad`` give in place; it does not replace the list.
* ``run_spans``: ``(start, stop)`` of each of ``runs`` in the parameter space.
* ``run_states``: the optimizer state of each run the update covers, ``{state name: flat
  array}`` (the same runs as ``runs`` while the optimizer is not sharded). A strategy that
  replaces the update (lars, lamb, dgc) reads and writes the arrays in place.
* ``reference_update(param, grad, state, lr)``: the update rule of one array and its state, in
  place; the parameter server applies it to rows of its sparse tables.
* ``narrow(parameters)``, ``copy_for(parameters)``: the optimizer over other parameters (a
  pipeline stage's; a parameter server's blocks).
* ``shard(...)``, ``space_size``, ``shard_range``, ``shard_gradient``, ``shard_parameters``:
  the sharded update (the sharding strategy).
* ``step_count``, ``grad_clip``, ``weight_decay``, ``fuse_all_optimizer_ops``: plain
  attributes; a strategy whose update replaces ``step`` counts the step in ``step_count``, and
  passes its learning rate to ``graph_guard.enter_update`` as ``step`` does.
"""
import copy
import numbers

import numpy as np

from ..core import backend
from .. import kernels
from ..autograd import as_array
from ..kernels import reference
from . import graph_guard
from .clip import check_grad_clip
from .lr import LRScheduler
from .step import StepContext, minimize_loss, run_step


class BufferRun:
    """A contiguous range ``[start, stop)`` of one flat buffer and the parameters in it (for a
    piece of a shard, the parameters it holds part of too). Its values and gradient are that
    range of the buffer's, or arrays of its own (``data``, ``grad``: a shard that holds its
    gradient or its parameters apart from the buffer)."""

    def __init__(self, buffer, start, stop, parameters, data=None, grad=None):
        self.buffer = buffer
        self.start = start
        self.stop = stop
        self.parameters = parameters
        self._data = data
        self._grad = grad
        self._layout = None

    @property
    def data(self):
        return self.buffer.data[self.start:self.stop] if self._data is None else self._data

    @property
    def grad(self):
        return self.buffer.grad[self.start:self.stop] if self._grad is None else self._grad

    def _places(self):
        """``{id(parameter): (begin, end, shape or None)}``: where each parameter lies in an
        array of this run's length, and its shape when the run holds all of it. Worked out
        once: a parameter's offset, size and shape do not change while a run holds it."""
        if self._layout is None:
            self._layout = {}
            for p in self.parameters:
                begin = max(p.offset, self.start)
                end = min(p.offset + p.size, self.stop)
                whole = end - begin == p.size
                self._layout[id(p)] = (begin - self.start, end - self.start,
                                       p.shape if whole else None)
        return self._layout

    def view(self, flat, parameter):
        """The part of ``flat`` (an array of this run's length) that belongs to ``parameter``:
        shaped like the parameter when the run holds all of it, else the 1-d piece it holds."""
        begin, end, shape = self._places()[id(parameter)]
        return flat[begin:end] if shape is None else flat[begin:end].reshape(shape)

    def views(self, flat):
        """``view(flat, p)`` of every parameter of the run, in order."""
        return [flat[begin:end] if shape is None else flat[begin:end].reshape(shape)
                for begin, end, shape in self._places().values()]


# The key of a shard's own gradient in a sharded state_dict ("gradient.shard").
_GRADIENT = "gradient"


def _group_into_runs(parameters):
    by_buffer = {}
    for p in parameters:
        if p.buffer is None:
            raise ValueError(f"parameter {p.name!r} is not in a flat buffer; pass "
                             "model.parameters() to the optimizer")
        by_buffer.setdefault(id(p.buffer), []).append(p)
    runs = []
    for group in by_buffer.values():
        group.sort(key=lambda p: p.offset)
        current = [group[0]]
        for p in group[1:]:
            if p.offset == current[-1].offset + current[-1].size:
                current.append(p)
            else:
                runs.append(current)
                current = [p]
        runs.append(current)
    return [BufferRun(r[0].buffer, r[0].offset, r[-1].offset + r[-1].size, r) for r in runs]


def _spans(runs):
    """``[start, stop)`` of each run in the parameter space: the runs back to back."""
    spans, offset = [], 0
    for run in runs:
        spans.append((offset, offset + run.stop - run.start))
        offset += run.stop - run.start
    return spans


def _stored(state, key, shape):
    """``state[key]`` as an array of ``shape``, or an error naming the key."""
    if key not in state:
        raise KeyError(f"optimizer state has no {key!r}; it was saved by a different optimizer "
                       "or model")
    value = _host(state[key])
    if tuple(value.shape) != shape:
        raise ValueError(f"optimizer state {key!r} has shape {tuple(value.shape)}, expected "
                         f"{shape}")
    return value


def _host(value):
    """A state value (a Tensor, a backend array, a list) as a host array."""
    value = as_array(value)
    return backend.to_numpy(value) if hasattr(value, "shape") else np.asarray(value)


def _check_rate(name, value, low, high, high_inclusive=True):
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, not {value!r}")
    if not (low <= value <= high if high_inclusive else low <= value < high):
        bracket = "]" if high_inclusive else ")"
        raise ValueError(f"{name} must lie in [{low}, {high}{bracket}, not {value!r}")
    return float(value)


def _check_multi_precision(multi_precision, parameters):
    """Paddle's ``multi_precision`` keeps float32 master copies of float16 parameters.
    fleetmpi's parameters are the float32 masters themselves (amp computes on cast copies,
    ``fleetmpi.amp``), so ``True`` asks for what is already so; it is refused only for
    parameters in another dtype, which would have no float32 master."""
    if not isinstance(multi_precision, bool):
        raise ValueError(f"multi_precision must be True or False, not {multi_precision!r}")
    other = sorted({p.dtype.name for p in parameters} - {"float32", "float64"})
    if multi_precision and other:
        raise ValueError(f"multi_precision=True keeps float32 master weights, but the "
                         f"parameters are {', '.join(other)}: build the model in float32 "
                         "(amp's auto_cast computes in low precision from float32 parameters)")


class Optimizer:
    """Base of the optimizers: learning rate (a number or an ``lr.LRScheduler``), weight decay
    (a number: L2 regularisation added to the gradient, or None), gradient clipping
    (``grad_clip``: None, ``ClipGradByNorm`` or ``ClipGradByGlobalNorm``), ``state_dict``.
    ``capture_refusal``: None, or why the update cannot be captured in a CUDA graph
    (``graph_guard``)."""

    state_names = ()
    capture_refusal = None

    def __init__(self, learning_rate, parameters, weight_decay, grad_clip=None,
                 multi_precision=False):
        self._hold(parameters)
        _check_multi_precision(multi_precision, self._parameters)
        if isinstance(learning_rate, LRScheduler):
            self._learning_rate = learning_rate
        else:
            self._learning_rate = _check_rate("learning_rate", learning_rate, 0, np.inf)
        self.weight_decay = 0.0 if weight_decay is None else _check_rate(
            "weight_decay", weight_decay, 0, np.inf)
        self.grad_clip = check_grad_clip(grad_clip)
        self.step_count = 0
        self.fuse_all_optimizer_ops = False

    def _hold(self, parameters):
        """Update the trainable ones of ``parameters`` over the whole space they make, from
        zero state."""
        if parameters is None:
            raise ValueError(f"{type(self).__name__} needs parameters=model.parameters()")
        given = list(parameters)
        if not given:
            raise ValueError(f"{type(self).__name__} got an empty parameter list: the model "
                             "has no parameters. A Layer registers the sublayers and "
                             "parameters assigned to its attributes after super().__init__(); "
                             "check that the model's __init__ assigns them there")
        # Paddle leaves a parameter that is not trainable (stop_gradient) out of the update.
        parameters = [p for p in given if not p.stop_gradient]
        if not parameters:
            raise ValueError(f"{type(self).__name__} got {len(given)} parameter(s), none "
                             "trainable (ParamAttr(trainable=False) or stop_gradient=True): "
                             "there is nothing to update")
        self._parameters = parameters
        self._parameter_ids = frozenset(map(id, parameters))
        self.runs = _group_into_runs(parameters)
        # What step() updates: the whole space, or the pieces of one shard of it, each with
        # its [start, stop) in the space.
        self._update_runs = self.runs
        self.run_spans = _spans(self.runs)
        self._spans = self.run_spans
        self._shard = None
        self._sum_over_shards = None
        self.shard_gradient = None
        self.shard_parameters = None
        self._run_states = None

    @property
    def run_states(self):
        """The state of each run the update covers (module docstring). Allocated when first
        used, so that an optimizer sharded before then never holds the whole space's."""
        if self._run_states is None:
            xp = backend.array_module()
            self._run_states = [{name: xp.full(run.stop - run.start, self.initial_state(name),
                                               dtype=run.buffer.dtype)
                                 for name in self.state_names} for run in self.runs]
        return self._run_states

    def initial_state(self, name):
        """The value state ``name`` (one of ``state_names``) starts at."""
        return 0

    def narrow(self, parameters):
        """Update only ``parameters``, some of this optimizer's, from now on: runs and state
        built anew for them; hyperparameters, learning rate, clipping and step count kept.
        Before any step and before ``shard`` (pipeline keeps its stage's parameters)."""
        if self._shard is not None:
            raise RuntimeError(f"this {type(self).__name__} is sharded to {self._shard}; "
                               "narrow it before sharding")
        parameters = list(parameters)
        foreign = [p.name for p in parameters if not self.owns(p)]
        if foreign:
            raise ValueError(f"narrow: parameters {foreign} are not ones this "
                             f"{type(self).__name__} updates")
        self._hold(parameters)

    def copy_for(self, parameters):
        """A new optimizer of this one's class and hyperparameters over ``parameters``: zero
        state, step count 0, the current learning rate as a fixed number (``set_lr`` changes
        it) and no ``grad_clip``, since ``parameters`` need not be whole tensors (the parameter
        server updates its blocks of the model with a copy of the script's optimizer)."""
        clone = copy.copy(self)
        clone._learning_rate = float(self.get_lr())
        clone.grad_clip = None
        clone._hold(parameters)
        clone.step_count = 0
        return clone

    # -- learning rate ----------------------------------------------------------------------
    def get_lr(self):
        lr = self._learning_rate
        return lr() if isinstance(lr, LRScheduler) else lr

    def set_lr(self, value):
        if isinstance(self._learning_rate, LRScheduler):
            raise RuntimeError("this optimizer's learning rate is an LRScheduler; step the "
                               "scheduler instead of calling set_lr")
        graph_guard.check_new_lr(self, value)
        self._learning_rate = _check_rate("learning_rate", value, 0, np.inf)

    # -- steps ------------------------------------------------------------------------------
    def parameters(self):
        return list(self._parameters)

    def flat_runs(self):
        """``(flat data, flat grad)`` of every contiguous run of the parameters, or of the
        shard's pieces when the shard holds its own gradient (the gradient the update uses)."""
        runs = self.runs if self.shard_gradient is None else self._update_runs
        return [(run.data, run.grad) for run in runs]

    def owns(self, parameter):
        """Whether ``parameter`` is one this optimizer updates."""
        return id(parameter) in self._parameter_ids

    def clear_grad(self):
        """Zero the gradients (Paddle's ``clear_grad``; ``clear_gradients`` is the same),
        lazily: see ``Parameter.clear_gradient``."""
        for p in self._parameters:
            p.clear_gradient()

    def settle_grads(self):
        """Make the flat gradient buffers hold every parameter's gradient (zeros promised by
        ``clear_grad`` that no backward replaced are written now); anything that reads the
        buffers directly calls this first."""
        for p in self._parameters:
            p.settle_gradient()

    clear_gradients = clear_grad

    def clipped_grads(self):
        """The flat gradient of every run the update covers, as the update uses it: the
        gradient buffer itself, or a clipped copy when there is a ``grad_clip``. On a shard the
        clip's norms are of whole tensors: each rank's partial sums of squares over its pieces,
        added up by ``sum_over_shards``."""
        runs = self._update_runs
        if self.grad_clip is None:
            return [run.grad for run in runs]
        if self._shard is None:
            parameters = [p for run in runs for p in run.parameters]
            factors = dict(zip(map(id, parameters),
                               self.grad_clip.scales([p.grad.data for p in parameters])))
        else:
            factors = self._shard_clip_factors()
        flats = []
        for run in runs:
            flat = run.grad.copy()
            for p in run.parameters:
                run.view(flat, p)[...] *= factors[id(p)]
            flats.append(flat)
        return flats

    def _shard_clip_factors(self):
        """``{id(parameter): clip factor}`` from the squared norms of whole gradient tensors,
        summed over the shards."""
        xp = backend.array_module()
        parameters = [p for run in self.runs for p in run.parameters]
        index = {id(p): i for i, p in enumerate(parameters)}
        partial = xp.zeros(len(parameters), dtype=np.float64)
        for run in self._update_runs:
            for p in run.parameters:
                piece = run.view(run.grad, p).reshape(-1)
                partial[index[id(p)]] += (piece * piece).sum()
        squared = self._sum_over_shards(partial) if self._sum_over_shards else partial
        factors = self.grad_clip.scales_from_squared_norms(list(squared))
        return {id(p): factors[index[id(p)]] for p in parameters}

    def step(self, found_inf=None):
        """Update every parameter (on a shard: the part of it in the shard) from its gradient,
        clipped first by ``grad_clip``. ``found_inf``: amp's overflow flag (a one-element
        int32 backend array) for an update launched whether or not the step overflowed, so
        that nothing waits on the host for the verdict: where it is set, parameters and state
        stay as they were."""
        self.settle_grads()
        self.step_count += 1
        lr = self.get_lr()
        graph_guard.enter_update(self, lr)
        grads = self.clipped_grads()
        params = [run.data for run in self._update_runs]
        if self.fuse_all_optimizer_ops:
            self._fused_update(params, grads, self.run_states, lr, found_inf)
            return

        def update():
            for run, grad, state in zip(self._update_runs, grads, self.run_states):
                names = list(state)
                for data, grad_view, *state_views in zip(
                        run.views(run.data), run.views(grad),
                        *(run.views(flat) for flat in state.values())):
                    self.reference_update(data, grad_view, dict(zip(names, state_views)), lr)
        kernels.unless_found(found_inf, params + [flat for state in self.run_states
                                                  for flat in state.values()], update)

    def minimize(self, *args):
        """``minimize(loss)``: ``loss.backward()`` then ``step()`` (Paddle dygraph); or
        ``minimize(model, loss_fn, x, y)``: one whole training step on this process alone
        (gradients zeroed, forward, backward, update), returning the mean loss as a 0-d
        backend array."""
        loss = minimize_loss(args)
        if loss is not None:
            loss.backward()
            self.step()
            return None
        return run_step([], StepContext(*args, self))

    def _fused_update(self, params, grads, states, lr, found_inf):
        """The update of every run at once (``params``, ``grads``: a flat array per run;
        ``states``: the run's ``{state name: flat array}``), one multi-tensor kernel launch
        per dtype on a GPU; none of it where the overflow flag ``found_inf`` is set."""
        raise NotImplementedError(f"{type(self).__name__} does not define its update")

    def reference_update(self, param, grad, state, lr):
        """Update ``param`` and ``state`` (``{state name: array shaped like param}``) in place
        from ``grad`` with learning rate ``lr``: the update rule of one array, the math of
        ``fleetmpi.kernels.reference``."""
        raise NotImplementedError(f"{type(self).__name__} does not define its update")

    # -- sharding ---------------------------------------------------------------------------
    @property
    def space_size(self):
        """The number of elements of the parameter space (every run, back to back)."""
        return self.run_spans[-1][1]

    @property
    def shard_range(self):
        """``(start, stop)``: the range of the parameter space this optimizer updates."""
        return self._shard or (0, self.space_size)

    def parameter_state(self, parameter):
        """``{state name: the state of parameter}``, writable views shaped like it, for an
        optimizer that holds the state of whole parameters (not a shard); what a checkpoint
        that re-splits parameters moves state by."""
        if self._shard is not None:
            raise ValueError("parameter_state: this optimizer holds one shard of the parameter "
                             "space, not whole parameters' state")
        for run, run_state in zip(self.runs, self.run_states):
            if any(p is parameter for p in run.parameters):
                return {name: run.view(flat, parameter) for name, flat in run_state.items()}
        raise KeyError(f"parameter {parameter.name!r} is not one this optimizer updates")

    def state_nbytes(self):
        """Bytes of optimizer state this process holds (velocity, moments)."""
        return sum(int(flat.nbytes) for run_state in self.run_states
                   for flat in run_state.values())

    def shard(self, start, stop, sum_over_shards=None, own_gradient=False,
              own_parameters=False):
        """From now on update only elements ``[start, stop)`` of the parameter space and hold
        optimizer state for them alone; the state held so far for them is kept.

        ``sum_over_shards(array)``: ``array`` summed over the processes that hold the other
        shards of the space (an allreduce), for ``grad_clip``'s norms of whole tensors; None
        when nothing else is held elsewhere. ``own_gradient``: the update reads the gradient
        from ``shard_gradient``, a zeroed flat array of the shard's length, instead of the flat
        buffers (sharding stage 2). ``own_parameters``: it updates ``shard_parameters``, a
        copy of the shard's values taken now (of a model built under ``LazyGuard``, produced
        for the shard alone), instead of the flat buffers (stage 3). State not allocated yet
        is allocated for the shard alone. An optimizer is sharded once."""
        if self._shard is not None:
            raise RuntimeError(f"this {type(self).__name__} is already sharded to "
                               f"{self._shard}; build a new optimizer to shard it otherwise")
        total = self.space_size
        if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool)
                   for v in (start, stop)) or not 0 <= start <= stop <= total:
            raise ValueError(f"shard ({start!r}, {stop!r}) must be integers with 0 <= start <= "
                             f"stop <= {total}, the size of the parameter space")
        xp = backend.array_module()
        dtype = self.runs[0].buffer.dtype
        if own_gradient:
            self.shard_gradient = xp.zeros(stop - start, dtype=dtype)
        if own_parameters:
            self.shard_parameters = xp.empty(stop - start, dtype=dtype)
        held_so_far = self._run_states or [None] * len(self.runs)
        pieces, spans, state = [], [], []
        for run, (low, high), run_state in zip(self.runs, self.run_spans, held_so_far):
            lo, hi = max(start, low), min(stop, high)
            if lo >= hi:
                continue
            first, last = run.start + lo - low, run.start + hi - low
            held = [p for p in run.parameters if p.offset < last and p.offset + p.size > first]
            data = grad = None
            if own_parameters:
                data = self.shard_parameters[lo - start:hi - start]
                run.buffer.read(first, last, data)
            if own_gradient:
                grad = self.shard_gradient[lo - start:hi - start]
            pieces.append(BufferRun(run.buffer, first, last, held, data, grad))
            spans.append((lo, hi))
            state.append({name: xp.full(hi - lo, self.initial_state(name), dtype=dtype)
                          if run_state is None else run_state[name][lo - low:hi - low].copy()
                          for name in self.state_names})
        self._update_runs, self._spans, self._run_states = pieces, spans, state
        self._shard = (int(start), int(stop))
        self._sum_over_shards = sum_over_shards

    # -- state ------------------------------------------------------------------------------
    def state_dict(self):
        """``{"step_count": int, "lr_scheduler": dict or None, "<state>.<run>": host array}``;
        on a shard ``"<state>.shard"`` (the shard's state, in space order) and ``"shard"``:
        ``[start, stop, space size]``, in place of the per-run arrays."""
        state = {"step_count": self.step_count,
                 "lr_scheduler": (self._learning_rate.state_dict()
                                  if isinstance(self._learning_rate, LRScheduler) else None)}
        if self._shard is None:
            for index, run_state in enumerate(self.run_states):
                for name, flat in run_state.items():
                    state[f"{name}.{index}"] = backend.to_numpy(flat).copy()
            return state
        state["shard"] = [*self._shard, self.space_size]
        for name in self.state_names:
            pieces = [backend.to_numpy(run_state[name]) for run_state in self.run_states]
            dtype = self.runs[0].buffer.dtype
            state[f"{name}.shard"] = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
        if self.shard_gradient is not None:
            # What gradient_merge has gathered of its window so far lives here.
            state[f"{_GRADIENT}.shard"] = backend.to_numpy(self.shard_gradient).copy()
        return state

    def set_state_dict(self, state):
        """Load a ``state_dict``: per-run arrays, or a ``"shard"`` range with its arrays, which
        may come from another sharding of the same space as long as it covers the range this
        optimizer updates (a checkpoint's shards joined together cover all of it). Arrays or
        Tensors (what ``fleetmpi.load`` gives)."""
        self.step_count = int(state["step_count"])
        if isinstance(self._learning_rate, LRScheduler) and state.get("lr_scheduler"):
            self._learning_rate.set_state_dict(state["lr_scheduler"])
        if "shard" in state:
            start, stop, total = (int(v) for v in _host(state["shard"]))
            if total != self.space_size:
                raise ValueError(f"optimizer state was saved for a parameter space of {total} "
                                 f"elements; this optimizer's has {self.space_size}")
            sources = {name: _stored(state, f"{name}.shard", (stop - start,))
                       for name in self.state_names}
        else:
            start, stop = 0, self.space_size
            sources = {name: np.concatenate([
                _stored(state, f"{name}.{index}", (run.stop - run.start,))
                for index, run in enumerate(self.runs)]) for name in self.state_names}
        own = self.shard_range
        if not start <= own[0] <= own[1] <= stop:
            raise ValueError(f"optimizer state covers elements [{start}, {stop}) of the "
                             f"parameter space, but this optimizer updates [{own[0]}, {own[1]})")
        gradient = None
        if self.shard_gradient is not None and f"{_GRADIENT}.shard" in state:
            gradient = _stored(state, f"{_GRADIENT}.shard", (stop - start,))
        for (lo, hi), run_state in zip(self._spans, self.run_states):
            for name, flat in run_state.items():
                flat[...] = backend.asarray(sources[name][lo - start:hi - start])
        if gradient is not None:
            self.shard_gradient[...] = backend.asarray(gradient[own[0] - start:own[1] - start])


class SGD(Optimizer):
    """``p -= lr * (g + weight_decay * p)``."""

    def __init__(self, learning_rate=0.001, parameters=None, weight_decay=None, grad_clip=None,
                 *, multi_precision=False, name=None):
        super().__init__(learning_rate, parameters, weight_decay, grad_clip, multi_precision)

    def _fused_update(self, params, grads, states, lr, found_inf):
        kernels.multi_tensor_sgd_update(params, grads, lr, self.weight_decay, found_inf)

    def reference_update(self, param, grad, state, lr):
        reference.sgd_update(param, grad, lr, self.weight_decay)


class Momentum(Optimizer):
    """Heavy-ball momentum, Paddle's form: ``v = momentum * v + g``, ``p -= lr * v``; with
    ``use_nesterov``, ``p -= lr * (g + momentum * v)``."""

    state_names = ("velocity",)

    def __init__(self, learning_rate=0.001, momentum=0.9, parameters=None, use_nesterov=False,
                 weight_decay=None, grad_clip=None, multi_precision=False, *, name=None):
        super().__init__(learning_rate, parameters, weight_decay, grad_clip, multi_precision)
        self.momentum = _check_rate("momentum", momentum, 0, 1)
        self.use_nesterov = bool(use_nesterov)

    def _fused_update(self, params, grads, states, lr, found_inf):
        kernels.multi_tensor_momentum_update(params, grads, [s["velocity"] for s in states],
                                             lr, self.momentum, self.weight_decay,
                                             self.use_nesterov, found_inf)

    def reference_update(self, param, grad, state, lr):
        reference.momentum_update(param, grad, state["velocity"], lr, self.momentum,
                                  self.weight_decay, self.use_nesterov)


class Adam(Optimizer):
    """Adam with bias correction; ``weight_decay`` is L2 regularisation added to the
    gradient. The bias correction counts the updates on the device (``updates``, a one-element
    int64 backend array that follows ``step_count`` wherever that is set from outside), so
    that a step captured in a CUDA graph corrects each replay by its own count, and a step amp
    skips on the device (``found_inf``) counts nothing."""

    state_names = ("moment1", "moment2")
    decoupled = False

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8,
                 parameters=None, weight_decay=None, grad_clip=None, *, multi_precision=False,
                 name=None):
        super().__init__(learning_rate, parameters, weight_decay, grad_clip, multi_precision)
        self.beta1 = _check_rate("beta1", beta1, 0, 1, high_inclusive=False)
        self.beta2 = _check_rate("beta2", beta2, 0, 1, high_inclusive=False)
        if not isinstance(epsilon, (int, float)) or not epsilon > 0:
            raise ValueError(f"epsilon must be a positive number, not {epsilon!r}")
        self.epsilon = float(epsilon)

    def _hold(self, parameters):
        super()._hold(parameters)
        self.updates = backend.array_module().zeros(1, dtype=np.int64)
        self._counted = 0

    def _count(self):
        """``updates``, first set to ``step_count`` where that was set from outside (a
        checkpoint loaded, ``narrow``, the parameter server's rule) since the last step."""
        if self._counted != self.step_count:
            self.updates[...] = self.step_count
            self._counted = self.step_count
        return self.updates

    def step(self, found_inf=None):
        self._count()
        self.updates += 1 if found_inf is None else 1 - found_inf
        self._counted += 1
        super().step(found_inf)

    def _arguments(self, lr):
        return (lr, self.beta1, self.beta2, self.epsilon, self._count(), self.weight_decay,
                self.decoupled)

    def _fused_update(self, params, grads, states, lr, found_inf):
        kernels.multi_tensor_adam_update(params, grads, [s["moment1"] for s in states],
                                         [s["moment2"] for s in states], *self._arguments(lr),
                                         found_inf)

    def reference_update(self, param, grad, state, lr):
        reference.adam_update(param, grad, state["moment1"], state["moment2"],
                              *self._arguments(lr), backend.array_module())


class AdamW(Adam):
    """Adam with decoupled weight decay: ``p *= 1 - lr * weight_decay`` before the Adam
    step."""

    decoupled = True

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8,
                 parameters=None, weight_decay=0.01, grad_clip=None, *, multi_precision=False,
                 name=None):
        super().__init__(learning_rate, beta1, beta2, epsilon, parameters, weight_decay,
                         grad_clip, multi_precision=multi_precision)

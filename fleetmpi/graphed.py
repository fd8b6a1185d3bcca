"""``graphed_step``: a whole training step captured once as a CUDA graph, then replayed, as
PyTorch's ``torch.cuda.graph`` does for whole networks (and ``make_graphed_callables`` for
parts of them).

    def train_step(x, y):                 # the documented loop body
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        return loss

    step = fleet.graphed_step(train_step, (x0, y0))
    for x, y in loader:
        loss = step(x, y)                 # the static loss: read it before the next call

``example_inputs`` give the shapes and dtypes of the static inputs, tensors the step always
runs on (no step runs on the examples themselves). Each call copies its batch into them; a
batch of another shape or dtype is refused, since a graph replays fixed shapes. The first
``warmup_steps`` calls run the step eagerly, so that what the step creates lazily exists
before the capture (CuPy's compiled kernels, the dropout generator, the communicator's plans
and buffers, the lazily zeroed gradients' state); the next call captures the step and runs it
once (on a GPU the capture only records, so the graph is replayed right after it), and every
later call replays the graph and returns the same static output, overwritten in place. The
step's outputs may be tensors, arrays, tuples or lists of them, or None.

What cannot be captured raises ``CaptureError`` naming it (``fleetmpi.core.capture_checks``): a
read of a device value on the host inside the step (``.item()``, ``.numpy()``, ``float()``,
a Python branch on a tensor), a collective over the MPI transport, strategies and learning
rate schedules that decide on the host step by step. A replay runs the device work only: the
Python of the step, and so its host-side counters (the optimizers' ``step_count``), runs at
capture and not again; the strategies that read those are refused for that reason. What
changes from step to step on the device is captured: amp's overflow verdict, loss scale and
skipped steps, Adam's count of updates for its bias correction.

Where the arrays are NumPy's, the graph is the host stand-in ``HostGraph`` (the same static
inputs, calls and checks; the step's Python is what it replays). ``FLEETMPI_CUDA_GRAPH=0`` or
``enabled=False`` runs every call eagerly through the static inputs, to compare or debug.
"""
import numbers

from .core import backend
from .autograd import Tensor
from .device.cuda.graphs import CUDAGraph, is_cuda_graph_supported
from .device.cuda.host_graph import HostGraph
from .core.knobs import CUDA_GRAPH


def _array_of(value, what):
    array = value.data if isinstance(value, Tensor) else value
    if not (hasattr(array, "shape") and hasattr(array, "dtype")):
        raise TypeError(f"{what} must be a Tensor or an array, not {type(value).__name__}")
    return array


def _output_arrays(output):
    """The arrays of a step's output, in order: tensors give their data, a NumPy scalar (what a
    reduction gives on NumPy) made a 0-d array in its place, so that replays can write it."""
    if output is None:
        return []
    if isinstance(output, (tuple, list)):
        return [array for item in output for array in _output_arrays(item)]
    array = _array_of(output, "what the graphed step returns")
    if not isinstance(array, backend.array_module().ndarray):
        if not isinstance(output, Tensor):
            raise TypeError(f"the graphed step returns a {type(array).__name__}, which cannot "
                            "be overwritten in place by replays; return the tensor instead")
        output.data = array = backend.array_module().asarray(array)
    return [array]


def _describe(array):
    return f"shape {tuple(array.shape)} and dtype {array.dtype}"


class GraphedStep:
    """The graphed form of ``train_step`` (see the module docstring). ``static_inputs``: the
    tensors the step runs on; ``static_output``: what the capture returned (None before);
    ``graph``: the ``CUDAGraph`` or ``HostGraph`` (None before the capture, and after
    ``reset()``); ``calls``: how many calls so far."""

    def __init__(self, train_step, example_inputs, warmup_steps=3, pool_id=None, enabled=None):
        if not callable(train_step):
            raise TypeError(f"train_step must be callable, not {type(train_step).__name__}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, numbers.Integral) \
                or warmup_steps < 1:
            raise ValueError(f"warmup_steps={warmup_steps!r} must be an integer >= 1: what the "
                             "step creates lazily must exist before the capture")
        if not isinstance(example_inputs, (tuple, list)):
            raise TypeError(f"example_inputs must be a tuple or list of the step's inputs, not "
                            f"{type(example_inputs).__name__} (for one input: (x,))")
        examples = [_array_of(value, f"example input {index}")
                    for index, value in enumerate(example_inputs)]
        xp = backend.array_module()
        self.train_step = train_step
        self.static_inputs = tuple(Tensor(xp.array(backend.asarray(e))) for e in examples)
        self.static_output = None
        self.graph = None
        self.calls = 0
        self.warmup_steps = int(warmup_steps)
        self.pool_id = pool_id
        self.enabled = CUDA_GRAPH.value() if enabled is None else bool(enabled)

    def _load(self, inputs):
        if len(inputs) != len(self.static_inputs):
            raise TypeError(f"the graphed step takes {len(self.static_inputs)} inputs (as its "
                            f"example inputs), not {len(inputs)}")
        for index, (static, value) in enumerate(zip(self.static_inputs, inputs)):
            array = _array_of(value, f"graphed step input {index}")
            if tuple(array.shape) != static.data.shape or array.dtype != static.dtype:
                raise ValueError(f"graphed step input {index} has {_describe(array)}, but its "
                                 f"static input has {_describe(static.data)}: a CUDA graph "
                                 "replays fixed shapes and dtypes; pad the batch or drop it, "
                                 "or make another graphed step for this shape")
            if array is not static.data:
                backend.array_module().copyto(static.data, backend.asarray(array))

    def __call__(self, *inputs):
        self._load(inputs)
        self.calls += 1
        if not self.enabled or self.calls <= self.warmup_steps:
            return self.train_step(*self.static_inputs)
        if self.graph is None:
            return self._capture()
        self.graph.replay()
        return self.static_output

    def _capture(self):
        graph = CUDAGraph(pool_id=self.pool_id) if is_cuda_graph_supported() else HostGraph()
        first = []

        def run():
            output = self.train_step(*self.static_inputs)
            if not first:
                first.append(output)
            return _output_arrays(output)
        graph.capture(run)
        if not graph.capture_runs_the_work:
            graph.replay()
        self.graph, self.static_output = graph, first[0]
        return self.static_output

    def reset(self):
        """Drop the graph (and its memory, once the static output is gone too); the next call
        captures the step again."""
        if self.graph is not None:
            self.graph.reset()
        self.graph = self.static_output = None


def graphed_step(train_step, example_inputs, warmup_steps=3, pool_id=None, enabled=None):
    """``train_step`` as a ``GraphedStep``: captured as a CUDA graph after ``warmup_steps``
    eager calls, replayed after (module ``fleetmpi.graphed``). ``example_inputs``: a tuple of
    tensors or arrays shaped as every batch will be; ``pool_id``: ``CUDAGraph``'s;
    ``enabled``: False runs every call eagerly (None: ``FLEETMPI_CUDA_GRAPH``, default on)."""
    return GraphedStep(train_step, example_inputs, warmup_steps, pool_id, enabled)

"""A stand-in for NVIDIA's cuDNN frontend (module ``cudnn``) in NumPy, for the tests of
``fleetmpi/nn/functional/cudnn*.py`` on the host.

Its ``pygraph`` takes the calls of the frontend's Python graph API that fleetmpi makes
(``tensor``, ``conv_fprop``/``conv_dgrad``/``conv_wgrad``, ``batchnorm``/``batchnorm_backward``
/``batchnorm_inference``, ``sdpa``/``sdpa_backward``, the build steps and ``execute``), checks
what cuDNN requires of them (declared dims, strides and data types; outputs marked; every
non-virtual tensor bound at execution to an array of that shape, dtype and contiguity), and
computes each node from references independent of fleetmpi: the direct loops of
``test_conv_reference.py``, textbook batch norm and attention in float64. ``StandIn`` records
every graph built and every execution. ``declined`` names the operations whose graphs it
refuses, as cuDNN does where it has no engine.
"""
import types

import numpy as np

from test_conv_reference import direct_conv

DATA_TYPES = ("HALF", "BFLOAT16", "FLOAT", "DOUBLE")
NUMPY = {"HALF": np.float16, "FLOAT": np.float32, "DOUBLE": np.float64}
BN_AXES = (0, 2, 3)


class GraphNotSupported(RuntimeError):
    """The stand-in's ``cudnnGraphNotSupportedError``."""


def _row_major(dim):
    out, step = [], 1
    for extent in reversed(dim):
        out.append(step)
        step *= extent
    return out[::-1]


class Tensor:
    """A graph tensor: inputs are declared, outputs start virtual until ``set_output``."""

    def __init__(self, name, dim, stride=None, data_type=None, is_pass_by_value=False,
                 virtual=False):
        self.name, self.dim = name, None if dim is None else list(dim)
        self.stride = list(stride) if stride is not None else None
        self.data_type, self.is_pass_by_value, self.virtual = data_type, is_pass_by_value, virtual

    def set_output(self, flag):
        self.virtual = not flag
        return self

    def set_dim(self, dim):
        self.dim = list(dim)
        return self

    def set_stride(self, stride):
        self.stride = list(stride)
        return self

    def set_data_type(self, data_type):
        self.data_type = data_type
        return self

    def get_dim(self):
        return list(self.dim)


class Graph:
    """The stand-in ``pygraph`` (module docstring)."""

    def __init__(self, stand_in, io_data_type=None, intermediate_data_type=None,
                 compute_data_type=None, handle=None, **kwargs):
        assert not kwargs, kwargs
        assert handle is stand_in.handle
        self.stand_in = stand_in
        self.io_data_type, self.compute_data_type = io_data_type, compute_data_type
        self.intermediate_data_type = intermediate_data_type
        self.tensors, self.nodes = [], []
        self.steps, self.modes, self.policy, self.workspace_limit = [], None, None, None

    def tensor(self, name, dim, stride, data_type, is_pass_by_value=False):
        assert data_type in DATA_TYPES and list(stride) == _row_major(dim), (name, dim, stride)
        tensor = Tensor(name, dim, stride, data_type, is_pass_by_value)
        self.tensors.append(tensor)
        return tensor

    def _node(self, op, inputs, outputs, **params):
        assert params.pop("name")
        for tensor in inputs.values():
            assert tensor is None or tensor in self.tensors, (op, tensor.name)
        made = [Tensor(f"{op}::{name}", dims, virtual=True) for name, dims in outputs]
        self.tensors.extend(made)
        self.nodes.append((op, inputs, dict(zip((name for name, _ in outputs), made)), params))
        return made

    def _convolution(self, op, first, second, out_dim, padding, stride, dilation,
                     compute_data_type, name):
        assert dilation == [1, 1] and compute_data_type == "FLOAT"
        return self._node(op, {"a": first, "b": second}, [("out", out_dim)], padding=padding,
                          stride=stride, name=name)[0]

    def conv_fprop(self, image, weight, **geometry):
        return self._convolution("conv_fprop", image, weight, None, **geometry)

    def conv_dgrad(self, loss, filter, **geometry):
        return self._convolution("conv_dgrad", loss, filter, None, **geometry)

    def conv_wgrad(self, image, loss, **geometry):
        return self._convolution("conv_wgrad", image, loss, None, **geometry)

    def batchnorm(self, input, scale, bias, in_running_mean, in_running_var, epsilon, momentum,
                  name):
        assert in_running_mean is in_running_var is momentum is None
        assert epsilon.is_pass_by_value
        made = self._node("batchnorm", dict(x=input, scale=scale, bias=bias, epsilon=epsilon),
                          [("y", input.dim), ("mean", scale.dim), ("inv_var", scale.dim)],
                          name=name)
        return made + [None, None]

    def batchnorm_backward(self, grad, input, scale, mean, inv_variance, name):
        return self._node("batchnorm_backward", dict(dy=grad, x=input, scale=scale, mean=mean,
                                                     inv_var=inv_variance),
                          [("dx", input.dim), ("dscale", scale.dim), ("dbias", scale.dim)],
                          name=name)

    def batchnorm_inference(self, input, mean, inv_variance, scale, bias, name):
        return self._node("batchnorm_inference", dict(x=input, mean=mean, inv_var=inv_variance,
                                                      scale=scale, bias=bias),
                          [("y", input.dim)], name=name)[0]

    def sdpa(self, q, k, v, generate_stats, attn_scale, use_causal_mask, name):
        assert generate_stats is True
        return self._node("sdpa", dict(q=q, k=k, v=v), [("o", None), ("stats", None)],
                          scale=attn_scale, causal=use_causal_mask, name=name)

    def sdpa_backward(self, q, k, v, o, dO, stats, attn_scale, use_causal_mask, name):
        return self._node("sdpa_backward", dict(q=q, k=k, v=v, o=o, do=dO, stats=stats),
                          [("dq", q.dim), ("dk", k.dim), ("dv", v.dim)], scale=attn_scale,
                          causal=use_causal_mask, name=name)

    def validate(self):
        self.steps.append("validate")
        for tensor in self.tensors:
            assert tensor.virtual or (tensor.dim and tensor.data_type in DATA_TYPES), tensor.name

    def build_operation_graph(self):
        self.steps.append("build_operation_graph")

    def create_execution_plans(self, modes):
        self.steps.append("create_execution_plans")
        self.modes = list(modes)

    def deselect_workspace_greater_than(self, limit):
        self.steps.append("deselect_workspace_greater_than")
        self.workspace_limit = limit

    def deselect_numeric_notes(self, notes):
        self.steps.append("deselect_numeric_notes")
        self.deselected_notes = list(notes)

    def check_support(self):
        self.steps.append("check_support")
        if {op for op, *_ in self.nodes} & self.stand_in.declined:
            raise GraphNotSupported("No valid engine configs for " + self.nodes[0][0])

    def build_plans(self, policy):
        self.steps.append("build_plans")
        self.policy = policy
        self.stand_in.built.append(self)

    def get_execution_plan_count(self):
        return self.stand_in.plan_count

    def get_workspace_size(self):
        return self.stand_in.workspace_size

    def get_workspace_size_plan_at_index(self, index):
        return self.stand_in.workspace_size + index

    def execute(self, pack, workspace, handle):
        self._execute(pack, workspace, handle, None)

    def execute_plan_at_index(self, pack, workspace, index, handle):
        self._execute(pack, workspace, handle, index)

    def _execute(self, pack, workspace, handle, index):
        assert handle is self.stand_in.handle and self.policy is not None
        assert workspace.dtype == np.uint8
        assert workspace.size >= self.get_workspace_size_plan_at_index(index or 0)
        bound = [t for t in self.tensors if not t.virtual]
        assert set(pack) == set(bound), sorted(t.name for t in set(pack) ^ set(bound))
        for tensor, array in pack.items():
            _check_binding(tensor, array)
        for op, inputs, outputs, params in self.nodes:
            values = {name: pack[t].astype(np.float64) for name, t in inputs.items()}
            dims = {name: tuple(t.dim) for name, t in outputs.items()}
            for name, result in getattr(self.stand_in, op)(values, dims, **params).items():
                out = pack[outputs[name]]
                out[...] = result.reshape(out.shape)
        self.stand_in.executions.append((self.nodes[0][0], index))


def _check_binding(tensor, array):
    if tensor.is_pass_by_value:
        assert array.shape == (1, 1, 1, 1) and array.dtype == np.float32
        return
    assert list(array.shape) == tensor.dim, (tensor.name, array.shape, tensor.dim)
    assert array.dtype == NUMPY[tensor.data_type], (tensor.name, array.dtype, tensor.data_type)
    assert array.flags.c_contiguous, tensor.name


def _channel(vector):
    return vector.reshape(1, -1, 1, 1)


def _causal(scores):
    rows, columns = scores.shape[-2:]
    return np.where(np.triu(np.ones((rows, columns), bool), k=1), -np.inf, scores)


class StandIn:
    """The stand-in frontend's state: what it refuses and records (module docstring)."""

    def __init__(self):
        self.handle = object()
        self.declined = set()
        self.built, self.executions, self.streams = [], [], []
        self.plan_count, self.workspace_size = 3, 64

    def module(self):
        """The stand-in as the module ``cudnn``."""
        module = types.ModuleType("cudnn")
        module.__version__ = "stand-in"
        module.data_type = types.SimpleNamespace(**{name: name for name in DATA_TYPES})
        module.heur_mode = types.SimpleNamespace(A="A", B="B", FALLBACK="FALLBACK")
        module.build_plan_policy = types.SimpleNamespace(HEURISTICS_CHOICE="HEURISTICS_CHOICE",
                                                         ALL="ALL")
        module.numerical_note = types.SimpleNamespace(
            TENSOR_CORE="TENSOR_CORE", DOWN_CONVERT_INPUTS="DOWN_CONVERT_INPUTS",
            REDUCED_PRECISION_REDUCTION="REDUCED_PRECISION_REDUCTION")
        module.cudnnGraphNotSupportedError = GraphNotSupported
        module.backend_version = lambda: 92800
        module.create_handle = lambda: self.handle
        module.set_stream = lambda handle, stream: self.streams.append((handle, stream))
        module.pygraph = lambda **kwargs: Graph(self, **kwargs)
        return module

    def ops(self):
        return [graph.nodes[0][0] for graph in self.built]

    @staticmethod
    def conv_fprop(values, dims, padding, stride):
        x, w = values["a"], values["b"]
        return {"out": direct_conv(x, w, np.zeros(w.shape[0]), stride[0], padding[0])[0]}

    @staticmethod
    def conv_dgrad(values, dims, padding, stride):
        dy, w = values["a"], values["b"]
        backward = direct_conv(np.zeros(dims["out"]), w, np.zeros(w.shape[0]), stride[0],
                               padding[0])[1]
        return {"out": backward(dy)[0]}

    @staticmethod
    def conv_wgrad(values, dims, padding, stride):
        x, dy = values["a"], values["b"]
        backward = direct_conv(x, np.zeros(dims["out"]), np.zeros(dims["out"][0]), stride[0],
                               padding[0])[1]
        return {"out": backward(dy)[1]}

    @staticmethod
    def batchnorm(values, dims):
        x, epsilon = values["x"], float(values["epsilon"].reshape(()))
        mean, var = x.mean(axis=BN_AXES, keepdims=True), x.var(axis=BN_AXES, keepdims=True)
        inv_var = 1 / np.sqrt(var + epsilon)
        y = values["scale"] * (x - mean) * inv_var + values["bias"]
        return {"y": y, "mean": mean, "inv_var": inv_var}

    @staticmethod
    def batchnorm_backward(values, dims):
        x, dy, inv_var = values["x"], values["dy"], values["inv_var"]
        count = x.size // x.shape[1]
        xhat = (x - values["mean"]) * inv_var
        dbias, dscale = dy.sum(axis=BN_AXES), (dy * xhat).sum(axis=BN_AXES)
        dx = (values["scale"] * inv_var / count
              * (count * dy - _channel(dbias) - xhat * _channel(dscale)))
        return {"dx": dx, "dscale": dscale, "dbias": dbias}

    @staticmethod
    def batchnorm_inference(values, dims):
        y = (values["scale"] * (values["x"] - values["mean"]) * values["inv_var"]
             + values["bias"])
        return {"y": y}

    @staticmethod
    def _probabilities(values, scale, causal):
        scores = values["q"] @ values["k"].swapaxes(-1, -2) * scale
        if causal:
            scores = _causal(scores)
        top = scores.max(axis=-1, keepdims=True)
        stats = top + np.log(np.exp(scores - top).sum(axis=-1, keepdims=True))
        return np.exp(scores - stats), stats

    def sdpa(self, values, dims, scale, causal):
        probabilities, stats = self._probabilities(values, scale, causal)
        return {"o": probabilities @ values["v"], "stats": stats}

    def sdpa_backward(self, values, dims, scale, causal):
        probabilities, stats = self._probabilities(values, scale, causal)
        np.testing.assert_allclose(values["stats"], stats, rtol=1e-5, atol=1e-5)
        do = values["do"]
        dprobabilities = do @ values["v"].swapaxes(-1, -2)
        dscores = probabilities * (dprobabilities
                                   - (dprobabilities * probabilities).sum(-1, keepdims=True))
        dscores *= scale
        return {"dq": dscores @ values["k"], "dk": dscores.swapaxes(-1, -2) @ values["q"],
                "dv": probabilities.swapaxes(-1, -2) @ do}

"""The layers of ``docs/architecture.md``: every import, at module level or inside a function,
points down (or within its layer), and no module imports itself back through others.

Layers, bottom to top (a module belongs to the first group whose prefix it starts with):

1. backend: the array backend and the RNG state tracker, the knobs, logging, files, the
   timeline, failure handling,
   ``fleetmpi.job`` (this process's place, plain state), the CUDA graph capture checks and
   ``fleetmpi.device`` (``CUDAGraph``);
2. comm: ``fleetmpi.comm``;
3. trainer: autograd, ``nn``, ``optimizer``, kernels, data, checkpoints, progress;
4. strategies, with the strategy configuration they read (``DistributedStrategy``, the
   schema, prototxt, Paddle's fields and role makers);
5. the fleet API: ``fleetmpi`` itself and whatever else lives at its top;
6. launch.

``fleetmpi.plan`` (the scaling planner) and ``fleetmpi.docs`` (the generated files) stand on the
side: they may import any layer, and no layer imports them.
"""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The repository folders setup.cfg maps into the fleetmpi namespace.
PACKAGES = {"fleetmpi": "fleetmpi", "comm": "fleetmpi.comm", "strategies": "fleetmpi.strategies",
            "proto": "fleetmpi.proto", "launch": "fleetmpi.launch"}
LAYERS = (
    ("backend", ("fleetmpi.backend", "fleetmpi.knobs", "fleetmpi.log", "fleetmpi.files",
                 "fleetmpi.cuda_source", "fleetmpi.host_memory", "fleetmpi.timeline",
                 "fleetmpi.failure", "fleetmpi.job", "fleetmpi.paddle_flags",
                 "fleetmpi.launcher_env", "fleetmpi.capture_checks", "fleetmpi.device",
                 "fleetmpi.rng_tracker")),
    ("comm", ("fleetmpi.comm",)),
    ("trainer", ("fleetmpi.autograd", "fleetmpi.nn", "fleetmpi.optimizer", "fleetmpi.kernels",
                 "fleetmpi.data", "fleetmpi.checkpoint", "fleetmpi.checkpoint_agreement",
                 "fleetmpi.hybrid_checkpoint", "fleetmpi.progress", "fleetmpi.elastic",
                 "fleetmpi.io", "fleetmpi.serialization", "fleetmpi.log_writer")),
    ("strategies", ("fleetmpi.strategies", "fleetmpi.proto", "fleetmpi.distributed_strategy",
                    "fleetmpi.schema_view", "fleetmpi.prototxt", "fleetmpi.paddle_fields",
                    "fleetmpi.paddle_values", "fleetmpi.role_maker")),
    ("launch", ("fleetmpi.launch",)),
    ("fleet API", ("fleetmpi",)),
)
ORDER = ("backend", "comm", "trainer", "strategies", "fleet API", "launch")
SIDE = ("fleetmpi.plan", "fleetmpi.docs")


def modules():
    """{module name: file path} of every module of the package."""
    found = {}
    for folder, package in PACKAGES.items():
        top = os.path.join(ROOT, folder)
        for directory, subdirectories, files in os.walk(top):
            subdirectories[:] = [d for d in subdirectories if d != "__pycache__"]
            for name in files:
                if not name.endswith(".py"):
                    continue
                parts = os.path.relpath(os.path.join(directory, name), top)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join([package] + parts)] = os.path.join(directory, name)
    return found


def imported(module, path, known):
    """[(line, module)] of every fleetmpi module that ``module`` imports, anywhere in it."""
    is_package = path.endswith("__init__.py")
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[:None if is_package else -1]
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known
                       else source for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module:
                found.append((node.lineno, target))
    return found


def layer_of(module):
    if any(module == side or module.startswith(side + ".") for side in SIDE):
        return None
    for name, prefixes in LAYERS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return name
    raise AssertionError(f"{module} is in no layer")


def import_graph():
    known = modules()
    return known, {module: imported(module, path, known) for module, path in known.items()}


def upward_imports(graph):
    """'module:line imports target (layer -> higher layer)' for each import that points up."""
    wrong = []
    for module, targets in graph.items():
        mine = layer_of(module)
        for line, target in targets:
            theirs = layer_of(target)
            if theirs is None and mine is not None:
                wrong.append(f"{module}:{line} imports {target}, which stands on the side")
            elif mine is not None and ORDER.index(theirs) > ORDER.index(mine):
                wrong.append(f"{module}:{line} imports {target} ({mine} -> {theirs})")
    return sorted(wrong)


def cycles(graph):
    """The import cycles of ``graph`` (strongly connected components of two or more modules),
    each as its sorted module names (Tarjan's algorithm, written iteratively)."""
    edges = {module: sorted({target for _, target in targets})
             for module, targets in graph.items()}
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_import_points_down():
    known, graph = import_graph()
    assert len(known) > 100, f"only {len(known)} modules found under {ROOT}"
    wrong = upward_imports(graph)
    assert not wrong, "imports that point up a layer:\n" + "\n".join(wrong)


def test_no_import_cycle():
    _, graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_checks_see_an_upward_import_and_a_cycle():
    """The two checks on a small graph with one of each fault."""
    graph = {"fleetmpi.backend": [(3, "fleetmpi.comm")],
             "fleetmpi.comm": [(5, "fleetmpi.backend")],
             "fleetmpi.nn": [(7, "fleetmpi.plan")], "fleetmpi.plan": [(1, "fleetmpi.nn")]}
    assert upward_imports(graph) == [
        "fleetmpi.backend:3 imports fleetmpi.comm (backend -> comm)",
        "fleetmpi.nn:7 imports fleetmpi.plan, which stands on the side"]
    assert cycles(graph) == [["fleetmpi.backend", "fleetmpi.comm"],
                             ["fleetmpi.nn", "fleetmpi.plan"]]


@pytest.mark.parametrize("source, expected", [
    ("from . import job", ["fleetmpi.job"]),
    ("from ..comm.ring import RingAllreduce", ["fleetmpi.comm.ring"]),
    ("def f():\n    from .world import init", ["fleetmpi.world"]),
    ("import fleetmpi.nn.functional as F", ["fleetmpi.nn.functional"]),
])
def test_imports_are_resolved_inside_functions_and_relative(tmp_path, source, expected):
    path = tmp_path / "module.py"
    path.write_text(source + "\n")
    known = modules()
    module = "fleetmpi.strategies.example" if source.startswith("from ..") else "fleetmpi.example"
    assert [target for _, target in imported(module, str(path), known)] == expected

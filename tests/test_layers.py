"""The layers of ``docs/architecture.md``: every import, at module level or inside a function,
points down (or within its layer), and no module imports itself back through others.

A module's layer is its folder's (``FOLDERS``): the sub-packages of ``fleetmpi/`` are named for
their layer, and the root folders setup.cfg maps in are layers of their own. Bottom to top:

1. backend: ``fleetmpi/core/`` (array backend, knobs, logging, files, timeline, failure path,
   this process's place in the job) and ``fleetmpi/device/`` (``CUDAGraph``, Paddle's path);
2. comm: ``comm/``;
3. trainer: autograd, ``nn``, ``optimizer``, kernels, ``io``, and ``fleetmpi/training/`` (data,
   checkpoints, progress, logged scalars);
4. strategies: ``strategies/``, with ``fleetmpi/config/`` (``DistributedStrategy``, the schema,
   prototxt, Paddle's fields and role makers) and ``proto/``;
5. the fleet API: the modules directly in ``fleetmpi/``, the sub-packages of Paddle's
   public paths (``amp``, ``distributed``, ``metric``, ``hapi``) and ``testing`` (the pytest
   plugin);
6. launch: ``launch/``.

``fleetmpi/plan/`` (the scaling planner) and ``fleetmpi/docs/`` (the generated files) stand on
the side: they may import any layer, and no layer imports them.
"""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The repository folders setup.cfg maps into the fleetmpi namespace.
PACKAGES = {"fleetmpi": "fleetmpi", "comm": "fleetmpi.comm", "strategies": "fleetmpi.strategies",
            "proto": "fleetmpi.proto", "launch": "fleetmpi.launch"}
# Every sub-package of the fleetmpi namespace and its layer; None: on the side.
FOLDERS = {
    "fleetmpi.core": "backend", "fleetmpi.device": "backend",
    "fleetmpi.comm": "comm",
    "fleetmpi.autograd": "trainer", "fleetmpi.nn": "trainer", "fleetmpi.optimizer": "trainer",
    "fleetmpi.kernels": "trainer", "fleetmpi.io": "trainer", "fleetmpi.training": "trainer",
    "fleetmpi.strategies": "strategies", "fleetmpi.config": "strategies",
    "fleetmpi.proto": "strategies",
    "fleetmpi.amp": "fleet API", "fleetmpi.distributed": "fleet API",
    "fleetmpi.metric": "fleet API", "fleetmpi.testing": "fleet API", "fleetmpi.hapi": "fleet API",
    "fleetmpi.launch": "launch",
    "fleetmpi.plan": None, "fleetmpi.docs": None,
}
ORDER = ("backend", "comm", "trainer", "strategies", "fleet API", "launch")


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
    """The layer of ``module``: its sub-package's, or the fleet API's for ``fleetmpi`` itself and
    a module directly in ``fleetmpi/``; None for a module on the side."""
    folder = ".".join(module.split(".")[:2])
    if folder in FOLDERS:
        return FOLDERS[folder]
    if module == "fleetmpi" or os.path.isfile(os.path.join(ROOT, *folder.split(".")) + ".py"):
        return "fleet API"
    raise AssertionError(f"{folder} is a folder of no layer: add it to FOLDERS")


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
    graph = {"fleetmpi.core.backend": [(3, "fleetmpi.comm")],
             "fleetmpi.comm": [(5, "fleetmpi.core.backend")],
             "fleetmpi.nn": [(7, "fleetmpi.plan")], "fleetmpi.plan": [(1, "fleetmpi.nn")]}
    assert upward_imports(graph) == [
        "fleetmpi.core.backend:3 imports fleetmpi.comm (backend -> comm)",
        "fleetmpi.nn:7 imports fleetmpi.plan, which stands on the side"]
    assert cycles(graph) == [["fleetmpi.comm", "fleetmpi.core.backend"],
                             ["fleetmpi.nn", "fleetmpi.plan"]]


@pytest.mark.parametrize("source, expected", [
    ("from .core import job", ["fleetmpi.core.job"]),
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


def test_every_folder_has_its_layer_and_is_installed():
    """Each sub-package on disk is in FOLDERS (so a new folder states its layer) and in
    setup.cfg's packages (so a non-editable install has it); a module takes its folder's layer."""
    import configparser
    packages = {module for module, path in modules().items() if path.endswith("__init__.py")}
    folders = {".".join(p.split(".")[:2]) for p in packages if p != "fleetmpi"}
    assert folders == set(FOLDERS), f"folders without a layer: {sorted(folders - set(FOLDERS))}"
    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    listed = set(config["options"]["packages"].split())
    assert listed == packages, (f"not in setup.cfg: {sorted(packages - listed)}; "
                                f"listed but absent: {sorted(listed - packages)}")
    assert layer_of("fleetmpi.core.knobs") == "backend"
    assert layer_of("fleetmpi.training.checkpoint") == "trainer"
    assert layer_of("fleetmpi.world") == "fleet API"
    with pytest.raises(AssertionError, match="fleetmpi.newfolder is a folder of no layer"):
        layer_of("fleetmpi.newfolder.module")


def test_first_names_of_moved_modules_still_import():
    """``fleetmpi.knobs`` and the other modules that moved into core/, config/ and training/
    are the same module objects under their first names."""
    import importlib

    import fleetmpi
    for package, names in fleetmpi._FIRST_NAMES.items():
        for name in names:
            moved = importlib.import_module(f"fleetmpi.{package}.{name}")
            assert importlib.import_module(f"fleetmpi.{name}") is moved
            assert getattr(fleetmpi, name) is moved
            assert not os.path.exists(os.path.join(ROOT, "fleetmpi", name + ".py"))


def test_root_folders_import_the_rest_of_fleetmpi_absolutely():
    """In comm/, strategies/, proto/ and launch/, ``..`` reads as the repository root while it
    means fleetmpi/: a relative import may stay within its own root folder only."""
    wrong = []
    for module, path in modules().items():
        root = ".".join(module.split(".")[:2])
        if root == module.split(".")[0] or root not in (
                "fleetmpi.comm", "fleetmpi.strategies", "fleetmpi.proto", "fleetmpi.launch"):
            continue
        is_package = path.endswith("__init__.py")
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = module.split(".")[:None if is_package else -1]
                base = ".".join(base[:len(base) - node.level + 1])
                if base != root and not base.startswith(root + "."):
                    wrong.append(f"{path}:{node.lineno}: from {'.' * node.level}"
                                 f"{node.module or ''} leaves {root}")
    assert not wrong, "\n".join(wrong)

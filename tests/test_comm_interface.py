"""What the comm layer shows: the strategies import only ``fleetmpi.comm``'s own names, and
behind the ``Communicator`` facade no module reads a communicator's or an ``AlgorithmContext``'s
underscore attributes (they go through the context's documented interface)."""
import ast
import os

import fleetmpi.comm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_files(folder):
    for here, _, names in os.walk(os.path.join(ROOT, folder)):
        for name in sorted(names):
            if name.endswith(".py"):
                yield os.path.join(here, name)


def comm_imports(path):
    """``(line, module, names)`` of each import of the comm layer in the file at ``path``
    (a root folder's ``..comm`` and an absolute ``fleetmpi.comm`` alike)."""
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module == "comm" and node.level >= 2 or module.startswith("comm.") \
                    and node.level >= 2 or module.startswith("fleetmpi.comm"):
                yield node.lineno, ("fleetmpi." if node.level else "") + module, \
                    [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("fleetmpi.comm"):
                    yield node.lineno, alias.name, []


def test_strategies_import_only_what_fleetmpi_comm_exports():
    found = []
    for path in python_files("strategies"):
        for line, module, names in comm_imports(path):
            if module not in ("comm", "fleetmpi.comm") \
                    or not set(names) <= set(fleetmpi.comm.__all__):
                found.append(f"{os.path.relpath(path, ROOT)}:{line} {module} {names}")
    assert not found, "strategies import comm internals:\n" + "\n".join(found)


def test_nothing_behind_the_facade_reads_underscore_attributes_of_a_communicator():
    found = []
    for path in python_files("comm"):
        if os.path.basename(path) in ("communicator.py", "context.py"):
            continue
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and isinstance(node.value, ast.Name)
                    and node.value.id in ("comm", "communicator", "ctx")):
                found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} "
                             f"{node.value.id}.{node.attr}")
    assert not found, "\n".join(found)

"""The strategies use only the public interface of the layers below them (the trainer's is listed
in ``fleetmpi.optimizer.optimizer``'s docstring): no module under ``strategies/`` reads or sets
an underscore attribute of an object other than ``self`` or ``cls``, by ``obj._name`` or by
``getattr(obj, "_name")`` and its relatives."""
import ast
import pathlib

import pytest

STRATEGIES = pathlib.Path(__file__).resolve().parent.parent / "strategies"

# (module under strategies/, attribute): underscore attributes of objects of the strategies
# layer itself, each with why it is reached from outside its class.
ALLOWED = {
    # AppliedStrategy, a DistributedStrategy of the strategies layer, copies and compares the
    # schema message and the Paddle-only fields that make up a strategy's value.
    ("applied.py", "_message"),
    ("applied.py", "_paddle_only"),
}

ATTRIBUTE_FUNCTIONS = ("getattr", "setattr", "hasattr", "delattr")


def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_accesses(source, filename="<source>"):
    """``(line, attribute)`` of every underscore attribute ``source`` reaches on an object
    other than ``self`` or ``cls``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                found.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ATTRIBUTE_FUNCTIONS and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value)):
            found.append((node.lineno, node.args[1].value))
    return found


def test_strategies_reach_no_underscore_attribute_of_other_objects():
    modules = sorted(STRATEGIES.rglob("*.py"))
    assert modules, f"no modules found under {STRATEGIES}"
    offences = []
    for path in modules:
        relative = path.relative_to(STRATEGIES).as_posix()
        for line, attribute in private_accesses(path.read_text(), str(path)):
            if (relative, attribute) not in ALLOWED:
                offences.append(f"strategies/{relative}:{line}: {attribute}")
    assert not offences, ("strategies reach underscore attributes of objects of other layers; "
                          "use (or publish) the public interface instead:\n"
                          + "\n".join(offences))


@pytest.mark.parametrize("source, expected", [
    ("optimizer._runs", [(1, "_runs")]),
    ("self.optimizer._state", [(1, "_state")]),
    ("getattr(p, '_keeper')", [(1, "_keeper")]),
    ("setattr(node, '_packed', record)", [(1, "_packed")]),
    ("self._runs\ncls._table\nx.__class__\nx.runs\ngetattr(x, 'runs')", []),
])
def test_the_scan_finds_underscore_attributes(source, expected):
    assert private_accesses(source) == expected

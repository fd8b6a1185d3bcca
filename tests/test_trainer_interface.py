"""The strategies use only the public interface of the layers below them (the trainer's is listed
in ``fleetmpi.optimizer.optimizer``'s docstring): no module under ``strategies/`` reads or sets
an underscore attribute of an object other than ``self`` or ``cls``, by ``obj._name`` or by
``getattr(obj, "_name")`` and its relatives. And the parts of that interface published for
them (``Optimizer.narrow``, ``Optimizer.copy_for``, stages set from outside ``nn``) behave as
documented."""
import ast
import pathlib

import pytest

import fleetmpi as fleet
from fleetmpi import nn, optimizer
from fleetmpi.optimizer import lr

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


# -- the published trainer interface behaves as documented ------------------------------------

def _model():
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def test_narrow_keeps_hyperparameters_and_rebuilds_runs():
    model = _model()
    opt = optimizer.Momentum(learning_rate=0.05, momentum=0.8, parameters=model.parameters(),
                             weight_decay=0.001, grad_clip=optimizer.ClipGradByNorm(1.0))
    opt.step_count = 3
    kept = list(model[2].parameters())
    opt.narrow(kept)
    assert opt.parameters() == kept and [p for run in opt.runs for p in run.parameters] == \
        sorted(kept, key=lambda p: p.offset)
    assert opt.space_size == sum(p.size for p in kept)
    assert [sorted(state) for state in opt.run_states] == [["velocity"]] * len(opt.runs)
    assert (opt.get_lr(), opt.momentum, opt.weight_decay, opt.step_count) == (0.05, 0.8, 0.001, 3)
    assert isinstance(opt.grad_clip, optimizer.ClipGradByNorm)
    with pytest.raises(ValueError, match="not ones this Momentum updates"):
        opt.narrow(model[0].parameters())
    opt.shard(0, 1)
    with pytest.raises(RuntimeError, match="narrow it before sharding"):
        opt.narrow(kept)


def test_copy_for_is_the_same_rule_over_other_parameters():
    model, other = _model(), _model()
    schedule = lr.StepDecay(learning_rate=0.1, step_size=1, gamma=0.5)
    opt = optimizer.Adam(learning_rate=schedule, beta1=0.8, parameters=model.parameters(),
                         grad_clip=optimizer.ClipGradByGlobalNorm(1.0))
    opt.fuse_all_optimizer_ops = True
    opt.step_count = 5
    schedule.step()
    clone = opt.copy_for(other.parameters())
    assert type(clone) is optimizer.Adam and clone.parameters() == other.parameters()
    assert (clone.get_lr(), clone.beta1, clone.grad_clip, clone.step_count) == (0.05, 0.8, None, 0)
    assert clone.fuse_all_optimizer_ops
    clone.set_lr(0.01)
    assert (clone.get_lr(), opt.get_lr()) == (0.01, 0.05)
    assert opt.parameters() == model.parameters() and opt.step_count == 5


def test_device_guard_stages_layers_built_inside_only():
    with pytest.raises(RuntimeError):
        with fleet.device_guard("stage:3"):
            raise RuntimeError("fails inside the block")
    with fleet.device_guard("stage:1"):
        inside = nn.Linear(2, 2)
    outside = nn.Linear(2, 2)
    assert (inside.pipeline_stage, outside.pipeline_stage) == (1, None)
    assert {p.pipeline_stage for p in inside.parameters()} == {1}


def test_set_pipeline_stage_covers_sublayers_and_parameters():
    model = _model()
    model.set_pipeline_stage(2)
    assert {layer.pipeline_stage for _, layer in model.named_sublayers(include_self=True)} == {2}
    assert {p.pipeline_stage for p in model.parameters()} == {2}

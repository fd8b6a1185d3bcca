"""The typed views of the ``*_configs`` messages (``fleetmpi.strategies.configs``): one per
message, with exactly the message's keys, equal to the message for every key, frozen; the only
code that reads a ``*_configs`` attribute is the configuration's own; and ``compose`` places the
strategies by what their classes declare, never by their names."""
import ast
import dataclasses
import os

import pytest

import fleetmpi as fleet
from fleetmpi.config import schema_view
from fleetmpi.proto import distributed_strategy_pb2 as schema
from fleetmpi.strategies import compose, configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESSAGES = {field.name: field.message_type
            for field in schema.DistributedStrategy.DESCRIPTOR.fields
            if field.name.endswith("_configs")}
VIEWS = {cls.message: cls for cls in configs.StrategyConfig.__subclasses__()}


def test_every_configs_message_has_one_view_named_as_the_message():
    assert sorted(VIEWS) == sorted(MESSAGES)
    assert len(VIEWS) == len(configs.StrategyConfig.__subclasses__())
    for name, message in MESSAGES.items():
        assert VIEWS[name].__name__ == message.name, name


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_a_view_has_exactly_the_keys_of_its_message(name):
    keys = [field.name for field in dataclasses.fields(VIEWS[name])]
    assert keys == [field.name for field in MESSAGES[name].fields]


def _frozen(value):
    return tuple(value) if isinstance(value, list) else value


def _other_value(field):
    """A value of ``field`` other than its default that the schema allows."""
    default = schema_view.default_of(field)
    choices = schema_view.field_choices(field)
    if field.is_repeated:
        element = {field.TYPE_STRING: ["fc0", "fc1"], field.TYPE_DOUBLE: [0.5, 0.25]}
        return element.get(field.type, [2, 3])
    if field.type == field.TYPE_BOOL:
        return not default
    if field.type == field.TYPE_STRING:
        return next(c for c in choices if c != default) if choices else default + "_other"
    allowed = schema_view.field_range(field)
    numbers = [default + 1, default - 1, default / 2, default * 2 + 1]
    if field.type not in (field.TYPE_DOUBLE, field.TYPE_FLOAT):
        numbers = [n for n in numbers if n == int(n)]
        numbers = [int(n) for n in numbers]
    return next(n for n in numbers if n != default and (allowed is None or n in allowed))


def _assert_equal(view, message_view, name):
    for key in message_view:
        assert getattr(view, key) == _frozen(message_view[key]), f"{name}[{key!r}]"


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_a_view_equals_the_message_at_its_defaults_and_with_each_key_set(name):
    strategy = fleet.DistributedStrategy()
    view = VIEWS[name].of(strategy)
    _assert_equal(view, getattr(strategy, name), name)
    for field in MESSAGES[name].fields:
        assert getattr(view, field.name) == _frozen(schema_view.default_of(field))
        strategy = fleet.DistributedStrategy()
        setattr(strategy, name, {field.name: _other_value(field)})
        changed = VIEWS[name].of(strategy)
        _assert_equal(changed, getattr(strategy, name), name)
        assert getattr(changed, field.name) != getattr(view, field.name), field.name


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_a_view_is_frozen_and_hashable(name):
    strategy = fleet.DistributedStrategy()
    view = VIEWS[name].of(strategy)
    key = MESSAGES[name].fields[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(view, key, getattr(view, key))
    assert hash(view) == hash(VIEWS[name].of(strategy))
    for field in dataclasses.fields(view):
        assert not isinstance(getattr(view, field.name), list), field.name


def test_a_view_does_not_follow_later_changes_of_the_strategy():
    strategy = fleet.DistributedStrategy()
    strategy.recompute_configs = {"checkpoints": ["fc0"]}
    view = configs.RecomputeConfig.of(strategy)
    strategy.recompute_configs["checkpoints"].append("fc1")
    assert view.checkpoints == ("fc0",)
    assert configs.RecomputeConfig.of(strategy).checkpoints == ("fc0", "fc1")


@pytest.mark.parametrize("name, values, match", [
    ("sharding_configs", {"sharding_group_size": 2, "sharding_degree": 4},
     r"sharding_configs\['sharding_group_size'\]=2 and sharding_configs\['sharding_degree'\]=4 "
     r"name the same group size"),
    ("pipeline_configs", {"micro_batch": 2, "accumulate_steps": 4},
     r"pipeline_configs\['micro_batch'\]=2 and pipeline_configs\['accumulate_steps'\]=4 both "
     r"set the number of micro-batches"),
    ("amp_configs", {"use_pure_fp16": True, "use_pure_bf16": True},
     r"use_pure_fp16 and use_pure_bf16 are both set"),
    ("amp_configs", {"use_pure_bf16": True, "dtype": "float16", "level": "O1"}, None),
], ids=["sharding", "pipeline", "amp-both", "amp-fine"])
def test_keys_that_must_agree_are_checked_when_the_view_is_built(name, values, match):
    strategy = fleet.DistributedStrategy()
    setattr(strategy, name, values)
    if match is None:
        assert VIEWS[name].of(strategy).precision.level == "O2"
        return
    with pytest.raises(ValueError, match=match):
        VIEWS[name].of(strategy)


def test_derived_values():
    strategy = fleet.DistributedStrategy()
    strategy.sharding_configs = {"sharding_degree": 4, "stage": 2}
    sharding = configs.ShardingConfig.of(strategy)
    assert sharding.group_size == 4 and sharding.partitions_gradients
    strategy.sharding_configs = {"sharding_group_size": 2, "sharding_degree": 8, "stage": 1}
    sharding = configs.ShardingConfig.of(strategy)
    assert sharding.group_size == 2 and not sharding.partitions_gradients
    strategy.pipeline_configs = {"accumulate_steps": 3}
    assert configs.PipelineConfig.of(strategy).micro_batches == 3
    strategy.amp_configs = {"dtype": "bfloat16", "use_dynamic_loss_scaling": True}
    assert not configs.AMPConfig.of(strategy).scales_loss
    strategy.amp_configs = {"use_dynamic_loss_scaling": False, "init_loss_scaling": 8.0}
    assert configs.AMPConfig.of(strategy).scales_loss


# tensor_parallel's configs set the hybrid layout (fleetmpi.hybrid); the strategy reads none.
LAYOUT_ONLY = ("tensor_parallel",)


@pytest.mark.parametrize("name", compose.ORDER)
def test_a_strategy_reads_the_view_of_its_own_configs(name):
    cls = compose.strategy_class(name)
    if f"{name}_configs" in MESSAGES and name not in LAYOUT_ONLY:
        assert cls.config_class is VIEWS[f"{name}_configs"]
    else:
        assert cls.config_class is None


# The configuration's own code: the schema, DistributedStrategy, and the views.
CONFIGURATION = ("fleetmpi/config/", "strategies/configs.py")


def _sources():
    for top in ("strategies", "fleetmpi"):
        for directory, subdirectories, files in os.walk(os.path.join(ROOT, top)):
            subdirectories[:] = [d for d in subdirectories if d != "__pycache__"]
            for name in files:
                path = os.path.join(directory, name)
                relative = os.path.relpath(path, ROOT).replace(os.sep, "/")
                if name.endswith(".py") and not relative.startswith(CONFIGURATION):
                    yield relative, path


def _configs_reads(tree):
    """Lines reading a ``*_configs`` attribute: ``x.amp_configs`` (subscripted, ``.get()``,
    copied or aliased alike) or ``getattr(x, "amp_configs")``; assigning one is not a read."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.endswith("_configs") \
                and isinstance(node.ctx, ast.Load):
            yield node.lineno, node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "getattr" and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) \
                and str(node.args[1].value).endswith("_configs"):
            yield node.lineno, node.args[1].value


def test_the_reading_check_finds_each_form_of_read():
    source = ("a = s.amp_configs['k']\nb = s.amp_configs.get('k')\nc = dict(s.amp_configs)\n"
              "d = getattr(s, 'amp_configs')\ns.amp_configs = {'k': 1}\n")
    assert sorted(line for line, _ in _configs_reads(ast.parse(source))) == [1, 2, 3, 4]


def test_only_the_configuration_reads_configs_attributes():
    reads = [f"{relative}:{line} reads {attr}" for relative, path in _sources()
             for line, attr in _configs_reads(ast.parse(open(path).read(), path))]
    assert not reads, "read the typed view (fleetmpi.strategies.configs) instead:\n" + \
        "\n".join(reads)


def test_compose_names_no_strategy_outside_its_tables():
    """Placing a strategy is what its class declares: compose's functions hold no strategy
    name; the names live in its tables (ORDER, the classes, CONFLICTS, LIMITS)."""
    with open(os.path.join(ROOT, "strategies", "compose.py")) as f:
        tree = ast.parse(f.read())
    names = set(compose.ORDER)
    found = [f"{function.name}:{node.lineno} {node.value!r}"
             for function in tree.body if isinstance(function, ast.FunctionDef)
             for node in ast.walk(function)
             if isinstance(node, ast.Constant) and node.value in names]
    assert found == [], found

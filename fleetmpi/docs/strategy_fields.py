"""``docs/strategy_fields.md``: the table of every DistributedStrategy field, its type,
default and allowed values, rendered from the schema."""
from google.protobuf.descriptor import FieldDescriptor

from ..config import schema_view
from ..config.distributed_strategy import SHORTCUTS, DistributedStrategy

_TYPE_NAMES = {
    FieldDescriptor.TYPE_DOUBLE: "float", FieldDescriptor.TYPE_FLOAT: "float",
    FieldDescriptor.TYPE_INT32: "int",
    FieldDescriptor.TYPE_INT64: "int", FieldDescriptor.TYPE_BOOL: "bool",
    FieldDescriptor.TYPE_STRING: "str",
}


def _table(message_descriptor, heading):
    rows = [f"| {heading} | type | default | allowed |", "| --- | --- | --- | --- |"]
    for field in message_descriptor.fields:
        if field.message_type is not None:
            continue
        kind = _TYPE_NAMES[field.type]
        if field.is_repeated:
            kind = f"list[{kind}]"
        rows.append(f"| `{field.name}` | {kind} | `{schema_view.default_of(field)!r}` | "
                    f"{schema_view.describe_allowed(field)} |")
    return rows


def render():
    """The whole reference as Markdown."""
    top = DistributedStrategy._message_class.DESCRIPTOR
    lines = ["# DistributedStrategy fields", "",
             "Generated from `proto/distributed_strategy.proto` by "
             "`python -m fleetmpi.docs regenerate`; do not edit by hand.", "",
             "## DistributedStrategy", ""] + _table(top, "field")
    for field in top.fields:
        if field.message_type is None:
            continue
        sub_class = DistributedStrategy._sub_objects.get(field.name)
        if sub_class is not None:
            note = (f"Assign a `fleetmpi.{sub_class.__name__}` or a dict of its fields; "
                    f"`strategy.{field.name}` is a live `{sub_class.__name__}`.")
        else:
            note = (f"Assign a dict: only the keys given change. `strategy.{field.name}` is a "
                    "live dict-like view.")
        lines += ["", f"## `{field.name}`", "", note, ""] + _table(field.message_type, "key")
    lines += ["", "## Shortcuts", "",
              "Names the seeds' collective-training guide sets on the strategy itself:", "",
              "| name | is |", "| --- | --- |"]
    lines += [f"| `{name}` | `{owner}.{field}` |" for name, (owner, field) in SHORTCUTS.items()]
    return "\n".join(lines) + "\n"

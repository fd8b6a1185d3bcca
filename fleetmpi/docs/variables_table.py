"""The README's table of the ``FLEETMPI_*`` variables, rendered from ``fleetmpi.core.knobs.KNOBS``.

The table sits between the two marker lines ``TABLE_START`` and ``TABLE_END``.
"""
from ..core.knobs import AUTO_ALLOWABLE, KNOBS

TABLE_START = "<!-- variables: python -m fleetmpi.docs regenerate -->"
TABLE_END = "<!-- end of variables -->"


def _shown(default):
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return f"`{int(default)}`"
    if isinstance(default, frozenset):
        return f"`{','.join(name for name in AUTO_ALLOWABLE if name in default)}`"
    if isinstance(default, float):
        return f"`{default:g}`"
    return f"`{default}`"


def markdown_table():
    """The table of the variables, with its two marker lines."""
    rows = [TABLE_START, "| variable | default | values | what it does |",
            "| --- | --- | --- | --- |"]
    rows += [f"| `{knob.name}` | {_shown(knob.default)} | {knob.allowed} | {knob.doc} |"
             for knob in KNOBS]
    return "\n".join(rows + [TABLE_END]) + "\n"


def with_table(text):
    """``text`` (a README) with its table of variables replaced by ``markdown_table()``."""
    start, end = text.index(TABLE_START), text.index(TABLE_END) + len(TABLE_END) + 1
    return text[:start] + markdown_table() + text[end:]


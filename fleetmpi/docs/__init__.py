"""Files of the repository generated from the code, and the one command that writes them or
checks that they are current:

    python -m fleetmpi.docs regenerate   # rewrite every generated file
    python -m fleetmpi.docs --check      # exit 1, naming each file that is out of date

Generated are the schema's Python module, ``docs/strategy_fields.md``,
``docs/strategy_pairs.md`` and the README's table of ``FLEETMPI_*`` variables.

``tests/run`` runs the check. The tool works in a source checkout (``pip install -e``), where
the files live; ``proto/distributed_strategy_pb2.py`` needs ``grpcio-tools`` (the ``test``
extra) for protoc.
"""
import os

from . import proto_module, strategy_fields, strategy_pairs, variables_table

# The checkout: this package is fleetmpi/docs/ in it.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def whole(render):
    """An update that replaces the whole file with ``render()``."""
    return lambda current: render()


# Each generated file (relative to the checkout) and its update: the file's text as it should
# be today, from its current text (None when missing), for files generated in part.
GENERATED = (
    (os.path.join("proto", proto_module.GENERATED_NAME), whole(proto_module.generate_source)),
    (os.path.join("docs", "strategy_fields.md"), whole(strategy_fields.render)),
    (os.path.join("docs", "strategy_pairs.md"), whole(strategy_pairs.pair_table)),
    ("README.md", variables_table.with_table),
)


def _current(root, path):
    try:
        with open(os.path.join(root, path)) as f:
            return f.read()
    except FileNotFoundError:
        return None


def stale(root=ROOT, generated=GENERATED):
    """The paths (relative to ``root``) whose content differs from what renders today."""
    found = []
    for path, update in generated:
        current = _current(root, path)
        try:
            fresh = update(current)
        except (TypeError, ValueError):  # a part's markers missing from the file
            fresh = None
        if current is None or current != fresh:
            found.append(path)
    return found


def regenerate(root=ROOT, generated=GENERATED):
    """Write every generated file under ``root``; returns the paths written."""
    for path, update in generated:
        text = update(_current(root, path))
        with open(os.path.join(root, path), "w") as f:
            f.write(text)
    return [path for path, _ in generated]

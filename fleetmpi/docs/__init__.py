"""Files of the repository generated from the code, and the one command that writes them or
checks that they are current:

    python -m fleetmpi.docs regenerate   # rewrite every generated file
    python -m fleetmpi.docs --check      # exit 1, naming each file that is out of date

``tests/run`` runs the check. The tool works in a source checkout (``pip install -e``), where
the files live; ``proto/distributed_strategy_pb2.py`` needs ``grpcio-tools`` (the ``test``
extra) for protoc.
"""
import os

from . import proto_module, strategy_fields, strategy_pairs

# The checkout: this package is fleetmpi/docs/ in it.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Each generated file (relative to the checkout) and the function that renders it today.
GENERATED = (
    (os.path.join("proto", proto_module.GENERATED_NAME), proto_module.generate_source),
    (os.path.join("docs", "strategy_fields.md"), strategy_fields.render),
    (os.path.join("docs", "strategy_pairs.md"), strategy_pairs.pair_table),
)


def stale(root=ROOT, generated=GENERATED):
    """The paths (relative to ``root``) whose content differs from what renders today."""
    found = []
    for path, render in generated:
        try:
            with open(os.path.join(root, path)) as f:
                current = f.read()
        except FileNotFoundError:
            current = None
        if current != render():
            found.append(path)
    return found


def regenerate(root=ROOT, generated=GENERATED):
    """Write every generated file under ``root``; returns the paths written."""
    for path, render in generated:
        with open(os.path.join(root, path), "w") as f:
            f.write(render())
    return [path for path, _ in generated]

"""``python -m fleetmpi.strategies.pairs_doc [path]``: write the table of which strategies
combine (``docs/strategy_pairs.md``) from ``compose.ORDER`` and ``compose.CONFLICTS``."""
import itertools
import os
import sys

from .compose import CONFLICTS, LIMITS, ORDER, SEARCHED


def pair_table():
    """Markdown: every pair of strategies, whether it works, and why not."""
    lines = ["# Which strategies combine", "",
             "Generated from `strategies/compose.py` by "
             "`python -m fleetmpi.strategies.pairs_doc`; do not edit by hand.", "",
             "Hooks run in this order, outermost first (the gradient reduction innermost): "
             + ", ".join(f"`{name}`" for name in ORDER) + ".", "",
             "| strategy | with | combined |", "| --- | --- | --- |"]
    for a, b in itertools.combinations(ORDER, 2):
        reason = CONFLICTS.get(frozenset({a, b}))
        limit = LIMITS.get(frozenset({a, b}))
        verdict = ("refused: " + reason if reason is not None
                   else "works" if limit is None else "works with " + limit)
        lines.append(f"| `{a}` | `{b}` | {verdict} |")
    lines += ["", "Searched, not combined: "
              + ", ".join(f"`{name}`" for name in SEARCHED)
              + " is replaced by the strategy its calibration measures fastest, which obeys "
                "this table (see `docs/auto.md`).", ""]
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else os.path.join("docs", "strategy_pairs.md")
    with open(path, "w") as out:
        out.write(pair_table())


if __name__ == "__main__":
    main()

"""``docs/strategy_pairs.md``: which strategies combine, from ``compose.ORDER``,
``compose.CONFLICTS`` and ``compose.LIMITS``."""
import itertools

from fleetmpi.strategies.compose import CONFLICTS, LIMITS, ORDER, SEARCHED


def pair_table():
    """Markdown: every pair of strategies, whether it works, and why not."""
    lines = ["# Which strategies combine", "",
             "Generated from `strategies/compose.py` by "
             "`python -m fleetmpi.docs regenerate`; do not edit by hand.", "",
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


"""Counts and first lines of failures from pytest's JUnit XML (``--junitxml``).

A multi-rank run writes one file per rank; a test counts as failed when it failed on any
rank (the ranks are named), and otherwise as rank 0 reports it.
"""
import xml.etree.ElementTree as ET

FAILURE_LINES = 6
LINE_CHARS = 200


def _first_lines(element):
    """The failure's message, then the ``E`` lines of its report, at most ``FAILURE_LINES``."""
    message = [line for line in (element.get("message") or "").splitlines() if line.strip()]
    raised = [line for line in (element.text or "").splitlines() if line.startswith("E ")]
    lines = message[:2] + [line for line in raised if line[1:].strip() not in message]
    return [line[:LINE_CHARS] for line in lines[:FAILURE_LINES]] or ["(no message)"]


def outcomes(path):
    """``{test id: (outcome, first lines)}`` of one JUnit XML file; the outcome is
    ``"passed"``, ``"failed"`` (a failure or an error) or ``"skipped"``."""
    found = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        if not case.get("name"):  # pytest interrupted writes an empty case for the test it was in
            continue
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            found[test] = ("failed", _first_lines(bad))
        elif found.get(test, ("",))[0] != "failed":
            found[test] = ("skipped" if case.find("skipped") is not None else "passed", [])
    return found


def summarize(paths):
    """``{"passed", "failed", "skipped", "failures": [{"test", "lines"}]}`` over ``paths`` (one
    JUnit XML file per rank, rank 0 first); files that were never written whole are left out."""
    merged = {}
    for rank, path in enumerate(paths):
        try:
            found = outcomes(path)
        except (OSError, ET.ParseError):
            continue
        for test, (outcome, lines) in found.items():
            seen = merged.setdefault(test, [outcome, lines, []])
            if outcome == "failed":
                if seen[0] != "failed":
                    seen[:2] = outcome, lines
                seen[2].append(rank)
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    for test, (outcome, lines, ranks) in merged.items():
        counts[outcome] += 1
        if outcome == "failed":
            where = f" (rank {', '.join(map(str, ranks))})" if len(paths) > 1 else ""
            failures.append({"test": test + where, "lines": lines})
    return dict(counts, failures=failures)

"""What a mistyped name may have meant: the hint of every "no such field / key" refusal.

With case ignored, the names fewest edits away (insertions, deletions, substitutions): a name
equal but for case is the one answer (``fuse_grad_size_in_mb`` means ``fuse_grad_size_in_MB``,
not ``fuse_grad_size_in_num``), and names tied for fewest are all given, at most ``LIMIT``;
none more than a third of the name's length away.
"""
LIMIT = 3


def edit_distance(a, b):
    """Levenshtein distance between the strings ``a`` and ``b``."""
    previous = list(range(len(b) + 1))
    for i, char in enumerate(a, 1):
        current = [i]
        for j, other in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1,
                               previous[j - 1] + (char != other)))
        previous = current
    return previous[-1]


def close_names(name, names, limit=LIMIT):
    """Up to ``limit`` of ``names`` that ``name`` may have meant (module docstring), in the
    order of ``names``."""
    wanted = name.lower()
    scored = [(edit_distance(wanted, candidate.lower()), candidate)
              for candidate in dict.fromkeys(names) if candidate != name]
    best = min((distance for distance, _ in scored), default=None)
    if best is None or best > max(1, len(wanted) // 3):
        return []
    return [candidate for distance, candidate in scored if distance == best][:limit]


def did_you_mean(name, names):
    """`` (did you mean 'a', 'b' or 'c'?)`` for ``name`` among ``names``, or ``""``."""
    if not isinstance(name, str):
        return ""
    close = [repr(candidate) for candidate in close_names(name, names)]
    if not close:
        return ""
    listed = close[0] if len(close) == 1 else ", ".join(close[:-1]) + " or " + close[-1]
    return f" (did you mean {listed}?)"

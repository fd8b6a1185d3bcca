"""Every rank loads a checkpoint or none does.

Each rank reads, checks and applies its own part of a checkpoint (its file, and with a sharded
optimizer the shards it joins). A part that one rank refuses must stop the load on every rank:
otherwise a script that catches the error carries on with ranks that disagree on their
parameters. ``refusal`` shares each rank's verdict over the world communicator, through the
stall inspector's exchange (so a rank that never reaches ``load`` is named after
``FLEETMPI_STALL_TIMEOUT`` instead of hanging the others), and builds on every rank the same
error, naming each refusing rank and why.
"""
import numpy as np

COLLECTIVE = "checkpoint.load"
# The error types a refusal keeps when every refusing rank raised the same one (checked in
# this order, so a subclass counts as the first one it is); any other, or a mix, becomes a
# ValueError.
KINDS = (FileNotFoundError, KeyError, ValueError)
# How many different reasons the error spells out; the ranks of the others are listed.
SHOWN_REASONS = 4


def _kind(error):
    return next((i for i, kind in enumerate(KINDS) if isinstance(error, kind)), len(KINDS))


def _reason(error, path):
    """One rank's refusal as text: ``error``'s message (a KeyError's without the quotes its
    ``str`` adds), prefixed with ``path`` when given and not already named there."""
    if isinstance(error, KeyError) and len(error.args) == 1 and isinstance(error.args[0], str):
        text = error.args[0]
    else:
        text = str(error) or type(error).__name__
    if not isinstance(error, KINDS):
        text = f"{type(error).__name__}: {text}"
    return text if path is None or path in text else f"{path}: {text}"


def _gather_texts(comm, kind, text):
    """``(kinds, texts)``: every rank's error kind (-1: none) and text, in rank order."""
    from fleetmpi.comm.stall import gather_rows

    data = text.encode(errors="backslashreplace")  # a file name may hold undecodable bytes
    heads = gather_rows(comm, np.array([kind, len(data)], dtype=np.int64), COLLECTIVE)
    longest = int(heads[:, 1].max())
    if longest == 0:
        return heads[:, 0], [""] * len(heads)
    row = np.zeros(-(-longest // 8) * 8, dtype=np.uint8)
    row[:len(data)] = np.frombuffer(data, dtype=np.uint8)
    rows = gather_rows(comm, row.view(np.int64), COLLECTIVE)
    return heads[:, 0], [rows[r].view(np.uint8)[:n].tobytes().decode(errors="replace")
                         for r, n in enumerate(heads[:, 1])]


def _message(directory, texts):
    from fleetmpi.comm.stall_report import ranks_text

    by_reason = {}
    for rank, text in enumerate(texts):
        if text:
            by_reason.setdefault(text, []).append(rank)
    parts = [f"rank{'s' if len(ranks) > 1 else ''} {ranks_text(ranks)}: {text}"
             for text, ranks in list(by_reason.items())[:SHOWN_REASONS]]
    others = [r for ranks in list(by_reason.values())[SHOWN_REASONS:] for r in ranks]
    if others:
        parts.append(f"and rank(s) {ranks_text(others)} for other reasons")
    return (f"checkpoint in {directory!r} was loaded on none of the {len(texts)} ranks, "
            f"because not every rank could load its part; " + "; ".join(parts))


def refusal(comm, directory, error, path=None):
    """None when no rank of ``comm`` refused its part of the checkpoint in ``directory``;
    otherwise the exception every rank is to raise, alike on all. ``error`` is this rank's
    (None when it loaded its part), ``path`` the file it refused, when the error does not name
    it. Every rank of ``comm`` must call it."""
    kinds, texts = _gather_texts(comm, -1 if error is None else _kind(error),
                                 "" if error is None else _reason(error, path))
    failed = sorted({int(k) for k in kinds if k >= 0})
    if not failed:
        return None
    kind = KINDS[failed[0]] if len(failed) == 1 and failed[0] < len(KINDS) else ValueError
    return kind(_message(directory, texts))

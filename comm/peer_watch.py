"""Point-to-point calls under the stall watchdog: what a rank notes, answers and reports.

Collectives are matched across ranks by their call number on a communicator; ``send`` and
``recv`` are not: rank 0's fifth ``recv`` from rank 1 matches rank 1's fifth ``send`` to
rank 0, whatever else either made in between. So each rank counts, per peer, the sends it
started to that peer and the receives it started from it (``PeerCalls``: three attribute
writes and one list item per call). A rank in its ``number``-th ``recv`` from ``s`` waits
for ``s``'s ``number``-th send to it; asked (the watchdog's question on the communicator's
side tags), ``s`` answers how many sends to the asker it has started, whether its script
has finished (announced at exit with the same counts), and the calls it is blocked in. That
tells apart:

* the peer arrived (its count reached ``number``): the transfer is under way;
* the peer finished its script, or waits in a call that needs this rank (a ``recv`` from this
  rank while this rank receives from it, a collective of a communicator this rank belongs to
  and has not reached): it cannot arrive, reported at once;
* the peer is alive but never sent (in no call, or waiting on a third rank): reported once
  the call has waited ``FLEETMPI_STALL_TIMEOUT``.
"""
from fleetmpi.core.knobs import STALL_TIMEOUT

SEND, RECV = "send", "recv"
# What the peer must have started for each call this rank may wait in: its answer's key.
MATCHING = {RECV: "sent", SEND: "received"}


class PeerCalls:
    """Where one rank is in the point-to-point calls of one communicator (module docstring).

    ``sent[p]``, ``received[p]``: the sends to and receives from rank ``p`` started;
    ``what``: ``(op, peer, number, dtype, shape)`` of the last call; ``started`` and
    ``ended`` count every call, so that ``started != ended`` says one is in flight."""

    __slots__ = ("sent", "received", "what", "started", "ended", "finished", "seen", "since",
                 "next_inquiry", "inquiry")

    def __init__(self, size):
        self.sent, self.received = [0] * size, [0] * size
        self.what = None
        self.started = self.ended = 0
        self.finished = {}  # rank -> its (sent to, received from) this rank when it ended
        self.seen, self.since, self.next_inquiry, self.inquiry = 0, 0.0, 0.0, None

    def enter_send(self, dest, x):
        number = self.sent[dest] = self.sent[dest] + 1
        self.what = (SEND, dest, number, x.dtype, x.shape)
        self.started += 1

    def enter_recv(self, source, x):
        number = self.received[source] = self.received[source] + 1
        self.what = (RECV, source, number, x.dtype, x.shape)
        self.started += 1

    def in_flight(self):
        return self.started != self.ended

    def answer(self, asker):
        """This rank's point-to-point part of its answer to ``asker``."""
        what = self.what
        return {"sent": self.sent[asker], "received": self.received[asker],
                "in_flight": self.in_flight(), "text": peer_call_text(what),
                "peer": None if what is None else what[1]}


def peer_call_text(what):
    """``("recv", 1, 4, float64, (3, 16))`` -> ``"recv #4 from rank 1 of float64 (3, 16)"``."""
    if what is None:
        return "no point-to-point call yet"
    op, peer, number, dtype, shape = what
    return f"{op} #{number} {'to' if op == SEND else 'from'} rank {peer} of {dtype} {tuple(shape)}"


def _peer_count_text(op, count):
    return (f"{count} send(s) to this rank" if op == RECV else
            f"{count} receive(s) from this rank")


def _blocked_on_me(answer, my_started, my_counts):
    """The collective the peer is blocked in that needs this rank (which is not in it), or
    None."""
    if answer.get("blocked_here") and answer["started"] > my_started:
        return f"{answer['text']}, call #{answer['started']} of this communicator"
    for identity, number, text, includes_me in answer["elsewhere"]:
        if includes_me and my_counts.get(identity, 0) < number:
            return f"{text}, call #{number} of another communicator"
    return None


def peer_verdict(what, rank, answer, finished, counts):
    """``(line, arrived, certain)`` for this rank (``rank``) in point-to-point call ``what``.

    ``answer``: the peer's answer (None: it did not answer); ``finished``: the peer's
    ``{"sent", "received"}`` counts toward this rank if its script ended; ``counts``:
    ``(this rank's collectives on this communicator, identity -> its collectives on each
    of its communicators)``."""
    op, peer, number = what[:3]
    key = MATCHING[op]
    if finished is not None and finished[key] < number:
        return (f"rank {peer} finished its script after {_peer_count_text(op, finished[key])}",
                False, True)
    if answer is None:
        return (f"rank {peer} did not answer (a long computation that holds the interpreter, or "
                f"a signal, keeps its watchdog from running)", False, False)
    p2p = answer["p2p"]
    if p2p[key] >= number:
        return f"rank {peer} has arrived there ({p2p['text']})", True, False
    where = (f"it has made {_peer_count_text(op, p2p[key])}; its last point-to-point call "
             f"{p2p['text']}; its last collective here #{answer['started']} ({answer['text']})")
    if p2p["in_flight"]:
        certain = p2p["peer"] == rank
        return f"rank {peer} waits in {p2p['text']}; {where}", False, certain
    blocked = _blocked_on_me(answer, *counts)
    if blocked is not None:
        return f"rank {peer} waits in {blocked}, which this rank has not reached; {where}", \
            False, True
    return f"rank {peer} is in no call; {where}", False, False


def peer_stall_message(rank, size, what, waited, line, arrived, certain):
    """The report of a rank waiting in point-to-point call ``what``."""
    op, peer = what[:2]
    head = (f"[fleetmpi] stall: rank {rank}/{size} has waited {waited:.1f} s in "
            f"{peer_call_text(what)}; ")
    need = "the matching send" if op == RECV else "the matching receive"
    body = line if arrived else f"rank {peer} has not made {need}: {line}"
    tail = ("; it cannot arrive, aborting the job" if certain else
            f"; {STALL_TIMEOUT.name} is exceeded, aborting the job")
    return head + body + tail

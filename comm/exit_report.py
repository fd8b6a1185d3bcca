"""What a rank that finished its script says of the ranks that never finished theirs.

At the end of its script a rank announces it on every watched communicator and waits for the
others' announcements (``Watchdog.finish``), which ``MPI_Finalize`` would wait for anyway,
forever where a rank hangs outside any call. After ``FLEETMPI_STALL_TIMEOUT`` it asks the
ranks still missing where they are and, where one is in no call (or silent), reports them
and ends the job; a rank waiting in a watched call is left to its own watchdog. Once every
rank has finished, ranks that made different numbers of calls on one communicator are
reported and the job ends non-zero (``count_message``). The functions here are pure.
"""
from fleetmpi.core.knobs import CHECK_COLLECTIVES, STALL_TIMEOUT

from .stall_report import ranks_text


def in_a_call(answer):
    """Whether an answer says its rank waits in a watched call (which its own watchdog
    reports once it overstays)."""
    return answer is not None and (answer["in_flight"] or answer["p2p"]["in_flight"]
                                   or bool(answer["elsewhere"]))


def unfinished_line(rank, answer):
    """Where rank ``rank`` (of the communicator asked) is, from its answer (None: silent)."""
    if answer is None:
        return (f"rank {rank} did not answer (a long computation that holds the interpreter, "
                f"or a signal, keeps its watchdog from running)")
    p2p = answer["p2p"]
    if answer["in_flight"]:
        where = f"waits in {answer['text']}, call #{answer['started']} of this communicator"
    elif p2p["in_flight"]:
        where = f"waits in {p2p['text']}"
    elif answer["elsewhere"]:
        _, number, text, _ = answer["elsewhere"][0]
        where = f"waits in {text}, call #{number} of another communicator"
    else:
        where = "is in no call"
    return (f"rank {rank} {where}; its last collective here #{answer['started']} "
            f"({answer['text']}); its last point-to-point call {p2p['text']}")


def exit_message(rank, size, waited, missing, lines):
    """The report of rank ``rank`` that finished and waited ``waited`` s for ``missing``."""
    return (f"[fleetmpi] stall: rank {rank}/{size} finished its script and has waited "
            f"{waited:.1f} s for rank(s) {ranks_text(missing)} to finish theirs: "
            + "; ".join(lines) + f"; {STALL_TIMEOUT.name} is exceeded, aborting the job "
            "instead of waiting in MPI_Finalize")


def count_message(rank, size, made, last, finished):
    """The report of rank ``rank`` that made ``made`` calls on a communicator (the last one
    ``last``, as text) while other ranks finished theirs after ``finished`` (rank -> calls).

    Every rank of a communicator makes the same collectives, so different counts at the end
    mean that a call completed on some ranks without the others: the root of a broadcast
    sends and returns whether or not anyone receives, so a rank that skipped one received
    the root's next broadcast in its place, and a repeated call skips the agreement on
    arguments that would have told."""
    counts = ", ".join(f"rank {r}: {n}" for r, n in sorted(finished.items()))
    return (f"[fleetmpi] rank {rank}/{size} finished its script after {made} call(s) of a "
            f"communicator, the last {last}, but the other ranks made other numbers of calls "
            f"there ({counts}): a rank skipped or added a collective whose data then went to "
            f"another call (a root's broadcast returns whether or not it is received; "
            f"{CHECK_COLLECTIVES.name}=always makes every call agree on its arguments and "
            "catches it at that call); aborting the job")

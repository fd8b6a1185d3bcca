"""What a stall report says, and the abort that follows it.

The watchdog (``fleetmpi.comm.watchdog``) asks the other ranks where they are once a call
overstays; ``verdict`` turns their answers into the report's lines and says whether the wait is
certainly hopeless (a rank finished its script, waits in a call this rank has not reached, or
makes a different call at the same call number) or only long. The functions here are pure,
apart from ``main_thread_site`` (which reads where the main thread is), ``write_report`` and
``end_job`` (which ``end_jobs_with`` can hand to the pytest plugin).
"""
import os
import re
import sys
import threading

from fleetmpi.core.knobs import CHECK_COLLECTIVES, STALL_TIMEOUT

# How long a rank that reports a stall waits before aborting, so that the other waiting ranks
# get to write their reports before the launcher ends them.
REPORT_LINGER_SECONDS = 1.0
# Collectives whose arrays must have one shape on every rank: two ranks in one of these at the
# same call number with different shapes are making different calls.
EQUAL_SHAPES = ("allreduce", "allreduce_many", "broadcast", "broadcast_many", "barrier",
                "reduce_scatter")
# Collectives whose arrays may differ in their first dimension only: two ranks in one of these
# at the same call number with another dtype or other trailing dimensions make different calls.
FIRST_DIMENSION_FREE = ("allgather", "gather", "alltoall", "allgatherv")


def ranks_text(ranks):
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    parts, ranks = [], sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(parts)


def _array_text(a):
    return f"{a.dtype} {tuple(a.shape)}"


def arguments_text(args):
    """The dtype and shape of a collective's array (or of the first of its list of arrays)."""
    if not args:
        return ""
    first = args[0]
    if hasattr(first, "dtype") and hasattr(first, "shape"):
        return _array_text(first)
    if isinstance(first, (list, tuple)) and first and hasattr(first[0], "dtype"):
        shown = ", ".join(_array_text(a) for a in first[:3])
        if len(first) > 3:
            shown += f", ... ({len(first)} arrays, {sum(int(a.size) for a in first)} elements)"
        return shown
    return ""


def call_text(what):
    """``what`` a watch holds of its call, as text: ``(name, text)`` when the text was made
    ahead, ``(name, args, kwargs)`` when it is made only now that it is asked for."""
    if what is None:
        return "no collective yet"
    if len(what) == 2:
        return what[1]
    name, args, kwargs = what
    arrays = args or tuple(v for k, v in kwargs.items() if k in ("x", "arrays"))
    inner = arguments_text(arrays)
    return f"{name} of {inner}" if inner else name


def call_name(what):
    return None if what is None else what[0]


def call_site(frame):
    """Where the script called into fleetmpi: from ``frame`` outwards, the first frame outside
    fleetmpi's modules, as ``file.py:line in function``."""
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == \
            "fleetmpi":
        frame = frame.f_back
    if frame is None:
        return "fleetmpi"
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"


def main_thread_site():
    """``call_site`` of where the main thread is now (asked from another thread, the
    watchdog's: the call the script is blocked in), or None when it has no frame."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return None if frame is None else call_site(frame)


def _first_dimension_dropped(text):
    """``allgather of float64 (4, 3)`` -> ``allgather of float64 (, 3)``."""
    return re.sub(r"\(\d+,? ?", "(", text, count=1)


def _different_call(mine, answer):
    """Whether an answer at this rank's call number is in a call that cannot match it."""
    if answer["name"] != mine["name"]:
        return True
    if mine["name"] in FIRST_DIMENSION_FREE:
        return _first_dimension_dropped(answer["text"]) != _first_dimension_dropped(mine["text"])
    return mine["name"] in EQUAL_SHAPES and answer["text"] != mine["text"]


def _missing_line(rank, answer, call, my_counts):
    """(line, certain) for a rank that has not arrived at call number ``call``."""
    last = f"its last call here #{answer['started']} ({answer['text']})"
    for identity, number, text, includes_me in answer["elsewhere"]:
        if includes_me and my_counts.get(identity, 0) < number:
            return (f"rank {rank} waits in {text}, call #{number} of another communicator, "
                    f"which this rank has not reached; {last}"), True
    if answer["elsewhere"]:
        _, number, text, _ = answer["elsewhere"][0]
        return f"rank {rank} waits in {text}, call #{number} of another communicator; {last}", False
    return f"rank {rank} is in no collective; {last}", False


def _different_line(rank, answer, finished):
    """The line of a rank whose call at this number is another (in flight or made already:
    a repeated call skips the agreement, so a rank whose call differs from the ones agreed
    before meets the others' calls here)."""
    site = f" (at {answer['site']})" if answer.get("site") else ""
    if answer["in_flight"]:
        return f"rank {rank} waits in a different call at this number: {answer['text']}{site}"
    then = ", then finished its script" if finished else ""
    return (f"rank {rank} made a different call at this number: {answer['text']}{then}; a "
            f"repeated call skips the agreement on arguments "
            f"({CHECK_COLLECTIVES.name}=always makes every call agree)")


def verdict(mine, call, answers, finished, my_counts, blocking):
    """``(missing ranks, lines, certain)`` for this rank waiting in call number ``call``
    (``mine``: its ``name`` and ``text``).

    ``answers``: rank -> the rank's answer (its ``started`` calls on this communicator, the
    ``name`` and ``text`` of its last one, whether it is ``in_flight``, and ``elsewhere``, its
    blocking calls on other communicators as ``(identity, call number, text, includes the
    asker)``) or None when it did not answer; ``finished``: rank -> how many calls it made on
    this communicator before its script ended; ``my_counts``: identity -> this rank's calls on
    each of its communicators; ``blocking``: whether the caller waits on this call (it is not
    an asynchronous operation on the background thread), which is what makes a rank waiting
    elsewhere for it a certain deadlock."""
    missing, lines, certain = [], [], False
    for rank in sorted(set(answers) | set(finished)):
        if rank in finished and finished[rank] < call:
            missing.append(rank)
            lines.append(f"rank {rank} finished its script after {finished[rank]} call(s) "
                         f"of this communicator")
            certain = True
            continue
        answer = answers.get(rank)
        if answer is None:
            missing.append(rank)
            lines.append(f"rank {rank} did not answer (a long computation that holds the "
                         f"interpreter, or a signal, keeps its watchdog from running)")
        elif answer["started"] == call and _different_call(mine, answer):
            missing.append(rank)
            lines.append(_different_line(rank, answer, rank in finished))
            certain = certain or blocking
        elif answer["started"] < call:
            missing.append(rank)
            line, sure = _missing_line(rank, answer, call, my_counts)
            lines.append(line)
            certain = certain or (sure and blocking)
    return missing, lines, certain


def stall_message(rank, size, mine, call, waited, missing, lines, certain):
    """The report one waiting rank writes."""
    head = (f"[fleetmpi] stall: rank {rank}/{size} has waited {waited:.1f} s in {mine['name']}, "
            f"call #{call} of its communicator ({mine['text']}); ")
    if missing:
        body = f"rank(s) {ranks_text(missing)} have not arrived there: " + "; ".join(lines)
    else:
        body = "every rank answered that it has arrived there"
    tail = ("; they cannot arrive, aborting the job" if certain else
            f"; {STALL_TIMEOUT.name} is exceeded, aborting the job")
    site = f" (this rank's call is at {mine['site']})" if mine.get("site") else ""
    return head + body + tail + site


def write_report(message):
    """Write a stall report to stderr at once (the job ends a little later, see
    ``REPORT_LINGER_SECONDS``)."""
    sys.stdout.flush()
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


_ender = None


def end_jobs_with(ender):
    """Have ``ender()`` end the job after a stall report (None: abort at once). It is called
    from the thread that reported (the watchdog's, or the main thread at exit) and returns
    only where it leaves the job to the abort; the pytest plugin (``fleetmpi.testing``) writes
    the session's summary on every rank first."""
    global _ender
    _ender = ender


def end_job():
    """End the whole MPI job after a stall report, whichever launcher started it."""
    from fleetmpi.core.failure import abort

    if _ender is not None:
        _ender()
    abort(None)

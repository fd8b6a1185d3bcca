"""The stall watchdog: every collective, the first or the millionth, timed from one thread.

A collective only notes where it is: its communicator's ``Watch`` counts the calls started
(``started``, the call number) and ended, and keeps ``what`` the current call is. A repeated
``allreduce`` does that in three attribute writes, so the fast path stays fast. One daemon
thread per process (``Watchdog``) looks at every watch each ``TICK_SECONDS``; a call still in
flight is timed from the tick that first saw it.

Asking. Each watch's MPI communicator doubles as its side channel, on tags no collective
uses. Once a call has been in flight ``FIRST_INQUIRY_SECONDS`` (then after twice as long each
time, and at ``FLEETMPI_STALL_TIMEOUT``), the watchdog asks the other ranks of that
communicator where they are (``QUERY_TAG``). Their watchdogs answer (``ANSWER_TAG``, a small
JSON text, never pickle) with their call count there, their last call's name and shapes,
and the calls their callers are blocked in on other communicators. A rank that finishes its
script announces it on every watched communicator (``FINISHED_TAG``, from ``atexit``, before
MPI is finalized).

Point-to-point. ``Communicator.send`` and ``recv`` note themselves in the watch's ``peers``
(``peer_watch.PeerCalls``: counts per peer, so that a ``recv`` can be matched with the peer's
``send`` of the same number); one in flight is timed the same way, only its peer is asked,
and ``peer_watch.peer_verdict`` reads the answer.

Reporting. ``stall_report.verdict`` reads the answers. A rank that finished before this call,
one blocked in a call this rank has not reached, or one in a different call at this number
cannot arrive: that is reported at once, within seconds at any stall time. Otherwise the
watchdog reports once the call has waited ``FLEETMPI_STALL_TIMEOUT`` (default 600 s; ``0``
starts no watchdog, so calls wait forever). Each waiting rank writes its own report, then
the job is aborted (``stall_report.stalled``), whichever launcher started it.
"""
import atexit
import json
import math
import os
import threading
import time
import zlib

import numpy as np

from fleetmpi.core.knobs import STALL_TIMEOUT
from .exit_report import count_message, exit_message, in_a_call, unfinished_line
from .peer_watch import PeerCalls, peer_stall_message, peer_verdict
from .stall_report import (REPORT_LINGER_SECONDS, call_name, call_text, end_job,
                           main_thread_site, stall_message, verdict, write_report)

QUERY_TAG = 32101
ANSWER_TAG = 32102
FINISHED_TAG = 32103
TICK_SECONDS = 0.1
FIRST_INQUIRY_SECONDS = 1.0
ANSWER_SECONDS = 1.0
ANSWER_BYTES = 4096
FINISH_SECONDS = 1.0

_keyval = None
_watchdog = None
_lock = threading.Lock()
_sequences = {}  # group checksum -> watches made over that group so far (their identities)


def stall_seconds(environ=os.environ):
    """``FLEETMPI_STALL_TIMEOUT`` in seconds: 600 when unset, ``inf`` for ``0`` (no limit)."""
    seconds = STALL_TIMEOUT.value(environ)
    return math.inf if seconds == 0 else seconds


class Watch:
    """Where one rank is in the collectives of one MPI communicator (module docstring).

    ``comm_thread``: the communicator's background thread, if any; a call in flight while it
    has operations pending is one of them, which blocks the caller only while the caller
    waits on a handle (or drains the thread).
    ``identity``: the same number on every rank for the same communicator (a checksum of its
    members' world ranks and how many watches over them this process made before), so that a
    rank blocked elsewhere can say where in terms the others can look up.
    ``diverged``: set once the ranks were told they called different collectives here (a
    ``CollectiveMismatchError``): their call counts may differ from then on."""

    __slots__ = ("comm", "rank", "size", "members", "identity", "started", "ended", "what",
                 "comm_thread", "finished", "seen", "since", "next_inquiry", "inquiry", "peers",
                 "diverged")

    def __init__(self, comm, members):
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        self.members = members
        checksum = zlib.crc32(np.asarray(members, dtype=np.int64).tobytes())
        with _lock:
            _sequences[checksum] = _sequences.get(checksum, 0) + 1
            self.identity = (checksum << 20) + _sequences[checksum]
        self.started = self.ended = 0
        self.what = None
        self.comm_thread = None
        self.diverged = False
        self.finished = {}
        self.seen, self.since, self.next_inquiry, self.inquiry = 0, 0.0, 0.0, None
        self.peers = PeerCalls(self.size)  # its point-to-point calls (``peer_watch``)

    def enter(self, what):
        """Note a call starting, unless one is in flight already (this one is part of it);
        True when noted: the caller then adds 1 to ``ended`` when the call returns."""
        if self.started != self.ended:
            return False
        self.what = what
        self.started += 1
        return True

    def leave(self):
        """Note the call noted by ``enter`` ending. Only the text of its arguments is kept:
        a watch holding the arrays of a communicator's last call would keep them alive until
        its next call, for good on a communicator used once (a whole model broadcast by
        ``distributed_model``)."""
        self.what = (self.what[0], call_text(self.what))
        self.ended += 1

    def blocking(self):
        thread = self.comm_thread
        return thread is None or not thread.pending_count or thread.waiting > 0


def watch_of(comm):
    """The ``Watch`` of the MPI communicator ``comm``, made on first use (no communication)
    and registered with the process's watchdog when the stall time is finite."""
    global _keyval
    from mpi4py import MPI

    if _keyval is None:
        _keyval = MPI.Comm.Create_keyval()
    watch = comm.Get_attr(_keyval)
    if watch is None:
        members = MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())),
                                            MPI.COMM_WORLD.Get_group())
        watch = Watch(comm, members)
        comm.Set_attr(_keyval, watch)
        if watch.size > 1 and math.isfinite(stall_seconds()):
            _start().add(watch)
    return watch


def unwatch(comm):
    """Stop watching ``comm`` (before it is freed)."""
    watch = None if _keyval is None else comm.Get_attr(_keyval)
    if watch is not None and _watchdog is not None:
        _watchdog.remove(watch)


def calls_in_flight(skip=None):
    """``(text, call number)`` of each watched collective in flight in this process (but on
    ``skip``'s communicator), for a report of where this rank is."""
    watches = [] if _watchdog is None else list(_watchdog.watches)
    return [(call_text(w.what), w.started) for w in watches
            if w.started != w.ended and w.comm is not skip]


def _start():
    global _watchdog
    with _lock:
        if _watchdog is None:
            _watchdog = Watchdog(stall_seconds())
            _watchdog.thread.start()
            atexit.register(_watchdog.finish)
    return _watchdog


def answer_of(watch, asker, watches):
    """This rank's answer to ``asker`` (a rank of ``watch``'s communicator), as JSON bytes."""
    asker_world = watch.members[asker]
    elsewhere = [[w.identity, w.started, call_text(w.what), asker_world in w.members]
                 for w in watches if w is not watch and w.started != w.ended and w.blocking()]
    in_flight = watch.started != watch.ended
    blocked = in_flight and watch.blocking()
    answer = {"started": watch.started, "in_flight": in_flight, "blocked_here": blocked,
              "name": call_name(watch.what), "text": call_text(watch.what),
              "site": main_thread_site() if blocked else None,
              "elsewhere": elsewhere, "p2p": watch.peers.answer(asker)}
    return json.dumps(answer).encode()[:ANSWER_BYTES]


class Inquiry:
    """One round of asking every other rank of a watch where it is."""

    def __init__(self, watch, others=None):
        from mpi4py import MPI

        comm = watch.comm
        while comm.Iprobe(source=MPI.ANY_SOURCE, tag=ANSWER_TAG):  # late answers of before
            comm.Recv(bytearray(ANSWER_BYTES), source=MPI.ANY_SOURCE, tag=ANSWER_TAG)
        if others is None:
            others = [r for r in range(watch.size) if r != watch.rank]
        self.buffers = {r: bytearray(ANSWER_BYTES) for r in others}
        self.receives = {r: comm.Irecv(self.buffers[r], source=r, tag=ANSWER_TAG)
                         for r in others}
        self.sends = [comm.Isend(np.zeros(1, np.int64), dest=r, tag=QUERY_TAG) for r in others]
        self.deadline = time.monotonic() + ANSWER_SECONDS
        self.answers = {}

    def done(self):
        from mpi4py import MPI

        for rank, request in list(self.receives.items()):
            status = MPI.Status()
            if request.Test(status):
                text = bytes(self.buffers[rank][:status.Get_count(MPI.BYTE)])
                self.answers[rank] = json.loads(text)
                del self.receives[rank]
        if self.receives and time.monotonic() < self.deadline:
            return False
        for request in self.receives.values():
            request.Cancel()
            request.Free()
        self.answers.update({rank: None for rank in self.receives})
        self.receives = {}
        return True


class Watchdog:
    """The process's watchdog thread (module docstring)."""

    def __init__(self, timeout):
        self.timeout = timeout
        self.watches = []
        self.sends = []
        self.ending = None  # once reported: when to end the job
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="fleetmpi-watchdog",
                                       daemon=True)

    def add(self, watch):
        with _lock:
            self.watches.append(watch)

    def remove(self, watch):
        with _lock:
            if watch in self.watches:
                self.watches.remove(watch)

    def _loop(self):
        while not self.stopping.wait(TICK_SECONDS):
            with _lock:
                for watch in list(self.watches):
                    if not self._listen(watch):
                        self.watches.remove(watch)
                watches = list(self.watches)
                for watch in watches:
                    if self.ending is None and watch.started != watch.ended:
                        self._judge(watch)
                    if self.ending is None and watch.peers.started != watch.peers.ended:
                        self._judge_peers(watch)
                self.sends = [r for r in self.sends if not r.Test()]
            if self.ending is not None and time.monotonic() >= self.ending:
                end_job()

    def _listen(self, watch):
        """Answer the questions that came, and note the ranks that finished; False when the
        communicator has been freed (by code that does not call ``unwatch`` first)."""
        from mpi4py import MPI

        try:
            self._answer(watch, MPI.Status())
        except MPI.Exception:
            return False
        return watch.comm != MPI.COMM_NULL

    def _answer(self, watch, status):
        from mpi4py import MPI

        comm = watch.comm
        if comm == MPI.COMM_NULL:
            return
        while comm.Iprobe(source=MPI.ANY_SOURCE, tag=QUERY_TAG, status=status):
            asker = status.Get_source()
            comm.Recv(np.zeros(1, np.int64), source=asker, tag=QUERY_TAG)
            answer = answer_of(watch, asker, self.watches)
            self.sends.append(comm.Isend(answer, dest=asker, tag=ANSWER_TAG))
        while comm.Iprobe(source=MPI.ANY_SOURCE, tag=FINISHED_TAG, status=status):
            counts, source = np.zeros(3, np.int64), status.Get_source()
            comm.Recv(counts, source=source, tag=FINISHED_TAG)
            watch.finished[source] = int(counts[0])
            watch.peers.finished[source] = {"sent": int(counts[1]), "received": int(counts[2])}

    def _judge(self, watch):
        """Time the call in flight on ``watch``; ask and report as the module docstring says."""
        now, call = time.monotonic(), watch.started
        if watch.seen != call:
            watch.seen, watch.since, watch.inquiry = call, now, None
            watch.next_inquiry = now + min(FIRST_INQUIRY_SECONDS, self.timeout)
        waited = now - watch.since
        if any(count < call for count in watch.finished.values()):
            self._report(watch, call, waited, {})
            return
        if watch.inquiry is None and now >= watch.next_inquiry:
            watch.inquiry = Inquiry(watch)
        if watch.inquiry is not None and watch.inquiry.done():
            answers, watch.inquiry = watch.inquiry.answers, None
            if not self._report(watch, call, waited, answers, only_certain=True):
                watch.next_inquiry = watch.since + min(2 * waited, self.timeout)
                if waited >= self.timeout:
                    self._report(watch, call, waited, answers)

    def _report(self, watch, call, waited, answers, only_certain=False):
        """Write the report and end the job ``REPORT_LINGER_SECONDS`` later, answering the
        other ranks meanwhile so that their reports say where this rank is; with
        ``only_certain``, only when the ranks missing cannot arrive (else False)."""
        mine = {"name": call_name(watch.what), "text": call_text(watch.what),
                "site": main_thread_site() if watch.blocking() else None}
        counts = {w.identity: w.started for w in self.watches}
        missing, lines, certain = verdict(mine, call, answers, watch.finished, counts,
                                          watch.blocking())
        if only_certain and not certain:
            return False
        write_report(stall_message(watch.rank, watch.size, mine, call, waited, missing, lines,
                                   certain))
        self.ending = time.monotonic() + REPORT_LINGER_SECONDS
        return True

    def _judge_peers(self, watch):
        """Time the point-to-point call in flight on ``watch``; ask its peer alone, and
        report as ``peer_watch`` says."""
        peers, now = watch.peers, time.monotonic()
        if peers.seen != peers.started:
            peers.seen, peers.since, peers.inquiry = peers.started, now, None
            peers.next_inquiry = now + min(FIRST_INQUIRY_SECONDS, self.timeout)
        waited, peer = now - peers.since, peers.what[1]
        if peer in peers.finished:
            self._report_peers(watch, waited, None, only_certain=True)
        if self.ending is None and peers.inquiry is None and now >= peers.next_inquiry:
            peers.inquiry = Inquiry(watch, [peer])
        if self.ending is None and peers.inquiry is not None and peers.inquiry.done():
            answer, peers.inquiry = peers.inquiry.answers[peer], None
            if not self._report_peers(watch, waited, answer, only_certain=True):
                peers.next_inquiry = peers.since + min(2 * waited, self.timeout)
                if waited >= self.timeout:
                    self._report_peers(watch, waited, answer)

    def _report_peers(self, watch, waited, answer, only_certain=False):
        """As ``_report``, for the point-to-point call in flight on ``watch``."""
        what = watch.peers.what
        counts = (watch.started, {w.identity: w.started for w in self.watches})
        line, arrived, certain = peer_verdict(what, watch.rank, answer,
                                              watch.peers.finished.get(what[1]), counts)
        if only_certain and not certain:
            return False
        write_report(peer_stall_message(watch.rank, watch.size, what, waited, line, arrived,
                                        certain))
        self.ending = time.monotonic() + REPORT_LINGER_SECONDS
        return True

    def finish(self):
        """At the end of the script: stop the thread, tell every watched communicator's other
        ranks how many calls this rank made there, and wait for theirs; a rank that does not
        finish within the stall time is reported and the job ended (``exit_report``)."""
        from mpi4py import MPI

        self.stopping.set()
        self.thread.join()
        sends = self._announce()
        # Wait until the other ranks have announced their end too (what MPI_Finalize, which
        # comes next, waits for anyway), answering their questions meanwhile: no message is
        # left unmatched at MPI_Finalize, which a job of hundreds of communicators did not
        # survive. A rank still in a call hears this one's end and ends the job.
        started = time.monotonic()
        ask = started + self.timeout
        while not self._all_finished():
            if time.monotonic() >= ask:
                self._report_unfinished(time.monotonic() - started)
                ask = time.monotonic() + self.timeout
            time.sleep(1e-3)
        deadline = time.monotonic() + FINISH_SECONDS
        while sends and not MPI.Request.Testall(sends) and time.monotonic() < deadline:
            time.sleep(1e-3)
        self._check_counts()

    def _check_counts(self):
        """Once every rank has finished: end the job, reporting it, where the ranks of a
        communicator made different numbers of calls there (``exit_report.count_message``)."""
        for watch in self.watches:
            if not watch.diverged and any(count != watch.started
                                          for count in watch.finished.values()):
                write_report(count_message(watch.rank, watch.size, watch.started,
                                           call_text(watch.what), watch.finished))
                time.sleep(REPORT_LINGER_SECONDS)
                end_job()

    def _announce(self):
        """This rank's end, sent to every other rank of every watched communicator: its
        collectives there and its sends to and receives from that rank."""
        from mpi4py import MPI

        sends = []
        for watch in self.watches:
            for rank in range(watch.size):
                if rank != watch.rank:
                    counts = np.array([watch.started, watch.peers.sent[rank],
                                       watch.peers.received[rank]], np.int64)
                    try:
                        sends.append(watch.comm.Isend(counts, dest=rank, tag=FINISHED_TAG))
                    except MPI.Exception:  # a rank that has gone already
                        pass
        return sends

    def _all_finished(self):
        """Answer the questions that came, note the ends announced; whether every rank of
        every watched communicator has ended."""
        for watch in list(self.watches):
            if not self._listen(watch):
                self.watches.remove(watch)
        return all(len(w.finished) >= w.size - 1 for w in self.watches)

    def _report_unfinished(self, waited):
        """Ask the ranks that have not finished where they are (on the largest communicator
        that misses some, of those the most used), report them, and end the job
        ``REPORT_LINGER_SECONDS`` later, answering questions meanwhile. Unless each waits in
        a watched call: its own watchdog reports that call, and this rank asks again later."""
        watch = max((w for w in self.watches if len(w.finished) < w.size - 1),
                    key=lambda w: (w.size, w.started))
        missing = [r for r in range(watch.size) if r != watch.rank and r not in watch.finished]
        inquiry = Inquiry(watch, missing)
        while not inquiry.done():
            self._all_finished()
            time.sleep(1e-3)
        if self._all_finished() or all(in_a_call(inquiry.answers[r]) for r in missing):
            return
        lines = [unfinished_line(r, inquiry.answers[r]) for r in missing]
        write_report(exit_message(watch.rank, watch.size, waited, missing, lines))
        ending = time.monotonic() + REPORT_LINGER_SECONDS
        while time.monotonic() < ending:
            self._all_finished()
            time.sleep(1e-3)
        end_job()

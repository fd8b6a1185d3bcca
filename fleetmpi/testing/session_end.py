"""How the pytest session ends on every rank when the ranks cannot finish a test together.

A rank that fails a test before a collective leaves the others blocked in it, inside an MPI
call that cannot be cancelled: no later test can run on them. The stall watchdog sees such a
wait (``fleetmpi.comm.watchdog``) and, rather than aborting at once, hands the ending to
``SessionEnd.take_over`` (``stall_report.end_jobs_with``), in its own thread while the main
thread stays blocked. A rank that ends tells the others (a note on this communicator, which
each rank's listener thread watches for), so every rank ends, each the same way:

1. it sends the others a note of where it is (the test; the collective it waits in, with its
   call number and the test's line, or the end of the test it waits at, with its own failure)
   and collects theirs for ``NOTE_SECONDS``;
2. it reports the current test failed with every rank's line, as the phase pytest is in
   (the call of a blocked rank; the teardown of a rank waiting at the end), to pytest's own
   hooks, so the terminal and ``--junitxml`` record it like any failure;
3. it ends the session through pytest's ``pytest_sessionfinish``: the summary of everything
   that ran, the JUnit file, and the count of the tests not run;
4. it waits (at most ``WRITTEN_SECONDS``) until every rank has written its summary, then
   aborts the job with status 1: the blocked main threads cannot return.
"""
import json
import sys
import threading
import time

import pytest

from fleetmpi.comm.stall_report import main_thread_site
from fleetmpi.comm.watchdog import calls_in_flight
from fleetmpi.core.failure import REPORT_LINGER, abort

NOTE_TAG = 8
NOTE_BYTES = 4096
LISTEN_SECONDS = 0.1
NOTE_SECONDS = 3.0
WRITTEN_SECONDS = 10.0
PHASES = ("setup", "call", "teardown")


class SessionEnd:
    """The end of this rank's session (module docstring), over ``comm``, a communicator of its
    own. The plugin keeps it told of the test in progress (``item``), the phases reported
    (``logged``) and this rank's failures (``failed``); ``lockstep`` is the plugin's
    ``Lockstep``."""

    def __init__(self, config, comm):
        self.config, self.comm = config, comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.lockstep = None
        self.session = self.item = None
        self.logged = set()
        self.causes = {}
        self._lock = threading.Lock()
        self._ending = False
        self._stopped = threading.Event()
        self._listener = threading.Thread(target=self._listen, name="fleetmpi-session-end",
                                          daemon=True)

    def start(self, session):
        self.session = session
        self._listener.start()

    def stop_listening(self):
        """The session is over: no rank will ask this one to end it."""
        self.session = None
        self._stopped.set()
        if self._listener.is_alive():
            self._listener.join()

    def failed(self, report):
        """Note a failed report of this rank: the one line its note gives as the cause."""
        crash = getattr(report.longrepr, "reprcrash", None)
        lines = (crash.message if crash is not None else report.longreprtext).strip()
        cause = lines.splitlines()[0 if crash is not None else -1] if lines else "failed"
        self.causes.setdefault(report.nodeid, f"{report.when}: {cause}")

    def _listen(self):
        from mpi4py import MPI

        while not self._stopped.wait(LISTEN_SECONDS):
            if self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=NOTE_TAG):
                self.take_over()
                return

    def take_over(self):
        """End the session on this rank and then the job (module docstring); returns only
        where no session is in progress (the caller then aborts). A second caller on this
        rank waits for the first to abort."""
        with self._lock:
            ending, self._ending = self._ending, True
        if ending:
            while True:
                time.sleep(1.0)
        if self.session is None:
            return
        item = self.item
        mine = self._note(item)
        others = [r for r in range(self.size) if r != self.rank]
        sends = [self.comm.Isend(mine, dest=r, tag=NOTE_TAG) for r in others]
        notes = self._notes(others)
        notes[self.rank] = json.loads(mine)
        text = self._text(item, notes)
        if item is not None:
            self._report(item, text)
        self._finish(item, text)
        self._wait_for_the_others(sends)
        abort(None, code=1, linger=REPORT_LINGER)

    def _note(self, item):
        """Where this rank is, as the JSON bytes of its note."""
        nodeid = None if item is None else item.nodeid
        lockstep = self.lockstep.watch
        if lockstep.started != lockstep.ended:
            cause = self.causes.get(nodeid)
            where = (f"failed this test ({cause}) and " if cause else "") + \
                f"waits at the end of {nodeid}"
        else:
            calls = calls_in_flight(skip=self.lockstep.comm)
            where = (f"waits in {calls[0][0]}, call #{calls[0][1]} of its communicator"
                     if calls else "is in no fleetmpi collective")
            where += f", at {main_thread_site()}" + ("" if nodeid else ", between tests")
        return json.dumps({"nodeid": nodeid, "where": where}).encode()[:NOTE_BYTES]

    def _notes(self, others):
        """``{rank: note or None}`` of the other ranks, None where none came in time."""
        from mpi4py import MPI

        buffers = {r: bytearray(NOTE_BYTES) for r in others}
        pending = {r: self.comm.Irecv(buffers[r], source=r, tag=NOTE_TAG) for r in others}
        notes = {r: None for r in others}
        deadline = time.monotonic() + NOTE_SECONDS
        while pending and time.monotonic() < deadline:
            for r, request in list(pending.items()):
                status = MPI.Status()
                if request.Test(status):
                    notes[r] = json.loads(bytes(buffers[r][:status.Get_count(MPI.BYTE)]))
                    del pending[r]
            time.sleep(1e-3)
        for request in pending.values():
            request.Cancel()
            request.Free()
        return notes

    def _text(self, item, notes):
        nodeid = None if item is None else item.nodeid
        lines = []
        for r, note in sorted(notes.items()):
            if note is None:
                lines.append(f"rank {r} did not answer within {NOTE_SECONDS:g} s")
            elif note["nodeid"] not in (None, nodeid):
                lines.append(f"rank {r} is in {note['nodeid']} and {note['where']}")
            else:
                lines.append(f"rank {r} {note['where']}")
        not_run = self._not_run(item)
        return (f"fleetmpi.testing: the ranks cannot finish {nodeid or 'the session'} "
                f"together:\n" + "\n".join(lines) + "\nA collective that some rank never "
                f"joins cannot be abandoned (MPI cannot cancel it), so the session ends here "
                f"on every rank; {len(not_run)} test(s) not run.")

    def _not_run(self, item):
        items = self.session.items
        return items[items.index(item) + 1:] if item in items else []

    def _report(self, item, text):
        """Report ``item`` failed in the phase pytest is in (then its teardown), through
        pytest's hooks, with what the phase printed so far."""
        when = next((w for w in PHASES if w not in self.logged), None)
        if when is None:
            return
        capture = self.config.pluginmanager.getplugin("capturemanager")
        sections = []
        if capture is not None:
            capture.suspend_global_capture(in_=False)
            out, err = capture.read_global_capture()
            sections = [(f"Captured {name} {when}", value)
                        for name, value in (("stdout", out), ("stderr", err)) if value]
        keywords = {name: 1 for name in item.keywords}
        now = time.time()
        phases = [(when, "failed", text, sections)]
        if when != "teardown":
            phases.append(("teardown", "passed", None, []))
        for phase, outcome, longrepr, captured in phases:
            item.ihook.pytest_runtest_logreport(report=pytest.TestReport(
                item.nodeid, item.location, keywords, outcome, longrepr, phase, captured,
                start=now, stop=now, user_properties=item.user_properties))
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)

    def _finish(self, item, text):
        """pytest's end of the session: the summary and the JUnit file."""
        reporter = self.config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            reporter.write_sep("!", f"rank {self.rank}: the session ends early")
            reporter.write_line(text)
            for skipped in self._not_run(item):
                reporter.write_line(f"not run: {skipped.nodeid}")
        self.session.exitstatus = pytest.ExitCode.TESTS_FAILED
        self.config.hook.pytest_sessionfinish(session=self.session,
                                              exitstatus=pytest.ExitCode.TESTS_FAILED)
        sys.stdout.flush()
        sys.stderr.flush()

    def _wait_for_the_others(self, sends):
        """Until every rank has written its summary (a barrier), at most
        ``WRITTEN_SECONDS``: a rank that cannot answer does not keep the job."""
        from mpi4py import MPI

        requests = sends + [self.comm.Ibarrier()]
        deadline = time.monotonic() + WRITTEN_SECONDS
        while not MPI.Request.Testall(requests) and time.monotonic() < deadline:
            time.sleep(1e-3)

"""Commands with a deadline, and the budget that sets the deadlines.

A command runs in its own session, its output in a log file. ``GRACE_S`` seconds before its
deadline the whole session gets SIGINT, so that pytest still writes its JUnit XML for the
tests that ran, and at the deadline SIGKILL; so no command outlasts its share of the budget.
The command starts with SIGINT at its default even where this process ignores it (a run
started in the background of a script, or under ``nohup``, inherits it ignored, and so would
every command it starts: pytest would then be killed without writing its XML).
"""
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass

GRACE_S = 10
TAIL_LINES = 30
# The line a probe prints its findings on, as JSON.
RESULT = "RESULT "


@dataclass
class Finished:
    returncode: int
    timed_out: bool
    seconds: float
    log: str

    def tail(self, lines=TAIL_LINES):
        """The last ``lines`` lines of the command's output."""
        with open(self.log, errors="replace") as f:
            return f.read().splitlines()[-lines:]

    def result(self):
        """The JSON a probe printed on its ``RESULT`` line, or None."""
        with open(self.log, errors="replace") as f:
            found = [line for line in f if line.startswith(RESULT)]
        return json.loads(found[-1][len(RESULT):]) if found else None


def _signal_session(process, signum):
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass


def _default_sigint():
    """In the child, before the command starts (``Popen``'s ``preexec_fn``; this process runs
    no other thread): SIGINT back to its default, which Python turns into KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_bounded(cmd, env, cwd, timeout_s, log):
    """Run ``cmd`` for at most ``timeout_s`` seconds (at least 1), its output written to the
    file ``log``."""
    timeout_s = max(timeout_s, 1.0)
    grace_s = min(GRACE_S, timeout_s / 2)
    start = time.perf_counter()
    with open(log, "w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        process = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True, preexec_fn=_default_sigint)
        timed_out = False
        try:
            returncode = process.wait(timeout_s - grace_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _signal_session(process, signal.SIGINT)
            try:
                returncode = process.wait(grace_s)
            except subprocess.TimeoutExpired:
                returncode = None
            _signal_session(process, signal.SIGKILL)  # what is left of the session
            if returncode is None:
                returncode = process.wait()
    return Finished(returncode, timed_out, time.perf_counter() - start, log)


class Budget:
    """Seconds left of the whole run, shared by weight between the parts still to come."""

    def __init__(self, total_s, weights):
        self.total_s = total_s
        self.start = time.perf_counter()
        self.pending = dict(weights)

    def left(self):
        return self.total_s - (time.perf_counter() - self.start)

    def take(self, part):
        """The seconds ``part`` may use: its weight's share of what is left over the parts
        not yet begun (``part`` included); it then leaves the pending ones."""
        share = self.left() * self.pending[part] / sum(self.pending.values())
        del self.pending[part]
        return max(share, 1.0)

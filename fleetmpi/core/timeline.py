"""A Chrome-trace / Perfetto timeline of every rank's training steps on one time axis.

``FLEETMPI_TIMELINE=path.json`` (what ``fleetmpirun --timeline path.json`` sets) makes every
rank record, for each step, its ``forward``, ``backward`` and ``update`` (lane ``compute``), each
collective of the communication layer (lane ``comm``: name, algorithm, bytes) and each gradient
bucket's reduction (lane ``comm``: bucket index, algorithm, bytes). At the end rank 0 writes one
JSON file in the Chrome trace event format: ``"X"`` (complete) events with ``ts``/``dur`` in
microseconds, ``pid`` = rank, ``tid`` = lane (named by ``thread_name`` metadata), and a
``process_name`` of ``"rank r (node n)"`` per rank. Open it at https://ui.perfetto.dev or
chrome://tracing. ``start(path)`` and ``stop()`` do the same from code.

Writing. ``flush()`` (collective: every rank calls it; it also runs at interpreter exit) ends the
recording, gathers every rank's events to rank 0 over MPI, and rank 0 writes the file to a
temporary name and renames it, so a reader never sees half a file.

Memory. Events are not kept in memory: each rank appends them, as soon as they are complete and
at least once a second or every ``SPILL_EVENTS`` events, to its own part file
``path.json.rank<r>.part`` beside the output (a header line, then per write one line holding a
JSON array of ``[name, lane, start_ns, duration_ns, args]`` records), and ``flush()`` streams
the part files to rank 0 in chunks of ``CHUNK_BYTES``. Memory stays bounded however long the run;
the disk holds the trace (about 120 bytes per event). ``flush()`` removes the part files.

A job that dies keeps its part files: everything up to the last second before the failure.
``python -m fleetmpi.core.timeline merge path.json`` merges the part files found beside
``path.json``
into it (on several machines, copy the part files to one directory first). ``flush()`` itself
never hangs: if not every rank reaches it within ``timeout`` seconds it keeps the part files and
says so in the log.

One time axis. Events are stamped with ``time.perf_counter_ns()``, Linux's ``CLOCK_MONOTONIC``,
one clock for all processes of a machine. At ``flush()``, a rank on another machine than rank 0
measures its clock's offset to rank 0's by ping-pong (``CLOCK_SAMPLES`` round trips; of these,
the one with the shortest round trip gives ``offset = t_rank0 - (t_send + t_receive) / 2``,
off by at most half that round trip, microseconds on a cluster network); ranks on rank 0's
machine use offset 0, exactly. Measuring at the end rather than at the start assumes the
machines' clocks run at the same rate over the run, which NTP-disciplined clocks do to a few
parts per million. The crash merge has no rank 0 to ask, so it aligns machines by the wall clock
(``time.time_ns()``) read beside the monotonic one when each part file was opened: as good as
the machines' NTP synchronisation.

Cost. With the timeline off, a recording site costs one check of a module global. With it on,
an event costs a few microseconds (see docs/launch.md for the per-step measurement).
Threads. The training thread records the ``compute`` lane; a communicator's background thread
(``fleetmpi.comm.handles``) records the ``comm`` events of the asynchronous collectives it runs,
while backward goes on in the other lane. Events of one lane are expected in start order: a
blocking collective waits for the asynchronous ones before it starts.
"""
import atexit
import json
import os
import socket
import threading
import time

from . import files
from .knobs import TIMELINE

LANES = ("compute", "comm")
SPILL_EVENTS = 1024
SPILL_SECONDS = 1.0
CHUNK_BYTES = 4 << 20
CLOCK_SAMPLES = 8
FLUSH_TIMEOUT = 60.0
OUTCOME_BYTES = 1024
PART_SUFFIX = ".part"
_LANE_IDS = {lane: i for i, lane in enumerate(LANES)}
_TAG_CLOCK = 31
_TAG_CHUNK = 32

# The ``Recorder`` while the timeline records, else None. Read it (a collective's repeated path
# checks it on every call, where calling ``active()`` would cost a tenth of that call); only
# ``start``, ``stop`` and ``flush`` assign it.
active_recorder = None


class _NoSpan:
    """What ``span`` returns while the timeline is off: a context manager that does nothing,
    false in a boolean test so callers can skip work done only for the record."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __bool__(self):
        return False


NO_SPAN = _NoSpan()


class Span:
    """One complete event being recorded; ``args`` may be filled in before it ends."""

    __slots__ = ("recorder", "record", "args")

    def __init__(self, recorder, record):
        self.recorder = recorder
        self.record = record
        self.args = record[4]

    def __enter__(self):
        self.record[2] = time.perf_counter_ns()
        return self

    def __exit__(self, *exc):
        end = time.perf_counter_ns()
        self.record[3] = end - self.record[2]
        self.recorder.completed(end)
        return False


def part_path(path, rank):
    """The part file of ``rank`` for the timeline ``path``."""
    return f"{path}.rank{rank}{PART_SUFFIX}"


def _identity():
    """(rank, size, node or None) of this process: from ``fleet.init``'s topology, else from
    ``MPI.COMM_WORLD`` (node None: numbered from the host names when the file is written)."""
    from mpi4py import MPI

    from . import job

    if job.joined():
        t = job.topology()
        return t.rank, t.size, t.node_index
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size(), None


class Recorder:
    """This rank's events: complete ones go to its part file, see the module docstring."""

    def __init__(self, path):
        self.path = os.path.abspath(path)
        directory = os.path.dirname(self.path)
        if not os.path.isdir(directory):
            raise ValueError(f"{TIMELINE.name}={path!r}: directory {directory!r} does not exist")
        self.pending = []
        self.part = None
        self.rank = None
        self.start_ns = time.perf_counter_ns()
        self.first_ns = None
        self.last_spill = self.start_ns
        self.lock = threading.Lock()  # the training thread and communicators' threads record

    def span(self, name, lane, args):
        record = [name, _LANE_IDS[lane], 0, -1, args]
        with self.lock:
            if self.first_ns is None:
                self.first_ns = time.perf_counter_ns()
            self.pending.append(record)
        return Span(self, record)

    def completed(self, now):
        if len(self.pending) >= SPILL_EVENTS or now - self.last_spill >= SPILL_SECONDS * 1e9:
            with self.lock:
                self.spill()

    def _open_part(self):
        self.rank, _, node = _identity()
        self.part = files.open_for_writing(part_path(self.path, self.rank))
        header = {"rank": self.rank, "node": node, "host": socket.gethostname(),
                  "wall_ns": time.time_ns(), "mono_ns": time.perf_counter_ns()}
        self.part.write(json.dumps(header) + "\n")

    def spill(self, everything=False):
        """Append the complete events recorded so far (all of them when ``everything``: open
        ones are dropped) to the part file."""
        if self.part is None:
            self._open_part()
        done = len(self.pending)
        if not everything:
            for i, record in enumerate(self.pending):
                if record[3] < 0:
                    done = i
                    break
        records = [r for r in self.pending[:done] if r[3] >= 0]
        if records:
            self.part.write(json.dumps(records, separators=(",", ":")) + "\n")
            self.part.flush()
        del self.pending[:done]
        self.last_spill = time.perf_counter_ns()

    def close(self):
        """Write out everything and close the part file; returns its path."""
        with self.lock:
            self.spill(everything=True)
        self.part.close()
        return part_path(self.path, self.rank)


def span(name, lane="compute", **args):
    """A context manager that records ``name`` on ``lane`` (one of ``LANES``) with ``args``
    while the timeline is on, and does nothing (``NO_SPAN``) while it is off."""
    if active_recorder is None:
        return NO_SPAN
    return active_recorder.span(name, lane, args)


def active():
    """Whether the timeline is recording."""
    return active_recorder is not None


def start(path):
    """Start recording for the timeline file ``path`` (each rank, with the same path)."""
    global active_recorder
    if active_recorder is not None:
        raise RuntimeError(f"the timeline is already recording to {active_recorder.path!r}")
    active_recorder = Recorder(path)


def stop():
    """Stop recording and remove this rank's part file, writing nothing."""
    global active_recorder
    recorder, active_recorder = active_recorder, None
    if recorder is not None and recorder.part is not None:
        os.remove(recorder.close())


# writing the merged file

def _trace_event(rank, record, offset_ns, epoch_ns):
    name, lane, t, d, args = record
    return json.dumps({"name": name, "cat": LANES[lane], "ph": "X", "pid": rank, "tid": lane,
                       "ts": round((t + offset_ns - epoch_ns) / 1e3, 3),
                       "dur": round(d / 1e3, 3), "args": args}, separators=(",", ":"))


def _metadata(rank, node):
    label = f"rank {rank}" if node is None else f"rank {rank} (node {node})"
    events = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": label}},
              {"name": "process_sort_index", "ph": "M", "pid": rank,
               "args": {"sort_index": rank}}]
    for lane, tid in _LANE_IDS.items():
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                       "args": {"name": lane}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid,
                       "args": {"sort_index": tid}})
    return [json.dumps(e, separators=(",", ":")) for e in events]


def _read_part(filename):
    """The header and an iterator over the event records of one part file."""
    f = open(filename)
    try:
        header = json.loads(f.readline())
    except json.JSONDecodeError:
        f.close()
        raise ValueError(f"{filename} is not a timeline part file: its first line is no "
                         "JSON header") from None

    def records():
        with f:
            for line in f:
                try:
                    chunk = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by the end of its process
                    continue
                yield from chunk
    return header, records()


def _event_chunks(rank, records, offset_ns, epoch_ns):
    """The trace events of ``records`` as text, in pieces of about ``CHUNK_BYTES``."""
    lines, size = [], 0
    for record in records:
        line = _trace_event(rank, record, offset_ns, epoch_ns)
        lines.append(line)
        size += len(line) + 2
        if size >= CHUNK_BYTES:
            yield ",\n".join(lines)
            lines, size = [], 0
    if lines:
        yield ",\n".join(lines)


class _TraceWriter:
    """Writes the trace file under a temporary name, renamed into place by ``finish``.

    The first ``OSError`` (a folder at ``path``, a full disk) is kept in ``error`` and what
    follows is skipped, so that rank 0 still takes every rank's chunks, which the other ranks
    wait to hand over, and can tell them."""

    def __init__(self, path, other_data):
        self.path, self.error, self.file, self.tmp = path, None, None, None
        self.first = True
        self._guarded(self._open, other_data)

    def _guarded(self, action, *args):
        if self.error is None:
            try:
                action(*args)
            except OSError as error:
                self.error = error

    def _open(self, other_data):
        self.file, self.tmp = files.temporary_beside(self.path)
        self.file.write('{"displayTimeUnit":"ms","otherData":'
                        + json.dumps(other_data) + ',\n"traceEvents":[\n')

    def write(self, text):
        if text:
            self._guarded(self.file.write, text if self.first else ",\n" + text)
            self.first = False

    def _close(self):
        self.file.write("\n]}\n")
        self.file.close()
        os.replace(self.tmp, self.path)

    def finish(self):
        """Put the file in place; the error that kept it from being written, or None."""
        self._guarded(self._close)
        if self.error is not None and self.file is not None:
            self.file.close()
            if os.path.exists(self.tmp):
                os.remove(self.tmp)
        return self.error


def _node_indices(hosts):
    """Node of each rank when fleet.init has not numbered them: hosts in order of first rank."""
    order = {}
    for host in hosts:
        order.setdefault(host, len(order))
    return [order[h] for h in hosts]


def _wait(request, timeout):
    deadline = time.monotonic() + timeout
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def clock_offset(comm, same_host):
    """``(offset, round_trip)`` in ns: rank 0's clock minus this rank's, and the round trip of
    the ping-pong it was measured from (its error is at most half of that); ``(0, 0)`` on rank
    0 and where ``same_host``. Collective over ``comm``."""
    import numpy as np

    remote = np.zeros(comm.Get_size(), dtype=np.int8)
    comm.Allgather(np.array([not same_host], dtype=np.int8), remote)
    stamp = np.zeros(1, dtype=np.int64)
    if comm.Get_rank() == 0:
        for peer in np.flatnonzero(remote[1:]) + 1:
            for _ in range(CLOCK_SAMPLES):
                comm.Recv(stamp, source=int(peer), tag=_TAG_CLOCK)
                stamp[0] = time.perf_counter_ns()
                comm.Send(stamp, dest=int(peer), tag=_TAG_CLOCK)
        return 0, 0
    if same_host:
        return 0, 0
    best = None
    for _ in range(CLOCK_SAMPLES):
        sent = time.perf_counter_ns()
        comm.Send(stamp, dest=0, tag=_TAG_CLOCK)
        comm.Recv(stamp, source=0, tag=_TAG_CLOCK)
        received = time.perf_counter_ns()
        if best is None or received - sent < best[1]:
            best = (int(stamp[0]) - (sent + received) // 2, received - sent)
    return best


def _allgather_text(comm, text, width=256):
    import numpy as np

    mine = np.zeros(width, dtype=np.uint8)
    raw = text.encode()[:width]
    mine[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    every = np.empty((comm.Get_size(), width), dtype=np.uint8)
    comm.Allgather(mine, every)
    return [bytes(row).rstrip(b"\0").decode() for row in every]


def _send_chunks(comm, chunks):
    import numpy as np

    for chunk in chunks:
        data = np.frombuffer(chunk.encode(), dtype=np.uint8)
        comm.Send(np.array([data.size], dtype=np.int64), dest=0, tag=_TAG_CHUNK)
        comm.Send(data, dest=0, tag=_TAG_CHUNK)
    comm.Send(np.zeros(1, dtype=np.int64), dest=0, tag=_TAG_CHUNK)


def _receive_chunks(comm, source):
    import numpy as np

    size = np.empty(1, dtype=np.int64)
    while True:
        comm.Recv(size, source=source, tag=_TAG_CHUNK)
        if size[0] == 0:
            return
        data = np.empty(int(size[0]), dtype=np.uint8)
        comm.Recv(data, source=source, tag=_TAG_CHUNK)
        yield data.tobytes().decode()


def _write_gathered(comm, recorder, part):
    """Every rank's part file merged into rank 0's trace file; collective over ``comm``.
    Rank 0 returns the error that kept it from writing the file, or None."""
    import numpy as np
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    header, records = _read_part(part)
    hosts = _allgather_text(comm, header["host"])
    offset, _ = clock_offset(comm, hosts[rank] == hosts[0])
    first = recorder.start_ns if recorder.first_ns is None else recorder.first_ns
    epoch = np.array([first + offset], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, epoch, op=MPI.MIN)
    epoch = int(epoch[0])
    nodes = np.empty(size, dtype=np.int64)
    comm.Allgather(np.array([-1 if header["node"] is None else header["node"]]), nodes)
    if (nodes < 0).any():
        nodes = _node_indices(hosts)
    offsets = np.empty(size, dtype=np.int64)
    comm.Allgather(np.array([offset], dtype=np.int64), offsets)
    chunks = _event_chunks(rank, records, offset, epoch)
    if rank != 0:
        _send_chunks(comm, chunks)
        return None
    writer = _TraceWriter(recorder.path, {
        "clock": "CLOCK_MONOTONIC, aligned to rank 0 at flush",
        "clock_offset_us": [round(int(o) / 1e3, 3) for o in offsets], "hosts": hosts})
    for r in range(size):
        writer.write(",\n".join(_metadata(r, int(nodes[r]))))
    for chunk in chunks:
        writer.write(chunk)
    for source in range(1, size):
        for chunk in _receive_chunks(comm, source):
            writer.write(chunk)
    return writer.finish()


def _shared_outcome(comm, error, timeout):
    """Rank 0's ``error`` writing the file (None: written) as text, on every rank, without a
    wait longer than ``timeout`` (None: not every rank got it in time)."""
    import numpy as np

    text = np.zeros(OUTCOME_BYTES, dtype=np.uint8)
    if comm.Get_rank() == 0 and error is not None:
        raw = str(error).encode()[:OUTCOME_BYTES - 1] or b"?"
        text[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    if not _wait(comm.Ibcast(text, root=0), timeout):
        return None
    return bytes(text).rstrip(b"\0").decode(errors="replace")


def flush(timeout=FLUSH_TIMEOUT):
    """End the recording and write the timeline file (rank 0); every rank must call it.

    Returns the file's path, or None when nothing was recording or when not every rank arrived
    within ``timeout`` seconds (the part files are then kept for ``merge``)."""
    global active_recorder
    recorder, active_recorder = active_recorder, None
    if recorder is None:
        return None
    from mpi4py import MPI

    from .log import logger

    if MPI.Is_finalized():
        logger.warning("timeline: MPI was finalized before the timeline was written; the part "
                       "files %s stay for 'python -m fleetmpi.core.timeline merge'",
                       part_path(recorder.path, "*"))
        recorder.close()
        return None
    part = recorder.close()
    arrived = MPI.COMM_WORLD.Ibarrier()
    if not _wait(arrived, timeout):
        logger.warning("timeline: not every rank called flush() within %.0f s; the part files "
                       "%s stay for 'python -m fleetmpi.core.timeline merge %s'", timeout,
                       part_path(recorder.path, "*"), recorder.path)
        return None
    comm = MPI.COMM_WORLD.Dup()
    try:
        outcome = _shared_outcome(comm, _write_gathered(comm, recorder, part), timeout)
    finally:
        comm.Free()
    if outcome:
        logger.error("timeline: rank 0 could not write %s: %s; the part files %s stay for "
                     "'python -m fleetmpi.core.timeline merge %s' once it can be written",
                     recorder.path, outcome, part_path(recorder.path, "*"), recorder.path)
        return None
    if outcome is None:
        logger.warning("timeline: rank 0 did not say within %.0f s whether it wrote %s; the "
                       "part files %s stay", timeout, recorder.path,
                       part_path(recorder.path, "*"))
        return None
    os.remove(part)
    return recorder.path


def _flush_at_exit():
    if active_recorder is not None:
        flush()


# merging the part files of a job that died

def merge(path):
    """Merge the part files beside ``path`` into the timeline file ``path``, aligning machines by
    the wall clock (see the module docstring); the part files are left in place."""
    import glob

    path = os.path.abspath(path)
    parts = glob.glob(part_path(glob.escape(path), "*"))
    if not parts:
        raise FileNotFoundError(f"no part files {part_path(path, '*')} to merge")
    opened = sorted((_read_part(p) for p in parts), key=lambda hr: hr[0]["rank"])
    headers = [h for h, _ in opened]
    reference = headers[0]
    hosts = [h["host"] for h in headers]
    nodes = ([h["node"] for h in headers] if all(h["node"] is not None for h in headers)
             else _node_indices(hosts))
    offsets = [0 if h["host"] == reference["host"] else
               (h["wall_ns"] - h["mono_ns"]) - (reference["wall_ns"] - reference["mono_ns"])
               for h in headers]
    epoch = min(h["mono_ns"] + o for h, o in zip(headers, offsets))
    writer = _TraceWriter(path, {
        "clock": "CLOCK_MONOTONIC, machines aligned by their wall clocks (merged part files)",
        "ranks": [h["rank"] for h in headers], "hosts": hosts})
    for h, node in zip(headers, nodes):
        writer.write(",\n".join(_metadata(h["rank"], node)))
    for (h, records), offset in zip(opened, offsets):
        for chunk in _event_chunks(h["rank"], records, offset, epoch):
            writer.write(chunk)
    writer.finish()
    return path


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fleetmpi.core.timeline",
                                     description="Merge the per-rank part files of a timeline "
                                                 "whose job ended before writing it.")
    sub = parser.add_subparsers(dest="command", required=True)
    merge_parser = sub.add_parser("merge", help="merge PATH.rank*.part into PATH")
    merge_parser.add_argument("path")
    args = parser.parse_args(argv)
    try:
        print(merge(args.path))
    except FileNotFoundError as error:
        finished = (" (the job finished: its timeline was written whole, with nothing left to "
                    "merge)" if os.path.isfile(args.path) else "")
        parser.exit(1, f"python -m fleetmpi.core.timeline merge: {error}{finished}\n")
    except ValueError as error:  # a part file that cannot be read
        parser.exit(1, f"python -m fleetmpi.core.timeline merge: {error}\n")


atexit.register(_flush_at_exit)
if __name__ == "__main__":
    main()
elif TIMELINE.value():
    start(TIMELINE.value())

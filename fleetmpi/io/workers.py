"""Worker processes that load batches ahead of the training loop.

Each worker is a forked copy of the training process (fork: the dataset and ``collate_fn``
need not pickle, as with PyTorch's default on Linux). A worker only reads samples and collates
them on the host; it never calls MPI or touches a device, and it leaves through ``os._exit``
(multiprocessing's way for forked children), so the parent's MPI and exit hooks never run in
it. Batch ``i`` of an epoch goes to worker ``i % num_workers``; results come back on one queue
and are handed out in order. A worker's exception comes back with its traceback and ends the
loop; a worker that dies without a word (killed, out of memory) is noticed within
``POLL_S`` and ends the loop naming it.
"""
import multiprocessing
import os
import queue
import traceback

POLL_S = 0.5
# A worker's task to run its own copy of an IterableDataset's stream, and the number that
# marks the stream's end.
STREAM, END = "stream", "end"


class WorkerInfo:
    """What ``get_worker_info()`` returns inside a worker: ``id``, ``num_workers``,
    ``dataset`` and ``seed``."""

    def __init__(self, id, num_workers, dataset, seed):
        self.id, self.num_workers, self.dataset, self.seed = id, num_workers, dataset, seed


_worker_info = None


def get_worker_info():
    """This worker's ``WorkerInfo``, or None in the main process."""
    return _worker_info


class WorkerError(RuntimeError):
    """A DataLoader worker raised, or died."""


def _work(worker_id, num_workers, dataset, seed, fetch, worker_init_fn, tasks, results):
    global _worker_info
    _worker_info = WorkerInfo(worker_id, num_workers, dataset, seed)
    import numpy as np

    np.random.seed(seed % 2**32)
    number = None  # the batch being made: a failure takes its place in the order
    try:
        if worker_init_fn is not None:
            worker_init_fn(worker_id)
        while True:
            task = tasks.get()
            if task is None:
                return
            if task == STREAM:
                number = (worker_id, 0)
                for batch in fetch():
                    results.put((number, batch, None))
                    number = (worker_id, number[1] + 1)
                results.put(((worker_id, END), None, None))
                continue
            number, indices = task
            results.put((number, fetch(indices), None))
    except BaseException:  # noqa: BLE001 - every failure goes back to the loop, with its text
        results.put((number, None, f"DataLoader worker {worker_id} (pid {os.getpid()}) "
                                   "raised:\n" + traceback.format_exc()))


class _Failed:
    """A batch a worker failed to make: the loop raises its text when the batch's turn comes,
    after the batches before it."""

    def __init__(self, text):
        self.text = text


class WorkerPool:
    """``num_workers`` forked workers running ``fetch``: ``fetch(indices)`` (a collated host
    batch) for the batches handed to ``run``, or ``fetch()`` (an iterator of collated batches
    of the worker's copy of an IterableDataset) for ``stream``."""

    def __init__(self, num_workers, dataset, fetch, base_seed, worker_init_fn=None,
                 timeout=0):
        context = multiprocessing.get_context("fork")
        self.results = context.Queue()
        self.tasks = [context.Queue() for _ in range(num_workers)]
        self.timeout = timeout
        self.processes = [
            context.Process(target=_work, daemon=True, name=f"fleetmpi DataLoader worker {i}",
                            args=(i, num_workers, dataset, base_seed + i, fetch, worker_init_fn,
                                  self.tasks[i], self.results))
            for i in range(num_workers)]
        for process in self.processes:
            process.start()

    def run(self, batches, prefetch):
        """Yield the collated batches of ``batches`` (lists of indices) in order, keeping at
        most ``prefetch`` of them in flight."""
        pending, ready, sent, handed = iter(batches), {}, 0, 0
        exhausted = False
        while True:
            while not exhausted and sent - handed < prefetch:
                indices = next(pending, None)
                if indices is None:
                    exhausted = True
                    break
                self.tasks[sent % len(self.tasks)].put((sent, indices))
                sent += 1
            if handed == sent:
                return
            while handed not in ready:
                number, batch = self._next_batch()
                ready[number] = batch
            yield self._checked(ready.pop(handed))
            handed += 1

    def stream(self):
        """Yield each worker's stream of batches, taking one from each worker in turn (skipping
        the workers whose stream has ended), so the order does not depend on their speed."""
        for tasks in self.tasks:
            tasks.put(STREAM)
        buffers = {worker: [] for worker in range(len(self.tasks))}
        ended, turn = object(), 0
        while buffers:
            worker = sorted(buffers)[turn % len(buffers)]
            while not buffers[worker]:
                (source, number), batch = self._next_batch()
                buffers[source].append(ended if number == END else batch)
            item = buffers[worker].pop(0)
            if item is ended:
                del buffers[worker]
                turn = turn % len(buffers) if buffers else 0
                continue
            yield self._checked(item)
            turn += 1

    def _next_batch(self):
        """``(number, batch)`` of the next result, a failure as a ``_Failed`` batch; a worker
        that failed before it made any batch (its ``worker_init_fn``) ends the loop at once."""
        number, batch, failure = self._next_result()
        if failure is None:
            return number, batch
        if number is None:
            self.close()
            raise WorkerError(failure)
        return number, _Failed(failure)

    def _checked(self, batch):
        if isinstance(batch, _Failed):
            self.close()
            raise WorkerError(batch.text)
        return batch

    def _next_result(self):
        waited = 0.0
        while True:
            try:
                return self.results.get(timeout=POLL_S)
            except queue.Empty:
                waited += POLL_S
            dead = [p for p in self.processes if not p.is_alive()]
            if dead:
                # A worker puts its last result (a failure's traceback) before it exits, but
                # the result may reach the queue after the exit is seen: read it first.
                try:
                    return self.results.get(timeout=POLL_S)
                except queue.Empty:
                    pass
                self.close()
                raise WorkerError("DataLoader worker " + ", ".join(
                    f"{p.name.rsplit(' ', 1)[-1]} (pid {p.pid}) died with exit code "
                    f"{p.exitcode}" for p in dead) + " before returning its batch")
            if self.timeout and waited >= self.timeout:
                self.close()
                raise WorkerError(f"no batch from the DataLoader workers within timeout="
                                  f"{self.timeout} s")

    def close(self):
        """Stop every worker: asked first, then terminated."""
        for tasks in self.tasks:
            try:
                tasks.put_nowait(None)
            except (ValueError, OSError):
                pass
        for process in self.processes:
            process.join(timeout=1)
            if process.is_alive():
                process.terminate()
                process.join()
        self.processes = []

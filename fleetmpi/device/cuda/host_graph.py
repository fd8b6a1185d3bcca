"""``HostGraph``: what stands in for a CUDA graph of a step where the arrays are NumPy's.

On the host nothing records kernel launches, so the stand-in records the step itself: capture
runs it once under the capture checks (``fleetmpi.core.capture_checks``, as a CUDA graph's capture
does) and keeps it; replay runs it again under the same checks and writes the arrays it
returns into those the capture returned, which stay the static outputs, as a graph's do.
Whatever a GPU capture refuses is refused here too, at capture and at every replay; a replay
that returns other arrays than the capture did took another path through the step's Python,
which a CUDA graph would not have followed, and is refused. What only the device shows (the
kernels replay bit for bit, the graph's pool keeps its memory) the GPU tests prove.
"""
from ...core import capture_checks


def _layout(arrays):
    return [f"{a.dtype} {tuple(a.shape)}" for a in arrays]


class HostGraph:
    """``capture(fn)`` (``fn`` returns a list of arrays), ``replay()``, ``reset()`` and
    ``captured``, as ``CUDAGraph`` has them; unlike a CUDA graph's, its capture runs the work."""

    capture_runs_the_work = True

    def __init__(self):
        self._step = None
        self._outputs = None

    @property
    def captured(self):
        return self._step is not None

    def __repr__(self):
        return f"HostGraph({'captured' if self.captured else 'empty'})"

    def capture(self, fn):
        """Run ``fn()`` under the capture checks and keep it; returns its arrays."""
        if self._step is not None:
            raise RuntimeError("this HostGraph holds a captured step; reset() it before "
                               "capturing another")
        with capture_checks.capturing(self):
            outputs = list(fn())
        self._step, self._outputs = fn, outputs
        return outputs

    def replay(self):
        """Run the step again under the capture checks; its arrays go into the captured ones."""
        if self._step is None:
            raise RuntimeError("replay() needs a captured step (reset() drops it)")
        with capture_checks.capturing(self):
            outputs = list(self._step())
        if _layout(outputs) != _layout(self._outputs):
            raise capture_checks.CaptureError(
                f"the step returned {_layout(outputs)} on replay but {_layout(self._outputs)} "
                "at capture: its Python took another path, which a CUDA graph would not "
                "follow (it replays the captured work)")
        for static, new in zip(self._outputs, outputs):
            if new is not static:
                static[...] = new

    def reset(self):
        """Drop the captured step."""
        self._step = self._outputs = None

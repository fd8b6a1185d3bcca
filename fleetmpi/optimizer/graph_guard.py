"""The optimizer's part in CUDA graph captures: what its update cannot let a graph keep.

An update captured in a graph takes its scalars (learning rate, step count) from the host once,
at capture, and every replay uses those. Where a scalar changes from step to step on the host
(an ``LRScheduler``'s learning rate, or what an optimizer's ``capture_refusal`` names), the
update refuses to be captured (Adam counts its updates on the device instead); a fixed learning rate is captured, and
``set_lr`` is refused while a graph that captured the update still holds it, since its replays
would go on with the old rate.
"""
import weakref

from ..core import capture_checks
from .lr import LRScheduler

# optimizer -> (the graph that captured its update, the learning rate it captured)
_captured = weakref.WeakKeyDictionary()


def enter_update(optimizer, lr):
    """Called by ``optimizer.step()`` with the learning rate of the update: inside a capture,
    raise ``CaptureError`` where the update cannot be captured, else remember the graph."""
    graph = capture_checks.current
    if graph is None:
        return
    name = type(optimizer).__name__
    if isinstance(optimizer._learning_rate, LRScheduler):
        capture_checks.refuse(f"{name}.step() with an LRScheduler",
                              "the scheduler's learning rate is a host value that a graph "
                              "would keep at its captured value; use a fixed learning rate")
    if optimizer.capture_refusal is not None:
        capture_checks.refuse(f"{name}.step()", optimizer.capture_refusal)
    _captured[optimizer] = (weakref.ref(graph), lr)


def check_new_lr(optimizer, value):
    """Raise a RuntimeError when a graph that captured ``optimizer``'s update still holds it
    (its replays keep the captured learning rate)."""
    graph_ref, lr = _captured.get(optimizer, (None, None))
    graph = graph_ref() if graph_ref is not None else None
    if graph is not None and graph.captured:
        raise RuntimeError(f"set_lr({value!r}): this {type(optimizer).__name__}'s update was "
                           f"captured in a CUDA graph with learning rate {lr!r}, which every "
                           "replay keeps; reset() the graph (a graphed step captures again at "
                           "its next call) before changing the learning rate")
